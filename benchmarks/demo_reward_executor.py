"""What running the verifier in worker processes (`reward_executor="process"`) costs the chat
demo (`asyncroll demo --task chat`) and `examples/chat_grpo.py` (the tiny model), next to a
worker thread and, for the demo, the event loop (`reward_in_thread=False`, what it ran before).

One vLLM engine (the tiny model on CPU) serves every run, its weights put back at version 0
before each; the arms alternate within a round, in an order that rotates from round to round,
so the machine's load (shared, noisy) falls on each about equally. Per run, over the steps
after the first `--warmup` (the worker processes started, vLLM warm):

- **groups/s**: groups the producer finished (kept, filtered, failed) per second of the steps;
- **tokens/s**: the producer's generated tokens per second (`rollout/tokens_per_s`), median;
- **s/step**: wall per training step (the batch's wait, the train step, the weight update;
  evaluations between steps not included), median.

The demo runs with its chat defaults (batches of 16 groups of 8, 4-token replies, the
`nonzero_std` filter, an evaluation of 64 held-out questions every 10 steps), never stopping
early (`solved_accuracy=0`); the example with `tiny_setup()` as documented. The table gives each
arm's median over the rounds and the spread (min-max), and each arm's ratio to the "thread" arm.

    python benchmarks/demo_reward_executor.py                      # 3 rounds of 30 steps
    python benchmarks/demo_reward_executor.py --rounds 1 --steps 8 # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_OUT, ROOT, info_line, new_figure, print_section, run_info, save_outputs

DEMO_ARMS = ("thread", "process", "inline")
EXAMPLE_ARMS = ("thread", "process")


def example() -> Any:
    spec = importlib.util.spec_from_file_location("chat_grpo", ROOT / "examples" / "chat_grpo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["chat_grpo"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


async def reset(engine: Any, model_dir: Path) -> None:
    from safetensors.torch import load_file

    weights = list(load_file(model_dir / "model.safetensors").items())
    await engine.update_weights(weights, version=0)


async def demo_run(engine: Any, executor: str, steps: int, warmup: int) -> dict[str, Any]:
    from asyncroll.app import demo_chat
    from asyncroll.app.demo import demo_config, run_demo

    demo_chat.REWARD_EXECUTOR = executor  # what `ChatTask` reads
    with tempfile.TemporaryDirectory() as out:
        cfg = demo_config(task="chat", steps=steps, out=out, solved_accuracy=0.0)
        start = time.perf_counter()
        records = await run_demo(cfg, progress=False, console=io.StringIO(), engine=engine)
        wall = time.perf_counter() - start
        evals = [json.loads(line) for line in (Path(out) / "eval.jsonl").read_text().splitlines()]
    steady = records[warmup:]

    def dropped(r: Any) -> int:  # since the run began (a record's counts are totals)
        return int(r.filtered_groups + r.failed_groups + r.expired_groups)

    before = dropped(records[warmup - 1]) if warmup else 0
    groups = cfg.batch_groups * len(steady) + dropped(records[-1]) - before
    return {
        "what": "demo",
        "executor": executor,
        "steps": len(records),
        "groups_per_s": groups / sum(r.wall_s for r in steady),
        "tokens_per_s": statistics.median(r.tokens_per_s for r in steady),
        "step_s": statistics.median(r.wall_s for r in steady),
        "failed": records[-1].failed_groups,
        "eval_s": statistics.median(e["eval_s"] for e in evals),
        "run_s": wall,
    }


async def example_run(
    engine: Any, model_dir: Path, executor: str, steps: int, warmup: int
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chat_grpo = example()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    setup = dataclasses.replace(chat_grpo.tiny_setup(), reward_executor=executor)
    start = time.perf_counter()
    log = await chat_grpo.train(engine, model, tokenizer, setup, steps=steps, eval_every=10)
    wall = time.perf_counter() - start
    steady = [m for m in log[warmup:] if m["rollout/tokens_per_s"] > 0]
    # a step's window (since the previous batch: its train step, update and any evaluation)
    windows = [m["rollout/generated_tokens"] / m["rollout/tokens_per_s"] for m in steady]
    finished = [
        m["rollout/completed_groups"] + m["rollout/filtered_groups"] + m["rollout/failed_groups"]
        for m in steady
    ]
    return {
        "what": "example",
        "executor": executor,
        "steps": len(log),
        "groups_per_s": sum(finished) / sum(windows),
        "tokens_per_s": statistics.median(m["rollout/tokens_per_s"] for m in steady),
        "step_s": statistics.median(windows),
        "failed": int(log[-1]["rollout/total/failed_groups"]),
        "eval_s": statistics.median(m["eval/wall_s"] for m in log if "eval/wall_s" in m),
        "run_s": wall,
    }


def rotated(arms: tuple[str, ...], round_: int) -> list[str]:
    k = round_ % len(arms)
    return [*arms[k:], *arms[:k]]


def summary(runs: list[dict[str, Any]], what: str, arms: tuple[str, ...]) -> list[list[Any]]:
    def values(executor: str, key: str) -> list[float]:
        return [r[key] for r in runs if r["what"] == what and r["executor"] == executor]

    def median(executor: str, key: str) -> float:
        return statistics.median(values(executor, key))

    rows = []
    for executor in arms:
        row: list[Any] = [executor]
        for key in ("tokens_per_s", "step_s", "groups_per_s"):
            v = values(executor, key)
            row += [statistics.median(v), f"{min(v):.3g}-{max(v):.3g}"]
        row += [
            median(executor, "eval_s"),
            median(executor, "tokens_per_s") / median("thread", "tokens_per_s"),
            median(executor, "step_s") / median("thread", "step_s"),
            len(values(executor, "step_s")),
        ]
        rows.append(row)
    return rows


async def main_async(args: argparse.Namespace) -> None:
    from asyncroll.app.demo import demo_config, demo_model
    from asyncroll.engines import VLLMEngine

    info = run_info()
    model_dir = demo_model(demo_config(task="chat"))
    runs: list[dict[str, Any]] = []
    async with VLLMEngine(model_dir, seed=0, max_model_len=1024) as engine:
        for round_ in range(args.rounds):
            for executor in rotated(args.demo_arms, round_):
                await reset(engine, model_dir)
                runs.append(await demo_run(engine, executor, args.steps, args.warmup))
                print(runs[-1], flush=True)
            for executor in rotated(EXAMPLE_ARMS, round_):
                await reset(engine, model_dir)
                runs.append(await example_run(engine, model_dir, executor, args.steps, args.warmup))
                print(runs[-1], flush=True)

    headers = ["executor", "tokens/s", "spread", "s/step", "spread", "groups/s", "spread",
               "s/evaluation", "tokens/s vs thread", "s/step vs thread", "runs"]  # fmt: skip
    report = [f"# Reward executor in the chat demo and the example\n\n{info_line(info)}\n"]
    report.append(print_section(
        f"asyncroll demo --task chat, {args.steps} steps (medians over steps {args.warmup + 1}-)",
        headers, summary(runs, "demo", args.demo_arms),
    ))  # fmt: skip
    report.append(print_section(
        f"examples/chat_grpo.py (tiny), {args.steps} steps "
        f"(medians over steps {args.warmup + 1}-)",
        headers, summary(runs, "example", EXAMPLE_ARMS),
    ))  # fmt: skip
    report.append(print_section(
        "Every run, in order",
        ["what", "executor", "groups/s", "tokens/s", "s/step", "s/evaluation", "failed groups",
         "run s"],
        [[r["what"], r["executor"], r["groups_per_s"], r["tokens_per_s"], r["step_s"],
          r.get("eval_s"), r["failed"], r["run_s"]] for r in runs],
    ))  # fmt: skip
    fig, (ax,) = new_figure(1, 1)
    ax.set(title="Groups/s per run", xlabel="run", ylabel="groups/s")
    for what in ("demo", "example"):
        for executor in DEMO_ARMS:
            points = [(i, r["groups_per_s"]) for i, r in enumerate(runs)
                      if r["what"] == what and r["executor"] == executor]  # fmt: skip
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, "o", label=f"{what} {executor}")
    ax.legend()
    save_outputs(Path(args.out), "demo_reward_executor", fig, {"info": info, "runs": runs},
                 "\n".join(report))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out")
    parser.add_argument(
        "--demo-arms", type=lambda v: tuple(v.split(",")), default=DEMO_ARMS,
        help="the demo's executors, comma-separated (thread,process,inline)",
    )  # fmt: skip
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
