"""Drives a running `kestrel serve` with the official OpenAI Python client.

Usage: python3 openai_client.py BASE_URL API_KEY MODEL
Exits non-zero (with the failing check) if anything differs from what the API promises.
"""

import sys

import openai


def main() -> None:
    url, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)

    ids = [m.id for m in client.models.list().data]
    assert ids == [model], ids

    messages = [{"role": "user", "content": "Name three colors."}]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0
    )
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length"), r.choices[0].finish_reason
    assert 0 < r.usage.completion_tokens <= 12, r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    # Streaming gives the same text, then a usage chunk.
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == text, ("".join(pieces), text)
    assert finish == r.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens

    # A stop string cuts the text right before its first occurrence.
    middle = text[len(text) // 2 : len(text) // 2 + 3]
    if middle.strip():
        s = client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0, stop=[middle]
        )
        assert s.choices[0].message.content == text[: text.find(middle)], (
            s.choices[0].message.content,
            text,
            middle,
        )
        assert s.choices[0].finish_reason == "stop"

    # Legacy completions with log-probabilities: greedy picks the best of the top ones.
    c = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == c.usage.completion_tokens == len(lp.token_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert abs(chosen - max(top.values())) < 1e-5, (chosen, top)
    assert "".join(lp.tokens) == c.choices[0].text

    # Errors come back as the client's exception types.
    for call, exc in [
        (lambda: client.completions.create(model="no-such-model", prompt="x"), openai.NotFoundError),
        (lambda: client.completions.create(model=model, prompt="x", max_tokens=-1), openai.BadRequestError),
        (lambda: client.completions.create(model=model, prompt="x", n=99), openai.BadRequestError),
        (
            lambda: openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list(),
            openai.AuthenticationError,
        ),
    ]:
        try:
            call()
        except exc:
            pass
        else:
            raise AssertionError(f"expected {exc.__name__}")
    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
