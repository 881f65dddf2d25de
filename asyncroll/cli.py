"""`asyncroll` command line.

`demo` trains the tiny local model with GRPO on CPU with real vLLM rollouts; `simulate` runs the
producer against SimEngine (a simulation: random tokens, no model) to show its accounting.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence

import psutil
from tqdm import tqdm

from asyncroll.demo import DemoConfig, run_demo
from asyncroll.engines.base import SamplingConfig
from asyncroll.engines.sim import SimConfig, SimEngine
from asyncroll.producer import Producer
from asyncroll.types import RolloutGroup


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="asyncroll", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="GRPO on the tiny local model with real vLLM (CPU ok)")
    defaults = DemoConfig()
    demo.add_argument("--steps", type=int, default=defaults.steps)
    demo.add_argument("--group-size", type=int, default=defaults.group_size)
    demo.add_argument("--batch-groups", type=int, default=defaults.batch_groups)
    demo.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    demo.add_argument("--max-staleness", type=int, default=defaults.max_staleness)
    demo.add_argument("--lr", type=float, default=defaults.lr)
    demo.add_argument("--seed", type=int, default=defaults.seed)
    demo.add_argument("--out", default=defaults.out, help="folder for metrics, plot, checkpoints")
    demo.add_argument("--checkpoint-every", type=int, default=0, help="steps (0: never)")
    demo.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    demo.add_argument(
        "--task",
        default=defaults.task,
        help="echo (single turn) or tool_echo (multi-turn: a tool answers each turn with a "
        "letter the policy must echo next turn)",
    )
    demo.add_argument(
        "--correction",
        default=defaults.correction,
        help="off-policy correction of stale tokens: none, decoupled, tis, mask, seq-mask "
        "(asyncroll.training.CORRECTIONS; the README says which to pick when)",
    )
    sim = sub.add_parser(
        "simulate",
        help="run the producer against SimEngine: a simulation (random tokens, no model) that "
        "shows the producer's accounting and overhead",
    )
    sim.add_argument("--prompts", type=int, default=2000)
    sim.add_argument("--group-size", type=int, default=8)
    sim.add_argument("--max-new-tokens", type=int, default=256)
    sim.add_argument("--batch", type=int, default=32, help="groups per produce_batch")
    sim.add_argument("--fail-rate", type=float, default=0.1)
    sim.add_argument("--per-token-latency", type=float, default=0.0, help="simulated seconds")
    sim.add_argument("--payload-bytes", type=int, default=0, help="per sample, like routed experts")
    sim.add_argument("--filter", default="nonzero_std", help="'nonzero_std' or 'none'")
    sim.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        options = {k: v for k, v in vars(args).items() if k != "command"}
        try:
            config = DemoConfig(**options)
        except ValueError as exc:
            parser.error(str(exc))
        asyncio.run(run_demo(config))
    else:
        asyncio.run(_simulate(args))


async def _parity_reward(group: RolloutGroup) -> list[float]:
    return [float(len(s.tokens) and s.tokens[0] % 2 == 0) for s in group.samples]


async def _simulate(args: argparse.Namespace) -> None:
    engine = SimEngine(
        SimConfig(
            vocab_size=32000,
            lengths="uniform",
            fail_rate=args.fail_rate,
            per_token_latency_s=args.per_token_latency,
            payload_bytes_per_sample=args.payload_bytes,
            seed=args.seed,
        )
    )
    prompts = [[1 + (i * 7 + j) % 31000 for j in range(16)] for i in range(args.prompts)]
    producer = Producer(
        engine,
        prompts,
        _parity_reward,
        group_size=args.group_size,
        sampling=SamplingConfig(max_new_tokens=args.max_new_tokens),
        filter=None if args.filter == "none" else args.filter,
    )
    process = psutil.Process()
    start = time.perf_counter()
    print("SimEngine is a simulation: random tokens, no model. It measures the producer only.")
    with tqdm(total=args.prompts, unit="prompt", desc="simulate") as bar:
        async with producer:
            async for batch in producer.batches(args.batch):
                c = batch.totals
                bar.update(c.consumed_groups + c.failed_groups + c.filtered_groups - bar.n)
                bar.set_postfix(
                    failed=c.failed_groups,
                    filtered=c.filtered_groups,
                    reward=f"{c.reward_sum / max(c.reward_count, 1):.2f}",
                    rss_mib=process.memory_info().rss >> 20,
                )
    ledger = producer.check_ledger()
    seconds = time.perf_counter() - start
    c = producer.progress.counters
    rows = [
        ("groups started", ledger.started_groups),
        ("consumed groups", c.consumed_groups),
        ("failed groups", c.failed_groups),
        ("filtered groups", c.filtered_groups),
        ("generated tokens", c.generated_tokens),
        ("wasted tokens: failed", c.wasted_tokens_failed),
        ("wasted tokens: filtered", c.wasted_tokens_filtered),
        ("groups/s", f"{ledger.started_groups / seconds:,.0f}"),
        ("ledger", "balanced"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
