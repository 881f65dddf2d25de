"""What a multi-turn episode costs over calling the engine yourself, at zero engine latency.

SimEngine is a simulation: it returns random tokens at once, so every microsecond measured here
is Python overhead (asyncroll's, or the bare loop's), never generation. Three ways to run the
same turns (each turn: the policy samples `--tokens` tokens, a tool answers with 2):

* **bare engine call**: a loop that builds each turn's `GenerateRequest` (prefix = everything so
  far) and awaits `engine.generate`, concatenating arrays itself: the floor any agent loop pays.
* **episode.generate in a Producer**: the same turns written as a `rollout_fn`, run by the
  producer with everything it adds: gate and deadline checks, output checks, per-turn request
  ids and session keys, the loss mask and turn boundaries, then per group the reward, the codec
  and the buffer, amortised over the group's turns.
* **single-turn Producer** (reference): the default path, one engine call per group of samples,
  per sample-turn.

With `--vllm` (real vLLM on the tiny local model; run it alone: `flock /tmp/asyncroll-vllm.lock`)
it also measures the re-prefill cost of an aborted turn: a turn of `--vllm-tokens` tokens after
a context of C tokens, in one request, against the same turn cut in half by an abort and
re-submitted with its first half as prefix (what `episode.generate` does across a pause), with
the prefix cache kept (a pause) or reset (a weight update resets it).

    python benchmarks/episodes.py            # ~1 min
    python benchmarks/episodes.py --quick    # ~10 s
    flock /tmp/asyncroll-vllm.lock python benchmarks/episodes.py --vllm   # + ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from asyncroll import Episode, Producer, SamplingConfig, SimEngine
from asyncroll.engines.base import GenerateRequest, SampleRequest
from asyncroll.types import RolloutGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    DEFAULT_OUT,
    info_line,
    new_figure,
    print_section,
    run_info,
    save_outputs,
)

VOCAB = 1000
TOOL = np.array([5, 6], dtype=np.int32)


def prompts(n: int) -> list[list[int]]:
    return [[1 + (i * 7 + j) % (VOCAB - 1) for j in range(8)] for i in range(n)]


async def zero_reward(group: RolloutGroup) -> list[float]:
    return [float(i % 2) for i in range(group.num_samples)]


async def bare(episodes: int, turns: int, tokens: int) -> float:
    """Seconds per turn of a hand-written loop over the engine."""
    engine = SimEngine(vocab_size=VOCAB)
    sampling = SamplingConfig(max_new_tokens=tokens)
    start = time.perf_counter()
    for e, prompt in enumerate(prompts(episodes)):
        arr = np.array(prompt, dtype=np.int32)
        context = np.zeros(0, dtype=np.int32)
        logprobs, versions = [], []
        for t in range(turns):
            request = GenerateRequest(
                request_id=f"b{e}-{t}",
                prompt_tokens=arr,
                samples=(SampleRequest(context, tokens),),
                sampling=sampling,
            )
            (out,) = await engine.generate(request)
            context = np.concatenate([context, out.tokens, TOOL])
            logprobs.append(out.logprobs)
            versions.append(out.versions)
    return (time.perf_counter() - start) / (episodes * turns)


async def in_producer(groups: int, group_size: int, turns: int, tokens: int) -> float:
    """Seconds per turn (per episode) of the same turns as a `rollout_fn`."""

    async def agent(episode: Episode) -> None:
        for _ in range(turns):
            turn = await episode.generate(max_new_tokens=tokens)
            assert len(turn.tokens) == tokens  # the same work as the bare loop
            episode.append(TOOL)

    producer = Producer(
        SimEngine(vocab_size=VOCAB), prompts(groups), zero_reward, group_size=group_size,
        rollout_fn=agent, max_turns=turns, max_episode_tokens=turns * (tokens + len(TOOL)),
        sampling=SamplingConfig(max_new_tokens=tokens),
        max_inflight_groups=16,
    )  # fmt: skip
    start = time.perf_counter()
    async with producer:
        async for _ in producer.batches(8):
            pass
        producer.check_ledger()
    return (time.perf_counter() - start) / (groups * group_size * turns)


async def single_turn(groups: int, group_size: int, tokens: int) -> float:
    producer = Producer(
        SimEngine(vocab_size=VOCAB), prompts(groups), zero_reward, group_size=group_size,
        sampling=SamplingConfig(max_new_tokens=tokens), max_inflight_groups=16,
    )  # fmt: skip
    start = time.perf_counter()
    async with producer:
        async for _ in producer.batches(8):
            pass
    return (time.perf_counter() - start) / (groups * group_size)


async def reprefill(contexts: Sequence[int], tokens: int, repeats: int) -> list[list[Any]]:
    """Seconds of a whole turn vs the same turn in two requests, per context length."""
    from asyncroll.app.models import build_tiny_model
    from asyncroll.engines import VLLMEngine

    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 200, 8, dtype=np.int32)
    sampling = SamplingConfig(max_new_tokens=tokens, ignore_eos=True)
    rows: list[list[Any]] = []
    calls = 0
    version = 0
    async with VLLMEngine(build_tiny_model(), max_model_len=max(contexts) + tokens + 16) as engine:

        async def call(prefix: Any, n: int) -> tuple[float, Any]:
            nonlocal calls
            calls += 1
            request = GenerateRequest(
                request_id=f"r{calls}", prompt_tokens=prompt,
                samples=(SampleRequest(prefix, n),), sampling=sampling,
            )  # fmt: skip
            start = time.perf_counter()
            (out,) = await engine.generate(request)
            return time.perf_counter() - start, out.tokens

        for c in contexts:
            context = rng.integers(3, 200, c, dtype=np.int32)
            await call(context, tokens)  # warm up (and fill the prefix cache)
            whole, kept, reset = [], [], []
            for _ in range(repeats):
                whole.append((await call(context, tokens))[0])
                first_s, first = await call(context, tokens // 2)
                second_s, _ = await call(np.concatenate([context, first]), tokens - tokens // 2)
                kept.append(first_s + second_s)
                first_s, first = await call(context, tokens // 2)
                version += 1
                await engine.update_weights(None, version=version)  # resets the prefix cache
                second_s, _ = await call(np.concatenate([context, first]), tokens - tokens // 2)
                reset.append(first_s + second_s)
            w, k, r = min(whole), min(kept), min(reset)
            rows.append([c, f"{w * 1e3:.1f}", f"{k * 1e3:.1f}", f"{k / w:.2f}",
                         f"{r * 1e3:.1f}", f"{r / w:.2f}"])  # fmt: skip
    return rows


def best_of(repeats: int, make: Any) -> float:
    return min(asyncio.run(make()) for _ in range(repeats))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=400)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32, help="policy tokens per turn")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    p.add_argument("--quick", action="store_true", help="CI size")
    p.add_argument("--vllm", action="store_true", help="also the re-prefill cost with vLLM")
    p.add_argument("--vllm-tokens", type=int, default=32, help="tokens of the measured turn")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.repeats = 40, 1
    info = run_info()
    g, n, k, t = args.groups, args.group_size, args.turns, args.tokens
    bare_s = best_of(args.repeats, lambda: bare(g * n, k, t))
    episode_s = best_of(args.repeats, lambda: in_producer(g, n, k, t))
    single_s = best_of(args.repeats, lambda: single_turn(g, n, t))
    rows = [
        ["bare engine call (hand-written loop)", f"{bare_s * 1e6:.1f}", "1.00"],
        ["episode.generate in a Producer", f"{episode_s * 1e6:.1f}", f"{episode_s / bare_s:.2f}"],
        ["single-turn Producer (per sample)", f"{single_s * 1e6:.1f}", f"{single_s / bare_s:.2f}"],
    ]
    text = info_line(info) + "\n\n"
    text += print_section(
        f"Cost per turn at zero engine latency (SimEngine, a simulation): {g} groups x {n} "
        f"episodes x {k} turns of {t} tokens + 2 tool tokens",
        ["path", "us per turn", "x bare"],
        rows,
    )
    payload: dict[str, Any] = {}
    if args.vllm:
        rows_v = asyncio.run(reprefill([16, 64, 128, 192], args.vllm_tokens, 5))
        payload["reprefill"] = rows_v
        text += "\n" + print_section(
            f"Re-prefill cost of an aborted turn ({args.vllm_tokens} tokens, tiny model, real "
            "vLLM on CPU): one request vs two (the second re-prefills prompt + context + half)",
            ["context tokens", "whole turn ms", "cut, cache kept ms", "x whole",
             "cut, cache reset ms", "x whole"],
            rows_v,
        )  # fmt: skip
    fig, (ax,) = new_figure(1, 1)
    ax.barh([r[0] for r in rows], [float(r[1]) for r in rows], color=["grey", "C0", "C1"])
    ax.set_xlabel("microseconds per turn (zero-latency simulated engine)")
    fig.suptitle(f"episode.generate costs {episode_s / bare_s:.2f}x a bare engine call")
    save_outputs(
        args.out, "episodes", fig,
        {"info": info, "args": {k2: str(v) for k2, v in vars(args).items()},
         "bare_s_per_turn": bare_s, "episode_s_per_turn": episode_s,
         "single_turn_s_per_sample": single_s, "ratio": episode_s / bare_s, **payload},
        text,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
