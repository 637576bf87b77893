#!/usr/bin/env python3
"""mlex against mlx-lm on the same checkpoints and the same MLX build.

For each case (shape x weights {bf16, 4-bit} x prompt length) it runs the
two engines alternately, ``--pairs`` times (mlex first, then mlx-lm, then
mlex again, ...), each run in its own process with a timeout:

* ours:   ``mlex bench --model DIR --prompt-len P --gen G --repeats R
  --format json --device D [--quantize 4]``
* theirs: ``mlxlm_bench.py DIR --prompt-len P --gen G --repeats R --device D
  [--quantize 4]`` (mlx-lm's own ``generate_step``, measured like
  ``mlex bench``: random prompt ids, greedy, a warm-up run, the best of R).

4-bit means quantized on load by each engine (affine, group 64) from the
bf16 checkpoint; the real-size shapes (``real_shapes.py``: MoE hybrids of
30-80B and a 9B hybrid, a fraction of their layers) are written 4-bit and
run as they are (their only weights: 4). mlx-lm's quantized MoE layers run
on MLX 0.32.2 through ``mlxlm_compat.py``. A run that fails or times out is recorded as such (its
pair then has no ratio); the harness goes on.

Per case it reports the median over pairs of the ratio mlex / mlx-lm of
prefill and of decode tok/s with the min-max of the per-pair ratios, the
median tok/s of each engine and the largest peak memory of each, as a
Markdown table (printed, and written to OUT.md) and as JSON (OUT.json,
rewritten after every case, so a cut-short sweep keeps what it measured).

    python bench_vs_mlxlm.py --mlex ./mlex --models MODELS [--device cpu|gpu]
        [--scale tiny|small|host|real] [--pairs 5] [--shapes qwen3-0.6b,qwen3_5,nemotron_h]
        [--quants bf16,4] [--prompt-lens 128,4096] [--gen 256] [--out PREFIX]

The checkpoints are ``MODELS/<shape>-<scale>`` as written by
``make_bench_models.py`` (imported from this script's folder).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_bench_models as models  # noqa: E402

QUANTS = ("bf16", "4")


def default_prompt_lens(shape: str, scale: str) -> list[int]:
    """128 and 4096 for every shape, plus 16384 for the hybrids; at the tiny
    scale (a CPU run of minutes) 128 and 512, plus 2048 for the hybrids."""
    base, long = ([128, 4096], 16384) if scale in ("real", "full") else ([128, 512], 2048)
    return base + ([long] if shape in models.HYBRIDS else [])


def shape_quants(model: Path, quants: list[str]) -> list[str]:
    """The weights a case list runs for a checkpoint: ``quants``, or for one
    written quantized only its own bits."""
    bits = models.checkpoint_bits(model)
    return quants if bits is None else [str(bits)]


def quantize_on_load(model: Path, quant: str) -> bool:
    """Whether the engines quantize ``model`` as they load it: weights of
    ``quant`` bits from a bf16 checkpoint (one written quantized runs as is)."""
    return quant != "bf16" and models.checkpoint_bits(model) is None


def last_json(text: str):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_engine(cmd: list[str], timeout: float, env=None) -> dict:
    """Runs one engine process; never raises for the engine's failure."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )
    except OSError as e:
        return {"ok": False, "status": "error", "error": f"cannot start: {e}", "wall_s": 0.0}
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # The whole process group: MLX's CPU backend may have a compiler running.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return {
            "ok": False,
            "status": "timeout",
            "error": f"timed out after {timeout:.0f} s",
            "stderr_tail": (err or "")[-2000:],
            "wall_s": time.perf_counter() - t0,
        }
    wall = time.perf_counter() - t0
    result = last_json(out) if proc.returncode == 0 else None
    if result is None or "decode_tok_s" not in result:
        return {
            "ok": False,
            "status": "failed",
            "error": f"exit status {proc.returncode}" + ("" if proc.returncode else ", no JSON result"),
            "stderr_tail": (err or "")[-2000:],
            "wall_s": wall,
        }
    return {
        "ok": True,
        "status": "ok",
        "prefill_tok_s": float(result["prefill_tok_s"]),
        "decode_tok_s": float(result["decode_tok_s"]),
        "peak_memory_bytes": int(result.get("peak_memory_bytes") or 0),
        "generated_tokens": result.get("generated_tokens"),
        "agg_tok_s": float(result.get("agg_tok_s") or 0.0),
        "raw": result,
        "wall_s": wall,
    }


def ours_cmd(a, model: Path, prompt_len: int, quant: str, batch: int | None = None) -> list[str]:
    cmd = [
        str(a.mlex), "bench", "--model", str(model),
        "--prompt-len", str(prompt_len), "--gen", str(a.gen), "--repeats", str(a.repeats),
        "--format", "json", "--device", a.device,
    ]
    if batch is not None:
        cmd += ["--batch", str(batch)]
    if quantize_on_load(model, quant):
        cmd += ["--quantize", quant, "--group-size", "64"]
    return cmd + a.mlex_arg


def theirs_cmd(a, model: Path, prompt_len: int, quant: str, batch: int | None = None) -> list[str]:
    script = a.mlxlm_bench if batch is None else a.mlxlm_batch_bench
    cmd = [
        a.python, str(script), str(model),
        "--prompt-len", str(prompt_len), "--gen", str(a.gen), "--repeats", str(a.repeats),
        "--device", a.device,
    ]
    if batch is not None:
        cmd += ["--batch", str(batch)]
    if quantize_on_load(model, quant):
        cmd += ["--quantize", quant]
    return cmd


def spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(runs: list[dict]) -> dict:
    by = {"mlex": {}, "mlx-lm": {}}
    for r in runs:
        by[r["engine"]][r["pair"]] = r
    ratios = {"prefill": [], "decode": [], "agg": []}
    for pair, o in by["mlex"].items():
        t = by["mlx-lm"].get(pair)
        if o["ok"] and t and t["ok"]:
            for k in ratios:
                if t[f"{k}_tok_s"] > 0:
                    ratios[k].append(o[f"{k}_tok_s"] / t[f"{k}_tok_s"])
    s = {
        "ratio_prefill": spread(ratios["prefill"]),
        "ratio_decode": spread(ratios["decode"]),
        "ratio_agg": spread(ratios["agg"]),
    }
    for eng, rs in by.items():
        ok = [r for r in rs.values() if r["ok"]]
        s[eng] = {
            "runs_ok": len(ok),
            "runs": len(rs),
            "prefill_tok_s": spread([r["prefill_tok_s"] for r in ok]),
            "decode_tok_s": spread([r["decode_tok_s"] for r in ok]),
            "agg_tok_s": spread([r["agg_tok_s"] for r in ok if r["agg_tok_s"] > 0]),
            "peak_memory_bytes": max((r["peak_memory_bytes"] for r in ok), default=None),
            "failures": sorted({r["status"] for r in rs.values() if not r["ok"]}),
        }
    return s


def fmt_ratio(s) -> str:
    if not s:
        return "–"
    return f"**{s['median']:.2f}×** ({s['min']:.2f}–{s['max']:.2f})"


def fmt_rate(s) -> str:
    if not s:
        return "–"
    m = s["median"]
    return f"{m:,.0f}" if m >= 100 else f"{m:.1f}"


def fmt_mem(b) -> str:
    if b is None:
        return "–"
    return f"{b / 1e6:,.0f}" if b >= 1e8 else f"{b / 1e6:.1f}"


def versions(m: dict) -> str:
    """The report's last words on the setup: both engines on their MLX, the
    host, the date."""
    env = m.get("mlex_env") or {}
    return (
        f"{m['mlex_version']} on mlx {env.get('mlx_version', '?')} ({env.get('backend', '?')}"
        f"{', ' + env['gpu_name'] if env.get('gpu_name') else ''}); "
        f"mlx-lm {m['mlx_lm_version']} on mlx {m['mlx_version']}; {m['host']}, {m['date']}."
    )


def ratios(s: dict, *whats: str) -> list[str]:
    """The mlex / mlx-lm ratios of ``whats`` (prefill, decode, agg)."""
    return [fmt_ratio(s[f"ratio_{what}"]) for what in whats]


def rates(s: dict, what: str) -> list[str]:
    """The ``what`` tok/s of mlex and of mlx-lm."""
    return [fmt_rate(s[eng][f"{what}_tok_s"]) for eng in ("mlex", "mlx-lm")]


def markdown(result: dict) -> str:
    """The sweep as a table, a row a case (with --batches: a case a batch
    size, aggregate tok/s first; else a case a prompt length), and a note a
    failed engine."""
    m = result["meta"]
    if m.get("batches"):
        intro = (
            f"mlex `bench --batch B` vs mlx-lm `BatchGenerator`, {m['scale']} shapes, device {m['device']}, "
            f"{m['pairs']} pairs (mlex then mlx-lm, each a fresh process), B prompts of {m['prompt_len']} random ids, "
            f"{m['gen']} greedy tokens each, wall time from submission to the last token; "
        )
        faster, label, key, ok_ratio = "", "batch", "batch", "ratio_agg"
        columns = ["aggregate mlex / mlx-lm", "mlex tok/s", "mlx-lm tok/s"]
        columns += ["prefill mlex / mlx-lm", "decode mlex / mlx-lm"]

        def cells(s):
            return [*ratios(s, "agg"), *rates(s, "agg"), *ratios(s, "prefill", "decode")]

    else:
        intro = (
            f"mlex vs mlx-lm, {m['scale']} shapes, device {m['device']}, {m['pairs']} pairs "
            f"(mlex then mlx-lm, each a fresh process), gen {m['gen']}, best of {m['repeats']} per run; "
        )
        faster, label, key, ok_ratio = " (above 1: mlex faster)", "prompt", "prompt_len", "ratio_decode"
        columns = ["prefill mlex / mlx-lm", "decode mlex / mlx-lm"]
        columns += [f"{eng} {what} tok/s" for what in ("prefill", "decode") for eng in ("mlex", "mlx-lm")]

        def cells(s):
            return [*ratios(s, "prefill", "decode"), *rates(s, "prefill"), *rates(s, "decode")]

    columns = ["shape", "weights", label, "ok pairs", *columns, "mlex peak MB", "mlx-lm peak MB"]
    lines = [
        intro + versions(m),
        "",
        f"Ratios are mlex / mlx-lm{faster}: median over pairs (min–max); "
        "tok/s: median over runs; peak memory: the largest over runs, MB.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    notes = []
    for c in result["cases"]:
        s = c["summary"]
        ok_pairs = s[ok_ratio]["n"] if s[ok_ratio] else 0
        weights = "bf16" if c["quant"] == "bf16" else f"{c['quant']}-bit"
        row = [c["shape"], weights, c[key], f"{ok_pairs}/{c['pairs']}", *cells(s)]
        row += [fmt_mem(s[eng]["peak_memory_bytes"]) for eng in ("mlex", "mlx-lm")]
        lines.append("| " + " | ".join(map(str, row)) + " |")
        for eng in ("mlex", "mlx-lm"):
            if s[eng]["failures"]:
                e = s[eng]
                notes.append(
                    f"- {c['shape']} {weights} {label} {c[key]}: {eng} "
                    f"{e['runs'] - e['runs_ok']} of {e['runs']} runs {'/'.join(e['failures'])}: "
                    + failure_reason(c["runs"], eng)
                )
    if result.get("skipped"):
        notes.append(f"- not run (deadline): {', '.join(result['skipped'])}")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def failure_reason(runs: list[dict], engine: str) -> str:
    """Why ``engine``'s first failed run failed: its error and the last line
    of its stderr (a Python exception, mlex's error), for the table's notes."""
    for r in runs:
        if r["engine"] == engine and not r["ok"]:
            tail = (r.get("stderr_tail") or "").strip().splitlines()
            return r["error"] + (f" ({tail[-1][:300]})" if tail else "")
    return ""


def version_of(cmd: list[str]) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        return (p.stdout or p.stderr).strip().splitlines()[-1] if p.returncode == 0 else "?"
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "?"


def mlex_env(mlex: Path, device: str):
    """``mlex env --format json``: MLX version, backend, GPU, the libmlx loaded."""
    try:
        p = subprocess.run([str(mlex), "env", "--format", "json", "--device", device],
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    return last_json(p.stdout) or {"error": f"exit status {p.returncode}: {p.stderr.strip()[-500:]}"}


def out_paths(out: str) -> tuple[Path, Path]:
    p = Path(out)
    if p.is_dir():
        p = p / "bench-vs-mlxlm"
    elif p.suffix in (".json", ".md"):
        p = p.with_suffix("")
    return p.with_name(p.name + ".json"), p.with_name(p.name + ".md")


def parse_list(text: str, what: str, known=None) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if known is not None:
        for x in items:
            if x not in known:
                raise SystemExit(f"bench_vs_mlxlm: unknown {what} {x!r} (known: {', '.join(known)})")
    return items


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mlex", type=Path, required=True, help="the mlex binary")
    p.add_argument("--models", type=Path, required=True, help="folder of <shape>-<scale>/ checkpoints")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="for both engines (default cpu)")
    p.add_argument("--scale", choices=sorted(models.DIMS) + ["full"], default="tiny",
                   help="checkpoint sizes (default tiny; full: the real-size shapes at their real depth)")
    p.add_argument("--pairs", type=int, default=5, help="mlex/mlx-lm run pairs per case (default 5)")
    p.add_argument(
        "--shapes", default=",".join(models.SHAPES), help=f"comma-separated (default: all: {', '.join(models.SHAPES)})"
    )
    p.add_argument("--quants", default=",".join(QUANTS), help="comma-separated: bf16, 4 (4-bit on load)")
    p.add_argument(
        "--prompt-lens",
        help="comma-separated prompt lengths for every shape (default: 128,4096 +16384 for hybrids "
        "at --scale real; 128,512 +2048 at --scale tiny)",
    )
    p.add_argument("--gen", type=int, default=256, help="generated tokens (default 256)")
    p.add_argument("--repeats", type=int, default=1, help="timed repetitions inside each run, best kept (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per engine run (default 600)")
    p.add_argument("--deadline", type=float, help="start no run after this many seconds; the rest is reported as not run")
    p.add_argument("--python", default=sys.executable, help="python with mlx-lm for the reference (default: this one)")
    p.add_argument("--mlxlm-bench", type=Path, default=HERE / "mlxlm_bench.py", help="the reference's bench script")
    p.add_argument("--mlxlm-batch-bench", type=Path, default=HERE / "mlxlm_batch_bench.py",
                   help="the reference's batched bench script (with --batches)")
    p.add_argument("--batches", help="comma-separated batch sizes: compare `mlex bench --batch B` with mlx-lm's "
                   "BatchGenerator instead of single sequences (prompt length: the first of --prompt-lens, or 128)")
    p.add_argument(
        "--mlex-arg",
        action="append",
        default=[],
        help="extra argument for `mlex bench` (repeatable; --mlex-arg=--no-compile)",
    )
    p.add_argument("--out", default="bench-vs-mlxlm", help="PREFIX for PREFIX.json and PREFIX.md (or a folder)")
    a = p.parse_args(argv)

    shapes = parse_list(a.shapes, "shape", models.SHAPES + models.REAL_SIZE)
    quants = parse_list(a.quants, "weights", QUANTS)
    fixed_lens = [int(x) for x in parse_list(a.prompt_lens, "prompt length")] if a.prompt_lens else None
    a.mlex = a.mlex.resolve()
    if not a.mlex.is_file():
        raise SystemExit(f"bench_vs_mlxlm: no mlex binary at {a.mlex}")
    missing = [s for s in shapes if not (a.models / f"{s}-{a.scale}" / "config.json").is_file()]
    if missing:
        raise SystemExit(
            f"bench_vs_mlxlm: no checkpoint for {', '.join(missing)} in {a.models}; make them with\n"
            f"  {a.python} {HERE / 'make_bench_models.py'} {a.models} --scale {a.scale} --shapes {','.join(missing)}"
        )
    json_path, md_path = out_paths(a.out)
    json_path.parent.mkdir(parents=True, exist_ok=True)

    theirs_version = version_of(
        [a.python, "-c", "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__)"]
    )
    mlx_version, mlx_lm_version = (theirs_version.split() + ["?", "?"])[:2]
    result = {
        "meta": {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
            "device": a.device,
            "scale": a.scale,
            "pairs": a.pairs,
            "gen": a.gen,
            "repeats": a.repeats,
            "timeout_s": a.timeout,
            "mlex": str(a.mlex),
            "mlex_version": version_of([str(a.mlex), "--version"]),
            "mlex_env": mlex_env(a.mlex, a.device),
            "mlx_version": mlx_version,
            "mlx_lm_version": mlx_lm_version,
            "models": str(a.models.resolve()),
            "order": "per pair: mlex, then mlx-lm; each run a separate process",
        },
        "cases": [],
        "skipped": [],
    }
    batches = [int(x) for x in parse_list(a.batches, "batch size")] if a.batches else None
    if batches:
        plen = (fixed_lens or [128])[0]
        result["meta"].update(batches=batches, prompt_len=plen)
        cases = [
            (s, q, plen, b) for s in shapes for q in shape_quants(a.models / f"{s}-{a.scale}", quants) for b in batches
        ]
    else:
        cases = [
            (s, q, n, None)
            for s in shapes
            for q in shape_quants(a.models / f"{s}-{a.scale}", quants)
            for n in (fixed_lens or default_prompt_lens(s, a.scale))
        ]
    start = time.monotonic()
    for i, (shape, quant, prompt_len, batch) in enumerate(cases):
        label = f"{shape} {quant} p{prompt_len}" + (f" b{batch}" if batch else "")
        model = a.models / f"{shape}-{a.scale}"
        runs = []
        for pair in range(a.pairs):
            for engine, cmd in (
                ("mlex", ours_cmd(a, model, prompt_len, quant, batch)),
                ("mlx-lm", theirs_cmd(a, model, prompt_len, quant, batch)),
            ):
                timeout = a.timeout
                if a.deadline is not None:
                    left = a.deadline - (time.monotonic() - start)
                    if left <= 0:
                        break
                    timeout = min(timeout, left)
                r = run_engine(cmd, timeout)
                if r["status"] == "timeout" and timeout < a.timeout:
                    r.update(status="deadline", error=f"stopped at the --deadline of {a.deadline:.0f} s")
                r.update(engine=engine, pair=pair, cmd=cmd)
                runs.append(r)
                if r["ok"]:
                    msg = (f"prefill {r['prefill_tok_s']:.1f} tok/s, decode {r['decode_tok_s']:.1f} tok/s, "
                           + (f"aggregate {r['agg_tok_s']:.1f} tok/s, " if batch else "")
                           + f"peak {r['peak_memory_bytes'] / 1e6:.1f} MB")
                else:
                    tail = (r.get("stderr_tail") or "").strip().splitlines()[-1:] or [""]
                    msg = f"{r['status'].upper()}: {r['error']} {tail[0][:200]}"
                print(f"[{i + 1}/{len(cases)}] {label} pair {pair + 1}/{a.pairs} {engine:6s} {msg} "
                      f"({r['wall_s']:.1f} s)", file=sys.stderr, flush=True)
        if not runs:
            result["skipped"].append(label)
        else:
            result["cases"].append({
                "shape": shape,
                "quant": quant,
                "prompt_len": prompt_len,
                "batch": batch,
                "gen": a.gen,
                "pairs": a.pairs,
                "model": str(model),
                "runs": runs,
                "summary": summarize(runs),
            })
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    md_path.write_text(table)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    print(table)
    print(f"bench_vs_mlxlm: wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
