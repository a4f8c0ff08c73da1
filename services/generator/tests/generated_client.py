"""The generator through the Python client openapi-python-client generated from
`openapi/generator.json` (`tests/generated_client.rs` generates it and runs this with the
package on PYTHONPATH). Whole answers are the client's typed models; streamed answers are
read from the client's own httpx connection, each server-sent chunk parsed with the same
models.

Usage: generated_client.py BASE_URL MODEL
"""

import json
import sys

from keel_generator_client import Client
from keel_generator_client.api.crateopenai import chat_completions, completions, model, models, tokenize
from keel_generator_client.models import (
    ChatRequest,
    ChatResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def stream(client, path, body):
    """The JSON chunks of a streamed request, checking that `[DONE]` ends it."""
    chunks = []
    with client.get_httpx_client().stream("POST", path, json=body) as response:
        check(response.status_code == 200, f"{path}: {response.status_code}")
        check(response.headers["content-type"].startswith("text/event-stream"), response.headers["content-type"])
        data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    check(data and data[-1] == "[DONE]", f"{path}: the stream ends with [DONE]: {data[-1:]}")
    return [json.loads(d) for d in data[:-1]]


def main():
    base_url, name = sys.argv[1], sys.argv[2]
    client = Client(base_url=base_url, raise_on_unexpected_status=True)

    request = CompletionRequest(model=name, prompt="What is 2 + 3?", max_tokens=8, temperature=0.0, seed=1,
                                ignore_eos=True, logprobs=1)
    whole = completions.sync(client=client, body=request)
    check(isinstance(whole, CompletionResponse), f"a typed completion: {whole!r}")
    check(whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8, repr(whole))
    body = request.to_dict()
    body["stream"] = True
    chunks = [CompletionResponse.from_dict(c) for c in stream(client, "/v1/completions", body)]
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    check(text == whole.choices[0].text, f"streamed {text!r} vs {whole.choices[0].text!r}")

    chat = ChatRequest.from_dict({"model": name, "messages": [{"role": "user", "content": "Add 4 and 5."}],
                                  "max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    answer = chat_completions.sync(client=client, body=chat)
    check(isinstance(answer, ChatResponse) and answer.choices[0].message.role == "assistant", repr(answer))
    body = chat.to_dict()
    body["stream"] = True
    chunks = [ChatResponse.from_dict(c) for c in stream(client, "/v1/chat/completions", body)]
    content = "".join(choice.delta.content for chunk in chunks for choice in chunk.choices if choice.delta)
    check(content == answer.choices[0].message.content, f"streamed chat {content!r}")

    listed = models.sync(client=client)
    check(isinstance(listed, ModelList) and listed.data[0].id == name, repr(listed))
    card = model.sync(name, client=client)
    check(isinstance(card, ModelCard) and card.id == name, repr(card))
    missing = model.sync("other", client=client)
    check(isinstance(missing, ErrorResponse) and missing.error.code == "model_not_found", repr(missing))
    tokens = tokenize.sync(client=client, body=TokenizeRequest(prompt="12 + 30"))
    check(isinstance(tokens, TokenizeResponse) and tokens.count == len(tokens.tokens), repr(tokens))
    print("ok")


if __name__ == "__main__":
    main()
