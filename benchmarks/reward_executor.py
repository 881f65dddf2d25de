"""What running sync rewards in worker processes (`reward_executor="process"`) costs, and what
it buys, next to worker threads (the default) and pebble's `ProcessPool` (the library the
executor was measured against before writing it on `multiprocessing`).

- **overhead**: ms per call, one call at a time, of a group of 8 samples x 1,024 tokens, with
  a cheap verifier (on token ids) and with math-verify on the decoded text
  (`asyncroll.chat.answers.math_reward`; its texts end in ``\\boxed{42}``).
- **hangs**: groups/s through `Producer` on `SimEngine` (a simulation whose groups take about
  what a small model's do: 8 x 256 tokens at 1 ms a token) when 10% of the reward calls never
  return, against the same run without hangs; threads stop the run once every worker hangs.
- **kill latency**: from the call's deadline to the failure in the caller, over 20 hung calls
  (for pebble: to its future's `TimeoutError`).
- **memory**: a worker's resident memory over 10,000 cheap calls (2,000 with math-verify).

    python benchmarks/reward_executor.py           # ~3 min quiet, ~10 min on a loaded 2-core box
    python benchmarks/reward_executor.py --quick   # < 1 min (smoke run)

pebble is measured when it is importable (it is not a dependency of asyncroll).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from asyncroll import (
    Producer,
    ProducerError,
    Prompt,
    RolloutGroup,
    RolloutState,
    SamplingConfig,
    SimConfig,
    SimEngine,
)
from asyncroll._core.rewards import RewardDeadline, RewardRunner
from asyncroll.chat import text_reward
from asyncroll.types import Status

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import DEFAULT_OUT, info_line, new_figure, print_section, run_info, save_outputs

from tests.verifiers import CharTokenizer

SAMPLES, TOKENS = 8, 1024
DEADLINE_S = 1.0
# The simulated engine's pace: 16 groups of 8 x 256 tokens at once, 4 ms a token (about 15
# groups/s: generation, not scoring, sets the pace, as in a real run).
INFLIGHT, LATENCY_S = 16, 0.004


def cheap(group: RolloutGroup) -> list[float]:
    """A verifier on token ids: does the sample end with token 10?"""
    return [float(s.tokens[-1] == 10) for s in group.samples]


def sometimes_hangs(group: RolloutGroup) -> list[float]:
    """One call in ten never returns (by the group's uid, so both runs hang on the same)."""
    if group.uid % 10 == 3:
        time.sleep(3600)
    return [1.0] * group.num_samples


def hangs(group: RolloutGroup) -> list[float]:
    time.sleep(3600)
    return []


def make_group(text: str | None = None, uid: int = 0) -> RolloutGroup:
    """8 samples of 1,024 tokens; with `text`, ids that `CharTokenizer` decodes to it."""
    states = []
    for i in range(SAMPLES):
        if text is None:
            ids = np.arange(i, i + TOKENS, dtype=np.int32) % 500
        else:
            ids = np.array([ord(c) for c in text], np.int32)
        states.append(
            RolloutState(
                tokens=ids,
                logprobs=np.zeros(len(ids), np.float32),
                versions=np.zeros(len(ids), np.int32),
                status=Status.COMPLETED,
                finish_reason="stop",
            )
        )
    return RolloutGroup(
        uid=uid, prompt_id=f"bench/{uid}", task="default",
        prompt_tokens=np.array([1, 2, 3], np.int32), samples=tuple(states),
        metadata={"answer": "42"},
    )  # fmt: skip


def math_text() -> str:
    """About 1,024 characters of working, then the boxed answer."""
    step = "We add 6 and 7 to get 13, then multiply by 3 to get 39, and add 3. "
    return (step * (TOKENS // len(step)))[: TOKENS - 14] + " \\boxed{42}"


# -- overhead --------------------------------------------------------------------------------------


async def per_call_ms(runner: RewardRunner, group: RolloutGroup, calls: int) -> list[float]:
    await runner.score(group)  # warm: the worker started, the modules imported
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        await runner.score(group)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def pebble_call_ms(fn: Any, group: RolloutGroup, calls: int) -> list[float] | None:
    """pebble pickles the function with each task: a text reward is split as the executor
    splits it (the decode here, the text functions there), or the tokenizer would be sent."""
    prepare = None
    if hasattr(fn, "split_for_processes"):
        prepare, fn = fn.split_for_processes()
    try:
        import multiprocessing

        from pebble import ProcessPool
    except ImportError:
        return None

    def payload() -> Any:
        return group if prepare is None else prepare(group)

    times = []
    with ProcessPool(max_workers=1, context=multiprocessing.get_context("spawn")) as pool:
        pool.schedule(fn, args=(payload(),), timeout=60).result()
        for _ in range(calls):
            start = time.perf_counter()
            pool.schedule(fn, args=(payload(),), timeout=60).result()
            times.append((time.perf_counter() - start) * 1e3)
    return times


async def arm_ms(executor: str, fn: Any, group: RolloutGroup, calls: int) -> list[float] | None:
    if executor == "pebble":
        return pebble_call_ms(fn, group, calls)
    runner = RewardRunner(
        fn, timeout_s=60, workers=1, in_thread=True, executor=executor, max_calls=None
    )
    try:
        return await per_call_ms(runner, group, calls)
    finally:
        runner.close()


async def bench_overhead(calls: int, rounds: int) -> list[dict[str, Any]]:
    """Each arm's per-call times in `rounds` blocks of `calls`, the arms alternating within a
    round in an order that rotates (the machine is shared: load that comes and goes falls on
    each arm alike); a block's median is its figure (a call the scheduler preempted is an
    outlier, which a mean of one block would carry), the arm's the median of its blocks."""
    from asyncroll.chat.answers import math_reward

    rows = []
    ids, text = make_group(), make_group(math_text())
    math = text_reward(math_reward, CharTokenizer())
    for name, fn, group in (("cheap", cheap, ids), ("math-verify", math, text)):
        # math-verify refuses threads (SIGALRM)
        arms = ["process", "pebble"] + ([] if name == "math-verify" else ["thread"])
        blocks: dict[str, list[list[float]]] = {arm: [] for arm in arms}
        for round_ in range(rounds):
            k = round_ % len(arms)
            for arm in arms[k:] + arms[:k]:
                times = await arm_ms(arm, fn, group, calls)
                if times is not None:
                    blocks[arm].append(times)
        row: dict[str, Any] = {"verifier": name, "blocks": blocks}
        for arm in ("thread", "process", "pebble"):
            medians = [statistics.median(b) for b in blocks.get(arm, [])]
            row[f"{arm}_ms"] = statistics.median(medians) if medians else None
            row[f"{arm}_spread"] = f"{min(medians):.3g}-{max(medians):.3g}" if medians else ""
            row[f"{arm}_mean_ms"] = (
                statistics.mean(t for b in blocks[arm] for t in b) if medians else None
            )
        rows.append(row)
    return rows


# -- hangs -----------------------------------------------------------------------------------------


async def run_groups(reward: Any, executor: str, groups: int) -> dict[str, Any]:
    """One run over `groups` prompts, timed from its first batch; the groups in flight are
    sampled every 10 ms (their mean, with the groups finished per second, gives by Little's
    law how long a group holds its in-flight slot: `slot_s`)."""
    prompts = [Prompt(tokens=[1, 2, 3 + i % 100]) for i in range(groups)]
    engine = SimEngine(SimConfig(vocab_size=512, per_token_latency_s=LATENCY_S, seed=1))
    producer = Producer(
        engine, prompts, reward, group_size=8, sampling=SamplingConfig(max_new_tokens=256),
        max_inflight_groups=INFLIGHT, reward_workers=8, reward_timeout_s=DEADLINE_S,
        reward_executor=executor, max_dropped_in_a_row=None,
    )  # fmt: skip
    done, error, start = 0, None, 0.0
    inflight: list[int] = []

    async def sample() -> None:
        while True:
            await asyncio.sleep(0.01)
            if start:
                inflight.append(producer.ledger().in_flight_groups)

    sampler = asyncio.ensure_future(sample())
    try:
        async with producer:
            async for batch in producer.batches(8):
                if not start:  # from the first batch on: the workers have started
                    start = time.perf_counter()
                    first = producer.progress.counters.copy()
                else:
                    done += len(batch.groups)
    except ProducerError as exc:
        error = str(exc)[:120]
    finally:
        sampler.cancel()
    wall = time.perf_counter() - start
    totals = producer.progress.counters
    finished = sum(
        getattr(totals, f) - getattr(first, f)
        for f in ("completed_groups", "failed_groups", "filtered_groups")
    )
    mean_inflight = statistics.mean(inflight) if inflight else 0.0
    return {"executor": executor, "completed": done, "wall_s": wall,
            "groups_per_s": done / wall, "finished_per_s": finished / wall,
            "failed": totals.failed_groups, "mean_inflight": mean_inflight,
            "slot_s": mean_inflight / (finished / wall) if finished else None,
            "error": error}  # fmt: skip


async def bench_hangs(groups: int, rounds: int) -> list[dict[str, Any]]:
    """Process: `rounds` pairs of runs (without hangs, with), alternating which goes first;
    threads: one pair (the hung run stops)."""
    rows = []
    for round_ in range(rounds):
        pair = {}
        for hung in (False, True) if round_ % 2 == 0 else (True, False):
            pair[hung] = await run_groups(sometimes_hangs if hung else cheap, "process", groups)
        rows.append(hang_row(pair[False], pair[True]))
    base = await run_groups(cheap, "thread", groups)
    rows.append(hang_row(base, await run_groups(sometimes_hangs, "thread", groups)))
    return rows


def hang_row(base: dict[str, Any], hung: dict[str, Any]) -> dict[str, Any]:
    """With a share h of the groups holding their slot for the deadline D on top of the time
    t a group holds it without hangs (`slot_s` of the run without), and the slots kept full,
    completed groups/s can reach at most (1 - h) x t / (t + h x D) of the run without."""
    h, t = 0.1, base["slot_s"]
    return {**hung, "baseline_groups_per_s": base["groups_per_s"],
            "baseline_slot_s": t, "baseline_mean_inflight": base["mean_inflight"],
            "ratio": hung["groups_per_s"] / base["groups_per_s"],
            "ceiling": (1 - h) * t / (t + h * DEADLINE_S)}  # fmt: skip


# -- kill latency ----------------------------------------------------------------------------------


async def bench_kill(calls: int) -> dict[str, Any]:
    deadline = 0.5
    runner = RewardRunner(
        hangs, timeout_s=deadline, workers=1, in_thread=True, executor="process", max_calls=None
    )
    assert runner.pool is not None
    lates = []
    for _ in range(calls):
        worker = await runner.pool._start()  # an idle worker: the deadline counts, not a start
        runner.pool._idle.append(worker)
        start = time.perf_counter()
        try:
            await runner.score(make_group())
        except RewardDeadline:
            lates.append((time.perf_counter() - start - deadline) * 1e3)
    runner.close()
    out: dict[str, Any] = {"ours_ms": lates, "pebble_ms": pebble_kill_ms(deadline, calls)}
    return out


def pebble_kill_ms(deadline: float, calls: int) -> list[float] | None:
    try:
        import multiprocessing
        from concurrent.futures import TimeoutError as FutureTimeout

        from pebble import ProcessPool
    except ImportError:
        return None
    lates = []
    with ProcessPool(max_workers=1, context=multiprocessing.get_context("spawn")) as pool:
        for _ in range(calls):
            pool.schedule(cheap, args=(make_group(),), timeout=60).result()  # a warm worker
            start = time.perf_counter()
            try:
                pool.schedule(hangs, args=(make_group(),), timeout=deadline).result()
            except FutureTimeout:
                lates.append((time.perf_counter() - start - deadline) * 1e3)
    return lates


# -- memory ----------------------------------------------------------------------------------------


async def bench_memory(calls: int, math_calls: int) -> list[dict[str, Any]]:
    from asyncroll.chat.answers import math_reward

    rows = []
    small = make_group()
    math = text_reward(math_reward, CharTokenizer())
    cases = [("cheap", cheap, small, calls),
             ("math-verify", math, make_group(math_text()), math_calls)]  # fmt: skip
    for name, fn, group, n in cases:
        runner = RewardRunner(
            fn, timeout_s=60, workers=1, in_thread=True, executor="process", max_calls=None
        )
        assert runner.pool is not None
        await runner.score(group)
        (pid,) = runner.pool.pids()
        points = [(1, worker_rss_mib(pid))]
        step = max(1, n // 10)
        for i in range(2, n + 1):
            await runner.score(group)
            if i % step == 0:
                points.append((i, worker_rss_mib(pid)))
        runner.close()
        rows.append({"verifier": name, "points": points})
    return rows


def worker_rss_mib(pid: int) -> float:
    import os

    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# -- report ----------------------------------------------------------------------------------------


def ms(values: list[float] | None, q: float) -> float | None:
    if not values:
        return None
    return float(np.quantile(values, q))


async def main_async(args: argparse.Namespace) -> None:
    info = run_info()
    overhead = await bench_overhead(20 if args.quick else 100, 2 if args.quick else 6)
    hung = await bench_hangs(80 if args.quick else 400, 1 if args.quick else 3)
    kill = await bench_kill(5 if args.quick else 20)
    memory = await bench_memory(1000 if args.quick else 10_000, 100 if args.quick else 2000)

    report = [f"# Reward executor\n\n{info_line(info)}\n"]
    report.append(print_section(
        f"Per call, one at a time: a group of {SAMPLES} x {TOKENS} tokens (ms; median of "
        "the blocks' medians, the blocks' spread, the mean of every call)",
        ["verifier", "threads", "spread", "processes (ours)", "spread", "mean",
         "pebble ProcessPool", "spread", "mean"],
        [[r["verifier"], r["thread_ms"], r["thread_spread"], r["process_ms"],
          r["process_spread"], r["process_mean_ms"], r["pebble_ms"], r["pebble_spread"],
          r["pebble_mean_ms"]] for r in overhead],
    ))  # fmt: skip
    report.append(print_section(
        "Producer on SimEngine, 10% of reward calls hang forever "
        f"(deadline {DEADLINE_S} s, 8 reward workers, {INFLIGHT} groups in flight at most)",
        ["executor", "groups/s", "without hangs", "ratio", "ceiling", "s a slot is held",
         "without hangs", "groups in flight", "without hangs", "completed", "failed",
         "stopped with"],
        [[r["executor"], r["groups_per_s"], r["baseline_groups_per_s"], r["ratio"],
          r["ceiling"], r["slot_s"], r["baseline_slot_s"], r["mean_inflight"],
          r["baseline_mean_inflight"], r["completed"], r["failed"], r["error"] or ""]
         for r in hung],
    ))  # fmt: skip
    report.append(print_section(
        "Kill latency: past the deadline until the caller hears (ms)",
        ["pool", "median", "p90", "max", "calls"],
        [["ours", ms(kill["ours_ms"], 0.5), ms(kill["ours_ms"], 0.9), max(kill["ours_ms"]),
          len(kill["ours_ms"])]]
        + ([["pebble", ms(kill["pebble_ms"], 0.5), ms(kill["pebble_ms"], 0.9),
             max(kill["pebble_ms"]), len(kill["pebble_ms"])]] if kill["pebble_ms"] else []),
    ))  # fmt: skip
    report.append(print_section(
        "Worker resident memory (MiB) over its calls",
        ["verifier", "after call 1", "last", "calls", "growth MiB / 1,000 calls"],
        [[r["verifier"], r["points"][0][1], r["points"][-1][1], r["points"][-1][0],
          (r["points"][-1][1] - r["points"][1][1])
          / max(1, r["points"][-1][0] - r["points"][1][0]) * 1000] for r in memory],
    ))  # fmt: skip
    fig, (ax,) = new_figure(1, 1)
    ax.set(title="Reward worker memory", xlabel="calls", ylabel="resident MiB")
    for r in memory:
        xs, ys = zip(*r["points"], strict=True)
        ax.plot(xs, ys, marker="o", label=r["verifier"])
    ax.legend()
    payload = {"info": info, "overhead": overhead, "hangs": hung, "kill": kill,
               "memory": memory, "kill_median_ms": statistics.median(kill["ours_ms"])}  # fmt: skip
    save_outputs(Path(args.out), "reward_executor", fig, payload, "\n".join(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
