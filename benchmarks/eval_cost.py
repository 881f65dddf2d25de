"""What evaluating on held-out questions costs the training loop: the chat demo (real vLLM on
the tiny model, GRPO in torch) for a fixed number of steps, without evaluation and with a
greedy evaluation of the 64 held-out questions before the first step and every N steps.

Both settings run on one vLLM engine (its weights reset between runs), alternating, so they
share the machine's state. Every group is trained on (`--filter none`): with the demo's filter
a step's time depends on how much of the task the policy has learnt (groups it gets all right
are dropped and more must be sampled), and two runs never learn alike (vLLM's sampling is not
reproducible across runs), which drowned the evaluations' cost. Per setting, averaged over its
runs:

- loop s: wall time of the training loop (its steps and its evaluations, in sequence);
- steps/s, trained tokens/s: steps and response tokens trained per second of that loop;
- eval s: wall time of one evaluation (median); the producer keeps generating meanwhile.

    python benchmarks/eval_cost.py              # 2 x 2 runs of 40 steps, ~2 min on 2 cores
    python benchmarks/eval_cost.py --quick      # CI smoke run: 1 x 2 runs of 2 steps
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _common import DEFAULT_OUT, info_line, new_figure, print_section, run_info, save_outputs

from asyncroll.app.demo import demo_config, run_demo


async def measure(
    steps: int, every: int, repeats: int, seed: int
) -> dict[int, list[dict[str, Any]]]:
    from safetensors.torch import load_file

    from asyncroll.app.models import TinyModelConfig, build_tiny_model
    from asyncroll.engines import VLLMEngine

    model_dir = build_tiny_model(TinyModelConfig(seed=seed))
    original = load_file(model_dir / "model.safetensors")
    runs: dict[int, list[dict[str, Any]]] = {0: [], every: []}
    async with VLLMEngine(model_dir, seed=seed) as engine:
        for _ in range(repeats):
            for setting in (0, every):
                with tempfile.TemporaryDirectory() as tmp:
                    config = demo_config(
                        task="chat", steps=steps, eval_every=setting, seed=seed, out=tmp,
                        solved_accuracy=0.0, filter="none",
                    )  # fmt: skip
                    print(f"eval_every={setting}: {steps} steps", file=sys.stderr, flush=True)
                    records = await run_demo(
                        config, progress=False, console=io.StringIO(), engine=engine
                    )
                    path = Path(tmp) / "eval.jsonl"
                    evals = (
                        [json.loads(x) for x in path.read_text().splitlines()] if setting else []
                    )
                await engine.update_weights(list(original.items()), version=0)
                eval_s = [e["eval_s"] for e in evals]
                loop_s = sum(r.wall_s for r in records) + sum(eval_s)
                runs[setting].append({
                    "loop_s": loop_s,
                    "steps_per_s": len(records) / loop_s,
                    "tokens_per_s": sum(r.tokens for r in records) / loop_s,
                    "evaluations": len(evals),
                    "eval_s": float(np.median(eval_s)) if eval_s else 0.0,
                    "last_accuracy": evals[-1]["accuracy"] if evals else float("nan"),
                })  # fmt: skip
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 steps, eval every step, once")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    steps, every, repeats = args.steps, args.eval_every, args.repeats
    if args.quick:
        steps, every, repeats = 2, 1, 1
    runs = asyncio.run(measure(steps, every, repeats, args.seed))
    info = run_info()
    keys = ("loop_s", "steps_per_s", "tokens_per_s", "eval_s")
    mean = {s: {k: float(np.mean([r[k] for r in rs])) for k in keys} for s, rs in runs.items()}
    base = mean[0]
    rows = [
        [
            "none" if s == 0 else f"every {s} steps (+ before the first)",
            m["loop_s"], m["steps_per_s"], m["tokens_per_s"],
            m["tokens_per_s"] / base["tokens_per_s"], m["eval_s"] if s else float("nan"),
            len(runs[s]),
        ]
        for s, m in mean.items()
    ]  # fmt: skip
    text = f"# Evaluation's cost to training throughput\n\n{info_line(info)}\n"
    text += f"\nChat demo, {steps} steps, seed {args.seed}; 64 held-out questions, greedy.\n"
    text += print_section(
        "Training loop with and without evaluation",
        ["evaluation", "loop s", "steps/s", "trained tokens/s", "vs none", "eval s", "runs"],
        rows,
    )
    fig, (ax,) = new_figure(1, 1)
    labels = [str(r[0]) for r in rows]
    ax.bar(labels, [r[3] for r in rows])
    ax.set(title="trained tokens per second of the training loop", ylabel="tokens/s")
    payload = {"info": info, "steps": steps, "eval_every": every, "runs": runs, "mean": mean}
    save_outputs(args.out, "eval_cost", fig, payload, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
