"""What the run record costs the producer: throughput with and without it on SimEngine (a
simulation: random tokens, no model), the event loop's longest stall with it, and its bytes
per token on disk.

Each round runs the same producer twice, without and with `record=` (in alternating order),
taking `--steps` batches as fast as they come; the ratio of the two throughputs is the cost.
A monitor task sleeps 1 ms at a time and keeps every overshoot: the loop's stalls while the
record's feeder thread and writer process work beside it (the longest, the 99th percentile,
and how many passed 5 ms). The machine is shared and noisy: compare the two runs of one
round, over several rounds.

    python benchmarks/record_cost.py [--rounds 5] [--steps 30] [--latency 1e-3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np

from asyncroll import Producer, SamplingConfig, SimConfig, SimEngine
from asyncroll.record import record_files
from asyncroll.types import RolloutGroup


async def reward(group: RolloutGroup) -> list[float]:
    return [float(s.tokens[0] % 2) if len(s.tokens) else 0.0 for s in group.samples]


async def one_run(
    steps: int, record: Path | None, tokens: int, latency: float
) -> tuple[float, list[float], int]:
    """Tokens per second handed out, the loop's stalls (s), response tokens."""
    engine = SimEngine(SimConfig(vocab_size=32000, seed=0, per_token_latency_s=latency))
    prompts = ([i % 100, 7, 9] for i in range(1 << 30))
    producer = Producer(
        engine, prompts, reward, group_size=8, batch_size=16,
        sampling=SamplingConfig(max_new_tokens=tokens), record=record, reward_in_thread=False,
    )  # fmt: skip
    stalls: list[float] = []
    done = False

    async def monitor() -> None:
        while not done:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            stalls.append(time.perf_counter() - start - 0.001)

    handed = 0
    async with producer:
        watch = asyncio.create_task(monitor())
        start = time.perf_counter()
        for step in range(1, steps + 1):
            batch = await producer.produce_batch()
            handed += sum(g.num_tokens for g in batch.groups)
            producer.record.step_metrics(step, {"train/loss": 0.0})
        wall = time.perf_counter() - start
        done = True
        await watch
    return handed / wall, stalls, handed


def stall_text(stalls: list[float]) -> str:
    """The longest, the 99th percentile (ms), and how many passed 5 ms."""
    ms = np.array(stalls) * 1e3
    return f"{ms.max():.2f} / {np.percentile(ms, 99):.2f} / {int((ms > 5).sum())}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=128, help="max_new_tokens")
    parser.add_argument(
        "--latency", type=float, default=1e-3,
        help="simulated s per token of a sample (1e-3: ~0.45 M tok/s handed out on 2 cores, "
        "time the loop spends waiting as beside an engine; 0: as fast as the producer goes)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="1 round of 20 steps")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 20
    ratios, worst, plain_worst, per_token = [], [], [], []
    print("| round | without (tok/s) | with (tok/s) | with / without | stalls with: max / p99 "
          "(ms) / > 5 ms | stalls without | bytes/token |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            order = [None, Path(tmp)] if r % 2 == 0 else [Path(tmp), None]
            out = {}
            for where in order:
                out[where is None] = asyncio.run(
                    one_run(args.steps, where, args.tokens, args.latency)
                )
            size = sum(p.stat().st_size for p in record_files(tmp))
        (plain, plain_stalls, _), (rec, stalls, n) = out[True], out[False]
        ratios.append(rec / plain)
        worst.append(max(stalls))
        plain_worst.append(max(plain_stalls))
        per_token.append(size / n)
        print(f"| {r} | {plain:,.0f} | {rec:,.0f} | {rec / plain:.3f} | {stall_text(stalls)} | "
              f"{stall_text(plain_stalls)} | {size / n:.1f} |")  # fmt: skip
    longest, plain_longest = np.median(worst) * 1e3, np.median(plain_worst) * 1e3
    print(f"\nmedian with/without {np.median(ratios):.3f}, longest stall with "
          f"{max(worst) * 1e3:.2f} ms (without {max(plain_worst) * 1e3:.2f} ms), median of "
          f"the rounds' longest {longest:.2f} ms (without {plain_longest:.2f} ms), "
          f"{np.median(per_token):.1f} bytes per token")  # fmt: skip


if __name__ == "__main__":
    main()
