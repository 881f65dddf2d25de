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

    python benchmarks/reward_executor.py           # ~3 min
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


async def per_call_ms(runner: RewardRunner, group: RolloutGroup, calls: int) -> float:
    await runner.score(group)  # warm: the worker started, the modules imported
    start = time.perf_counter()
    for _ in range(calls):
        await runner.score(group)
    return (time.perf_counter() - start) / calls * 1e3


def pebble_call_ms(fn: Any, group: RolloutGroup, calls: int) -> float | None:
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

    with ProcessPool(max_workers=1, context=multiprocessing.get_context("spawn")) as pool:
        pool.schedule(fn, args=(payload(),), timeout=60).result()
        start = time.perf_counter()
        for _ in range(calls):
            pool.schedule(fn, args=(payload(),), timeout=60).result()
        return (time.perf_counter() - start) / calls * 1e3


async def bench_overhead(calls: int) -> list[dict[str, Any]]:
    from asyncroll.chat.answers import math_reward

    rows = []
    ids, text = make_group(), make_group(math_text())
    math = text_reward(math_reward, CharTokenizer())
    for name, fn, group, n in (("cheap", cheap, ids, calls), ("math-verify", math, text, calls)):
        row: dict[str, Any] = {"verifier": name}
        for executor in ("thread", "process"):
            if name == "math-verify" and executor == "thread":
                row["thread_ms"] = None  # math-verify refuses threads (SIGALRM)
                continue
            runner = RewardRunner(
                fn, timeout_s=60, workers=1, in_thread=True, executor=executor, max_calls=None
            )
            try:
                row[f"{executor}_ms"] = await per_call_ms(runner, group, n)
            finally:
                runner.close()
        row["pebble_ms"] = pebble_call_ms(fn, group, n)
        rows.append(row)
    return rows


# -- hangs -----------------------------------------------------------------------------------------


async def run_groups(reward: Any, executor: str, groups: int) -> dict[str, Any]:
    prompts = [Prompt(tokens=[1, 2, 3 + i % 100]) for i in range(groups)]
    engine = SimEngine(SimConfig(vocab_size=512, per_token_latency_s=LATENCY_S, seed=1))
    producer = Producer(
        engine, prompts, reward, group_size=8, sampling=SamplingConfig(max_new_tokens=256),
        max_inflight_groups=INFLIGHT, reward_workers=8, reward_timeout_s=DEADLINE_S,
        reward_executor=executor, max_dropped_in_a_row=None,
    )  # fmt: skip
    done, error, start = 0, None, 0.0
    try:
        async with producer:
            async for batch in producer.batches(8):
                if not start:  # from the first batch on: the workers have started
                    start = time.perf_counter()
                else:
                    done += len(batch.groups)
    except ProducerError as exc:
        error = str(exc)[:120]
    wall = time.perf_counter() - start
    return {"executor": executor, "completed": done, "wall_s": wall,
            "groups_per_s": done / wall, "error": error}  # fmt: skip


async def bench_hangs(groups: int) -> list[dict[str, Any]]:
    rows = []
    for executor in ("process", "thread"):
        base = await run_groups(cheap, executor, groups)
        hung = await run_groups(sometimes_hangs, executor, groups)
        rows.append({**hung, "baseline_groups_per_s": base["groups_per_s"],
                     "ratio": hung["groups_per_s"] / base["groups_per_s"]})  # fmt: skip
    return rows


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
    calls = 30 if args.quick else 300
    overhead = await bench_overhead(calls)
    hung = await bench_hangs(80 if args.quick else 400)
    kill = await bench_kill(5 if args.quick else 20)
    memory = await bench_memory(1000 if args.quick else 10_000, 100 if args.quick else 2000)

    report = [f"# Reward executor\n\n{info_line(info)}\n"]
    report.append(print_section(
        f"Per call, one at a time: a group of {SAMPLES} x {TOKENS} tokens (ms)",
        ["verifier", "threads", "processes (ours)", "pebble ProcessPool"],
        [[r["verifier"], r["thread_ms"], r["process_ms"], r["pebble_ms"]] for r in overhead],
    ))  # fmt: skip
    report.append(print_section(
        "Producer on SimEngine, 10% of reward calls hang forever "
        f"(deadline {DEADLINE_S} s, 8 reward workers)",
        ["executor", "groups/s", "without hangs", "ratio", "completed", "stopped with"],
        [[r["executor"], r["groups_per_s"], r["baseline_groups_per_s"], r["ratio"],
          r["completed"], r["error"] or ""] for r in hung],
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
