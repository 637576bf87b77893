"""An OpenAI-compatible server seen through the real `openai` Python client.

    python openai_check.py --base-url http://127.0.0.1:PORT/v1 --model NAME

Checks, each against the server's own answers (greedy, so every answer is
reproducible): the model list; chat completions streamed and not (the
streamed text, finish reason and usage equal the non-streamed ones); text
completions streamed and not; usage counts (completion tokens equal the
generated length when the length limit ends the answer, prompt tokens equal
between the two forms); stop strings (the answer ends just before the stop
string's first occurrence, with finish reason `stop`); and a stream the
client closes after two chunks (the server answers the next request, and
that answer equals the one before). Prints one line per check; exits 1 on
the first failure with what differed.
"""

from __future__ import annotations

import argparse
import sys

import openai

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
PROMPT = "The capital of France is"


def check(cond: bool, what: str) -> None:
    if not cond:
        print(f"FAIL: {what}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


def chat(client: openai.OpenAI, model: str, max_tokens: int, **kw):
    return client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=0, seed=0, **kw
    )


def streamed_chat(client: openai.OpenAI, model: str, max_tokens: int, **kw):
    text, finish, usage, chunks = "", None, None, 0
    stream = chat(client, model, max_tokens, stream=True, stream_options={"include_usage": True}, **kw)
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, usage, chunks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)
    model, n = args.model, args.max_tokens

    ids = [m.id for m in client.models.list().data]
    check(model in ids, f"models: {model!r} listed in {ids}")

    full = chat(client, model, n)
    text = full.choices[0].message.content
    check(full.choices[0].message.role == "assistant", "chat: role assistant")
    check(bool(text), f"chat: a non-empty answer, got {text!r}")
    u = full.usage
    check(
        u is not None and u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens,
        f"usage: prompt + completion = total, got {u}",
    )
    if full.choices[0].finish_reason == "length":
        check(u.completion_tokens == n, f"usage: completion tokens = max_tokens {n} at length, got {u}")

    s_text, s_finish, s_usage, chunks = streamed_chat(client, model, n)
    check(s_text == text, f"chat stream: streamed text equals the non-streamed one: {s_text!r} vs {text!r}")
    check(s_finish == full.choices[0].finish_reason, f"chat stream: finish {s_finish} vs {full.choices[0].finish_reason}")
    check(chunks > 2, f"chat stream: the answer came in pieces ({chunks} chunks)")
    check(
        s_usage is not None
        and (s_usage.prompt_tokens, s_usage.completion_tokens) == (u.prompt_tokens, u.completion_tokens),
        f"chat stream: usage with include_usage equals the non-streamed usage: {s_usage} vs {u}",
    )

    # Stop strings: cut where a piece of the answer first occurs.
    body = text.strip()
    if len(body) >= 6:
        stop = body[len(body) // 2 : len(body) // 2 + 3]
        cut = chat(client, model, n, stop=[stop])
        want = text[: text.index(stop)]
        got = cut.choices[0].message.content
        check(got == want, f"stop: answer ends before {stop!r}: {got!r} vs {want!r}")
        check(cut.choices[0].finish_reason == "stop", f"stop: finish_reason stop, got {cut.choices[0].finish_reason}")
        s_got, s_finish, _, _ = streamed_chat(client, model, n, stop=[stop])
        check(s_got == want and s_finish == "stop", f"stop stream: {s_got!r} ({s_finish}) vs {want!r}")
    else:
        check(False, f"stop: answer {text!r} too short to pick a stop string from")

    comp = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0)
    c_text = comp.choices[0].text
    check(bool(c_text), f"completions: a non-empty text, got {c_text!r}")
    check(comp.usage.completion_tokens <= n, f"completions: usage {comp.usage}")
    streamed = ""
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0, stream=True):
        for c in chunk.choices:
            streamed += c.text or ""
    check(streamed == c_text, f"completions stream: {streamed!r} vs {c_text!r}")

    # A stream closed by the client after two chunks; the server goes on.
    stream = chat(client, model, 200, stream=True)
    for i, _ in enumerate(stream):
        if i == 1:
            break
    stream.close()
    again = chat(client, model, n)
    check(again.choices[0].message.content == text, "cancel: after a closed stream, the same answer again")

    try:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
        check(False, "unknown model: accepted")
    except openai.NotFoundError as e:
        check("no-such-model" in str(e), f"unknown model: 404 naming it ({e})")
    except openai.BadRequestError as e:
        check("no-such-model" in str(e), f"unknown model: 400 naming it ({e})")
    print("all checks passed", flush=True)


if __name__ == "__main__":
    main()
