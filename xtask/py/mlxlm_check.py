"""mlx-lm's side of the `mlex convert` and `mlex perplexity` checks.

    python mlxlm_check.py logits --model DIR --ids 1,2,3 --out FILE.npy
    python mlxlm_check.py convert --model IN --out OUT [-q --q-bits B --q-group-size G
                                  | --quant-predicate RECIPE --q-group-size G | -d] [--dtype D]
    python mlxlm_check.py compare A B
    python mlxlm_check.py perplexity --model DIR --data FILE --sequence-length L [--stride S]

logits: one forward of mlx-lm's model read from DIR (``mlx_lm.utils.load_model``),
float32 logits of every position. convert: ``mlx_lm.convert.convert`` itself.
compare: two checkpoint folders hold the same tensors (names, dtypes, shapes,
values) and the same ``quantization`` block; prints what differs and exits 1.
perplexity: mlx-lm's tokenizer and model, documents encoded as
``mlx_lm.perplexity.load_data`` encodes them (an end token appended) but in
file order, windows as it cuts them, scored by its ``eval_ppl``; with
``--stride`` below the length, overlapping windows each scoring only their last
``stride`` tokens (computed here from the same per-token losses). Prints JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxlm_compat import patch as compat_patch


def cmd_logits(a) -> None:
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(a.model))
    ids = mx.array([[int(t) for t in a.ids.split(",")]])
    logits = model(ids)[0].astype(mx.float32)
    np.save(a.out, np.array(logits))


def cmd_convert(a) -> None:
    from mlx_lm.convert import convert

    with contextlib.redirect_stdout(io.StringIO()):
        convert(
            a.model,
            mlx_path=a.out,
            quantize=a.q,
            q_group_size=a.q_group_size,
            q_bits=a.q_bits,
            quant_predicate=a.quant_predicate,
            dequantize=a.d,
            dtype=a.dtype,
        )


def tensors(folder: Path) -> dict[str, mx.array]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def cmd_compare(a) -> None:
    x, y = Path(a.a), Path(a.b)
    tx, ty = tensors(x), tensors(y)
    problems = []
    if set(tx) != set(ty):
        problems.append(f"names: only in {x}: {sorted(set(tx) - set(ty))[:8]}; only in {y}: {sorted(set(ty) - set(tx))[:8]}")
    for k in sorted(set(tx) & set(ty)):
        u, v = tx[k], ty[k]
        if u.dtype != v.dtype or u.shape != v.shape:
            problems.append(f"{k}: {u.dtype}{u.shape} vs {v.dtype}{v.shape}")
        elif not mx.array_equal(u, v).item():
            problems.append(f"{k}: values differ (max |d| {mx.abs(u.astype(mx.float32) - v.astype(mx.float32)).max().item()})")
    cx = json.loads((x / "config.json").read_text())
    cy = json.loads((y / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        if cx.get(key) != cy.get(key):
            problems.append(f"config {key}: {cx.get(key)} vs {cy.get(key)}")
    ix = json.loads((x / "model.safetensors.index.json").read_text())
    iy = json.loads((y / "model.safetensors.index.json").read_text())
    if ix["metadata"] != iy["metadata"]:
        problems.append(f"index metadata: {ix['metadata']} vs {iy['metadata']}")
    if problems:
        print("\n".join(problems[:20]))
        sys.exit(1)
    print(f"same: {len(tx)} tensors")


def documents(path: Path) -> list[str]:
    text = path.read_text()
    if path.suffix != ".jsonl":
        return [text]
    return [json.loads(line)["text"] for line in text.splitlines() if line.strip()]


def cmd_perplexity(a) -> None:
    from mlx_lm.perplexity import eval_ppl
    from mlx_lm.utils import load

    model, tokenizer = load(a.model)
    data = []
    for d in documents(Path(a.data)):
        tokens = tokenizer.encode(d)
        if tokens[-1] != tokenizer.eos_token_id:
            tokens.append(tokenizer.eos_token_id)
        data.extend(tokens)
    L = a.sequence_length
    stride = a.stride or L
    if stride == L:
        n = (len(data) // L) * L
        windows = mx.array(data[:n]).reshape(-1, L)
        with contextlib.redirect_stdout(io.StringIO()):
            ppl, se = eval_ppl(model, windows, batch_size=8)
        print(json.dumps({"perplexity": ppl, "standard_error": se, "windows": windows.shape[0]}))
        return
    losses = []
    start = 0
    count = 0
    while start + L <= len(data):
        w = mx.array(data[start : start + L])[None]
        logits = model(w[:, :-1]).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, w[:, 1:], reduction="none")[0]
        first = 0 if start == 0 else L - 1 - stride
        losses.extend(np.array(ce[first:]).tolist())
        start += stride
        count += 1
    losses = np.array(losses, dtype=np.float64)
    ppl = math.exp(losses.mean())
    se = ppl * losses.std(ddof=1) / math.sqrt(len(losses))
    print(json.dumps({"perplexity": ppl, "standard_error": se, "windows": count}))


def main() -> None:
    compat_patch()
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("logits")
    p.add_argument("--model", required=True)
    p.add_argument("--ids", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("convert")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("-q", action="store_true")
    p.add_argument("--q-bits", type=int)
    p.add_argument("--q-group-size", type=int)
    p.add_argument("--quant-predicate")
    p.add_argument("-d", action="store_true")
    p.add_argument("--dtype")
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    p = sub.add_parser("perplexity")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--sequence-length", type=int, required=True)
    p.add_argument("--stride", type=int)
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    {"logits": cmd_logits, "convert": cmd_convert, "compare": cmd_compare, "perplexity": cmd_perplexity}[a.cmd](a)


if __name__ == "__main__":
    main()
