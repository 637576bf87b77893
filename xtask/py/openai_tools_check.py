"""An OpenAI-compatible server's agent features seen through the real
`openai` Python client, on a model with a tool-calling chat template.

    python openai_tools_check.py --base-url http://127.0.0.1:PORT/v1 --model NAME [--survey]

Checks, in order:
  tools-required    a request with two functions and tool_choice "required"
                    comes back as tool calls (finish_reason "tool_calls",
                    arguments a JSON object with the required keys)
  tools-streamed    the same request streamed: the calls arrive as
                    delta.tool_calls chunks and equal the whole answer's
  tool-named        tool_choice naming one function calls that function
  round-trip        the calls and the tools' answers sent back (assistant
                    tool_calls, role "tool" with tool_call_id) get a reply
                    (a written call when the server made none)
  round-trip-stream the same, streamed
  json-schema       response_format json_schema: the answer parses and
                    matches the schema (streamed and not)
  logprobs          logprobs with top_logprobs 3: one entry per token
  template-kwargs   chat_template_kwargs {"enable_thinking": false} reaches
                    the template (the prompt gets longer)

Without --survey the first failure exits 1 with what differed; with
--survey every check runs and one line per check says `ok`, `ignored`
(accepted but without effect) or `refused` (an error answer), for the
comparison table in docs/agent-server.md.
"""

from __future__ import annotations

import argparse
import json
import sys

import openai

from tool_schema import function_tool

TOOLS = [
    function_tool(
        "get_weather",
        {
            "city": {"type": "string", "maxLength": 16},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        ["city", "unit"],
        description="The weather in a city.",
    ),
    function_tool("get_time", {"utc": {"type": "boolean"}}, ["utc"]),
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
    "additionalProperties": False,
}


class Ignored(Exception):
    """Accepted, but the feature had no effect."""


def valid_calls(calls) -> list[tuple[str, dict]]:
    if not calls:
        raise Ignored("no tool calls")
    out = []
    for c in calls:
        args = json.loads(c.function.arguments)
        if c.function.name == "get_weather":
            assert isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit"), args
        elif c.function.name == "get_time":
            assert isinstance(args["utc"], bool), args
        else:
            raise AssertionError(f"called {c.function.name}")
        assert c.id, "a call without an id"
        out.append((c.function.name, args))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--survey", action="store_true")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="none", max_retries=0, timeout=300)
    model = args.model
    state: dict = {}

    def chat(**kw):
        return client.chat.completions.create(model=model, temperature=0, max_tokens=kw.pop("max_tokens", 200), **kw)

    def tools_required():
        r = chat(messages=MESSAGES, tools=TOOLS, tool_choice="required")
        c = r.choices[0]
        state["calls"] = c.message.tool_calls
        state["parsed"] = valid_calls(c.message.tool_calls)
        assert c.finish_reason == "tool_calls", c.finish_reason

    def tools_streamed():
        calls: dict[int, dict] = {}
        finish = None
        for chunk in chat(messages=MESSAGES, tools=TOOLS, tool_choice="required", stream=True):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for d in ch.delta.tool_calls or []:
                    c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    c["name"] += d.function.name or ""
                    c["arguments"] += d.function.arguments or ""
        got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
        if not got:
            raise Ignored("no tool calls streamed")
        assert got == state.get("parsed"), (got, state.get("parsed"))
        assert finish == "tool_calls", finish

    def tool_named():
        r = chat(
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False,
        )
        calls = valid_calls(r.choices[0].message.tool_calls)
        if [n for n, _ in calls] != ["get_time"]:
            raise Ignored(f"called {calls}")

    def round_trip_messages():
        # The model's own calls; a server that made none gets one written here.
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in state.get("calls") or []
        ] or [{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]
        msgs = list(MESSAGES)
        msgs.append({"role": "assistant", "content": None, "tool_calls": calls})
        for c in calls:
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"ok": True, "temperature": 21})})
        return msgs

    def round_trip():
        r = chat(messages=round_trip_messages(), tools=TOOLS, max_tokens=8)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls"), r.choices[0].finish_reason
        assert r.usage.prompt_tokens > 0

    def round_trip_stream():
        n = 0
        for chunk in chat(messages=round_trip_messages(), tools=TOOLS, max_tokens=8, stream=True):
            n += len(chunk.choices)
        assert n > 0

    def json_schema():
        fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
        r = chat(messages=MESSAGES, response_format=fmt, max_tokens=300)
        text = r.choices[0].message.content or ""
        streamed = "".join(
            ch.delta.content or ""
            for chunk in chat(messages=MESSAGES, response_format=fmt, max_tokens=300, stream=True)
            for ch in chunk.choices
        )
        try:
            v = json.loads(text)
        except json.JSONDecodeError:
            raise Ignored(f"not JSON: {text[:60]!r}")
        assert set(v) == {"city", "rain"} and isinstance(v["rain"], bool), v
        assert streamed == text, (streamed, text)

    def logprobs():
        r = chat(messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=3)
        lp = r.choices[0].logprobs
        if lp is None or not lp.content:
            raise Ignored("no logprobs")
        assert len(lp.content) == r.usage.completion_tokens, (len(lp.content), r.usage.completion_tokens)
        for e in lp.content:
            assert e.logprob <= 0 and len(e.top_logprobs) == 3, e

    def template_kwargs():
        plain = chat(messages=MESSAGES, max_tokens=1).usage.prompt_tokens
        off = chat(messages=MESSAGES, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        if off.usage.prompt_tokens == plain:
            raise Ignored("the prompt did not change")
        assert off.usage.prompt_tokens > plain

    checks = [
        ("tools-required", tools_required),
        ("tools-streamed", tools_streamed),
        ("tool-named", tool_named),
        ("round-trip", round_trip),
        ("round-trip-stream", round_trip_stream),
        ("json-schema", json_schema),
        ("logprobs", logprobs),
        ("template-kwargs", template_kwargs),
    ]
    failed = False
    for name, f in checks:
        try:
            f()
            print(f"ok: {name}", flush=True)
        except Ignored as e:
            print(f"ignored: {name}: {e}", flush=True)
            failed = True
        except openai.APIError as e:
            print(f"refused: {name}: {str(e)[:160]}", flush=True)
            failed = True
        except (AssertionError, KeyError, TypeError, json.JSONDecodeError) as e:
            print(f"FAIL: {name}: {e!r}", flush=True)
            failed = True
        if failed and not args.survey:
            sys.exit(1)
    if not failed:
        print("all checks passed")


if __name__ == "__main__":
    main()
