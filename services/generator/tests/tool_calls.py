"""Drives a generator serving a model that calls tools, with the official `openai` client.

Usage: tool_calls.py BASE_URL MODEL QUESTION. The model has learned to answer QUESTION with a
call of `add(a=4, b=5)` and, given the tool's result 9, to say "The sum is 9.". Exits
non-zero (the failed check on stderr) unless the call comes back parsed, streamed and not,
and the round trip with the tool's result gets the answer.
"""

import json
import sys

import openai


def check(condition, message):
    if not condition:
        print(f"check failed: {message}", file=sys.stderr)
        sys.exit(1)


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two numbers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                         "required": ["a", "b"]}}}]


def main():
    base_url, model, question = sys.argv[1], sys.argv[2], sys.argv[3]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": question}]

    reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=128)
    choice = reply.choices[0]
    check(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason}: {choice.message}")
    calls = choice.message.tool_calls
    check(calls is not None and len(calls) == 1, f"one call: {choice.message}")
    check(calls[0].type == "function" and calls[0].function.name == "add", f"the add tool: {calls[0]}")
    check(json.loads(calls[0].function.arguments) == {"a": 4, "b": 5}, f"arguments {calls[0].function.arguments}")
    check(choice.message.content is None, f"no content beside the call: {choice.message.content!r}")

    # Streamed: the same call, in tool-call deltas, and the same finish reason.
    stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=128, stream=True)
    streamed, finish, content = {}, None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for delta in c.delta.tool_calls or []:
                entry = streamed.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                if delta.function:
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
            finish = c.finish_reason or finish
    check(finish == "tool_calls", f"streamed finish_reason {finish}")
    check(len(streamed) == 1 and streamed[0]["name"] == "add", f"streamed calls {streamed}")
    check(json.loads(streamed[0]["arguments"]) == {"a": 4, "b": 5}, f"streamed arguments {streamed}")
    check(streamed[0]["id"], "a streamed call has an id")
    check(content == "", f"no content streamed before the call: {content!r}")

    # The round trip: the call and the tool's result go back; the model answers.
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "add", "arguments": calls[0].function.arguments}}]})
    messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": "9"})
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=48)
    check(answer.choices[0].message.content == "The sum is 9.", f"answer {answer.choices[0].message}")
    check(answer.choices[0].finish_reason == "stop", f"answer finish_reason {answer.choices[0].finish_reason}")
    check(not answer.choices[0].message.tool_calls, "no call in the answer")

    # tool_choice required and named: the call is constrained to the tool's schema.
    for tool_choice in ["required", {"type": "function", "function": {"name": "add"}}]:
        forced = client.chat.completions.create(model=model, messages=messages[:1], tools=TOOLS,
                                                tool_choice=tool_choice, temperature=0, max_tokens=128)
        forced_calls = forced.choices[0].message.tool_calls
        check(forced.choices[0].finish_reason == "tool_calls" and forced_calls and
              forced_calls[0].function.name == "add", f"tool_choice {tool_choice}: {forced.choices[0]}")
        check(json.loads(forced_calls[0].function.arguments) == {"a": 4, "b": 5},
              f"tool_choice {tool_choice}: {forced_calls[0].function.arguments}")

    # tool_choice none: no tools in the prompt and no calls parsed.
    plain = client.chat.completions.create(model=model, messages=messages[:1], tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=8)
    check(not plain.choices[0].message.tool_calls and plain.choices[0].finish_reason != "tool_calls",
          f"tool_choice none: {plain.choices[0]}")
    print("ok")


if __name__ == "__main__":
    main()
