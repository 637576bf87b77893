"""Load test of OpenAI-compatible servers on loopback: `mlex serve` against
mlx-lm's own server (`python -m mlx_lm server`) on the same checkpoint.

    python serve_load.py --model DIR [--mlex BIN] [--engines mlex,mlx-lm]
        [--clients 32] [--requests 20] [--max-tokens 32] [--distinct 64]
        [--pairs 1] [--batch 32] [--deadline S] [--out FILE.json] [--check]

Per engine and pair (engines alternate within a pair): start the server on
loopback (mlex on a port it picks itself and names in its log; mlx-lm on a
free port found here), then

* one at a time: each of the `distinct` prompts once, streamed, in turn;
* under load: `clients` concurrent clients (the real `openai` client,
  AsyncOpenAI), each sending `requests` streamed chat requests back to back;
  request k of client c uses prompt (c * requests + k) % distinct.

Every request is greedy (temperature 0) with `max_tokens`. Recorded: errors,
answers that differ from the same server's one-at-a-time answer to the same
prompt, requests/s, completion tokens/s, time to first token (p50/p99) and
latency. The server is stopped with SIGTERM after each engine's turn. With
--check the exit status is 1 when any request failed or any answer under
load differs from one at a time. Every loop is bounded in count and every
request by --timeout; no engine turn starts after --deadline seconds. On
SIGTERM or Ctrl-C the server in use is stopped before exiting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

TOPICS = [
    "rivers", "volcanoes", "the moon", "bread", "trains", "bees", "glass", "chess",
    "whales", "clocks", "paper", "tea", "bridges", "deserts", "violins", "salt",
]


def messages(i: int) -> list[dict]:
    # Two system prompts shared across requests, as real traffic has.
    system = ["You are a helpful assistant.", "You answer briefly and precisely."][i % 2]
    topic = TOPICS[i % len(TOPICS)]
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Request {i}: tell me three facts about {topic}."},
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server did not answer {url} within {timeout:.0f} s")


def mlex_address(log_path: Path, proc: subprocess.Popen, timeout: float) -> str:
    """The http://host:port that `mlex serve --port 0` names in its log."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"mlex serve exited with {proc.returncode}; see {log_path}")
        for line in log_path.read_text(errors="replace").splitlines():
            if "http://" in line:
                return line[line.index("http://"):].split()[0].removesuffix("/v1")
        time.sleep(0.1)
    raise RuntimeError(f"mlex serve named no address within {timeout:.0f} s; see {log_path}")


def start(engine: str, args, port: int, log) -> subprocess.Popen:
    if engine == "mlex":
        cmd = [args.mlex, "serve", "--model", args.model, "--port", "0", "--batch", str(args.batch),
               "--served-model-name", "model"]
    else:
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", args.model, "--port", str(port),
               "--decode-concurrency", str(args.batch), "--prompt-concurrency", str(args.batch)]
    print(f"  $ {' '.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd="/tmp")


def model_id(engine: str, args) -> str:
    return "model" if engine == "mlex" else args.model


async def one(client, model: str, i: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, text, tokens, chunks = None, "", None, 0
    stream = await client.chat.completions.create(
        model=model, messages=messages(i), max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for c in chunk.choices:
            piece = c.delta.content or ""
            if piece:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            text += piece
    done = time.perf_counter() - t0
    return {"i": i, "text": text, "ttft": ttft if ttft is not None else done, "latency": done,
            "tokens": tokens if tokens is not None else chunks}


async def sequential(base: str, model: str, args) -> tuple[dict[int, str], dict]:
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=args.timeout)
    out, rows = {}, []
    t0 = time.perf_counter()
    for i in range(args.distinct):
        r = await one(client, model, i, args.max_tokens)
        out[i] = r["text"]
        rows.append(r)
    wall = time.perf_counter() - t0
    await client.close()
    return out, summary(rows, wall, 0)


async def load(base: str, model: str, args, want: dict[int, str]) -> dict:
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=args.timeout)
    rows, errors, differ = [], [], []

    async def client_loop(c: int):
        for k in range(args.requests):
            i = (c * args.requests + k) % args.distinct
            try:
                r = await one(client, model, i, args.max_tokens)
            except Exception as e:  # noqa: BLE001 -- every failure is counted and shown
                errors.append(f"client {c} request {k}: {type(e).__name__}: {e}")
                continue
            rows.append(r)
            if r["text"] != want[i]:
                differ.append(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(c) for c in range(args.clients)))
    wall = time.perf_counter() - t0
    await client.close()
    s = summary(rows, wall, len(errors))
    s["differ_from_one_at_a_time"] = len(differ)
    s["error_examples"] = errors[:5]
    return s


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def summary(rows: list[dict], wall: float, errors: int) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    return {
        "requests": len(rows),
        "errors": errors,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(rows) / wall, 3),
        "completion_tok_per_s": round(tokens / wall, 1),
        "completion_tokens": tokens,
        "ttft_p50_s": round(pct([r["ttft"] for r in rows], 50), 4),
        "ttft_p99_s": round(pct([r["ttft"] for r in rows], 99), 4),
        "latency_p50_s": round(pct([r["latency"] for r in rows], 50), 4),
        "latency_p99_s": round(pct([r["latency"] for r in rows], 99), 4),
    }


def run_engine(engine: str, args, tag: str) -> dict:
    port = free_port()
    log_path = Path(args.logs) / f"{engine}-{tag}.log"
    with open(log_path, "w") as log:
        proc = start(engine, args, port, log)
        try:
            if engine == "mlex":
                root = mlex_address(log_path, proc, 300)
                health = f"{root}/health"
            else:
                root = f"http://127.0.0.1:{port}"
                health = f"{root}/v1/models"
            wait_ready(health, proc, 300)
            base = f"{root}/v1"
            model = model_id(engine, args)
            want, seq = asyncio.run(sequential(base, model, args))
            under = asyncio.run(load(base, model, args, want))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    under["gain_over_one_at_a_time"] = round(under["requests_per_s"] / seq["requests_per_s"], 2)
    return {"engine": engine, "one_at_a_time": seq, "load": under, "answers": want, "exit": proc.returncode}


def stop_on_signal(signum, _frame) -> None:
    # Raising unwinds through run_engine's `finally`, which stops the server.
    raise SystemExit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, stop_on_signal)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--mlex", default="mlex")
    ap.add_argument("--engines", default="mlex,mlx-lm")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--distinct", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--deadline", type=float, default=1800, help="stop starting engine turns after this many seconds")
    ap.add_argument("--logs", default="/tmp")
    ap.add_argument("--out")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    args.model = str(Path(args.model).resolve())
    if os.sep in args.mlex:
        args.mlex = str(Path(args.mlex).resolve())
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    started = time.monotonic()
    runs, skipped = [], []
    for p in range(args.pairs):
        for engine in engines:
            if time.monotonic() - started > args.deadline:
                skipped.append(f"{engine} pair {p + 1}")
                continue
            print(f"[pair {p + 1}/{args.pairs}] {engine}: {args.clients} clients x {args.requests} requests, "
                  f"{args.max_tokens} tokens each", flush=True)
            r = run_engine(engine, args, f"pair{p + 1}")
            r["pair"] = p + 1
            runs.append(r)
            s, l = r["one_at_a_time"], r["load"]
            print(f"  one at a time: {s['requests_per_s']:.2f} req/s, TTFT p50 {s['ttft_p50_s']:.3f} s", flush=True)
            print(f"  under load: {l['requests']} ok, {l['errors']} errors, {l['differ_from_one_at_a_time']} differ; "
                  f"{l['requests_per_s']:.2f} req/s, {l['completion_tok_per_s']:.0f} tok/s, TTFT p50 "
                  f"{l['ttft_p50_s']:.3f} s p99 {l['ttft_p99_s']:.3f} s, latency p50 {l['latency_p50_s']:.3f} s; "
                  f"{l['gain_over_one_at_a_time']:.2f}x one at a time; server exit {r['exit']}", flush=True)
            for e in l["error_examples"]:
                print(f"    {e}", flush=True)

    report = {"model": args.model, "clients": args.clients, "requests": args.requests,
              "max_tokens": args.max_tokens, "distinct": args.distinct, "batch": args.batch,
              "runs": runs, "skipped": skipped}
    by = {e: [r for r in runs if r["engine"] == e] for e in engines}
    if "mlex" in by and "mlx-lm" in by and by["mlex"] and by["mlx-lm"]:
        ratios = [a["load"]["requests_per_s"] / b["load"]["requests_per_s"]
                  for a, b in zip(by["mlex"], by["mlx-lm"])]
        report["mlex_over_mlxlm_requests_per_s"] = {
            "median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
            "max": round(max(ratios), 3), "pairs": len(ratios)}
        # mlx-lm drops the space that begins an answer's first token; mlex
        # keeps the tokens' text as it is. Compared without it.
        same = sum(by["mlex"][0]["answers"][i].lstrip() == by["mlx-lm"][0]["answers"][i].lstrip()
                   for i in range(args.distinct))
        report["same_answers_as_mlxlm"] = f"{same}/{args.distinct}"
        print(f"mlex / mlx-lm requests/s: median {report['mlex_over_mlxlm_requests_per_s']['median']:.2f}x "
              f"(range {min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} pairs); same answers {same}/{args.distinct}",
              flush=True)
    for s in skipped:
        print(f"not run (deadline): {s}", flush=True)
    if args.out:
        for r in runs:
            r["answers"] = {str(k): v for k, v in r["answers"].items()}
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.check:
        # mlx-lm's server dies of SIGTERM by design; mlex's must exit 0.
        bad = [r for r in runs if r["load"]["errors"] or r["load"]["differ_from_one_at_a_time"]
               or (r["engine"] == "mlex" and r["exit"] != 0)]
        if bad:
            print(f"FAIL: {len(bad)} engine turns had errors, differing answers or an unclean exit", flush=True)
            sys.exit(1)


if __name__ == "__main__":
    main()
