"""Drives a running keel-generator with the official `openai` Python client.

Usage: openai_client.py BASE_URL MODEL. Exits non-zero (with the failed check on stderr)
unless completions and chat, streaming and not, n > 1, stop strings, logprobs, Keel's extra
fields, lists of prompts, the model routes and the error types all behave as OpenAI's API does.
"""

import sys

import openai


def check(condition, message):
    if not condition:
        print(f"check failed: {message}", file=sys.stderr)
        sys.exit(1)


def main():
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)

    # Completions, not streamed, with logprobs.
    prompt = "What is 2 + 3?"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.7, seed=11,
                                      logprobs=2, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = whole.choices[0]
    check(choice.finish_reason == "length", f"finish_reason {choice.finish_reason}")
    check(len(choice.logprobs.token_logprobs) == 12, "12 token logprobs")
    # The 2 most likely tokens, plus the sampled one when it is not among them (OpenAI's legacy
    # format), most likely first; a token whose text is already a key is keyed by its id.
    tops = choice.logprobs.top_logprobs
    check(all(2 <= len(t) <= 3 for t in tops), "2 top logprobs per token, and the sampled token")
    check(all(list(t.values()) == sorted(t.values(), reverse=True) for t in tops), "top logprobs by probability")
    check(all(token in t or any(k.startswith("token_id:") for k in t)
              for token, t in zip(choice.logprobs.tokens, tops)), "the sampled token among the top logprobs")
    check(len(choice.model_extra["token_ids"]) == 12, "return_token_ids")
    check(whole.usage.completion_tokens == 12, f"usage {whole.usage}")

    # The same request streamed gives the same text and a usage chunk.
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.7, seed=11,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    check("".join(pieces) == choice.text, f"streamed {''.join(pieces)!r} vs {choice.text!r}")
    check(usage is not None and usage.completion_tokens == 12, f"stream usage {usage}")

    # A stop string taken from the text cuts it there.
    text = choice.text
    stop = next((text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip()), None)
    check(stop is not None, f"no stop candidate in {text!r}")
    stopped = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.7, seed=11,
                                        stop=[stop], extra_body={"ignore_eos": True})
    check(stopped.choices[0].text == text[:text.index(stop)], f"stop {stop!r}: {stopped.choices[0].text!r}")
    check(stopped.choices[0].finish_reason == "stop", "finish_reason stop")

    # Chat with n = 3 and logprobs; streamed chat equals the same request not streamed.
    messages = [{"role": "user", "content": "Add 4 and 5."}]
    chat = client.chat.completions.create(model=model, messages=messages, n=3, max_tokens=8, temperature=1.0,
                                          seed=4, logprobs=True, top_logprobs=2)
    check(len(chat.choices) == 3, "three choices")
    for c in chat.choices:
        check(c.message.role == "assistant" and isinstance(c.message.content, str), "assistant message")
        check(all(len(t.top_logprobs) == 2 for t in c.logprobs.content), "chat top logprobs")
    one = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.9, seed=8)
    streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.9,
                                              seed=8, stream=True)
    content = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    check(content == one.choices[0].message.content, f"chat stream {content!r} vs {one.choices[0].message.content!r}")

    # Errors are OpenAI's.
    try:
        client.completions.create(model=model, prompt=prompt, max_tokens=100000)
        check(False, "an over-long request must fail")
    except openai.BadRequestError as e:
        check("maximum context length" in str(e), str(e))
    try:
        client.completions.create(model="no-such-model", prompt=prompt, max_tokens=2)
        check(False, "an unknown model must fail")
    except openai.NotFoundError:
        pass
    models = client.models.list()
    check([m.id for m in models.data] == [model], "models list")
    check(client.models.retrieve(model).id == model, "the model by its name")

    # A list of prompts in one request: prompt p's samples are choices p*n .. p*n + n - 1, each
    # what the prompt gets alone.
    prompts = ["What is 2 + 3?", "Add 4 and 5."]
    batch = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=5, temperature=0.8, seed=3,
                                      extra_body={"ignore_eos": True})
    check(sorted(c.index for c in batch.choices) == [0, 1, 2, 3], "four choices")
    for p, single_prompt in enumerate(prompts):
        single = client.completions.create(model=model, prompt=single_prompt, n=2, max_tokens=5, temperature=0.8,
                                           seed=3, extra_body={"ignore_eos": True})
        for i in range(2):
            got = next(c.text for c in batch.choices if c.index == p * 2 + i)
            check(got == single.choices[i].text, f"prompt {p} sample {i}: {got!r} vs {single.choices[i].text!r}")
    print("ok")


if __name__ == "__main__":
    main()
