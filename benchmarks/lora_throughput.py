"""Generation throughput while the trainer syncs the policy every step: LoRA adapter updates
(no pause) against full-weight updates (a pause, in "abort" and in "keep" mode).

A real `Producer` on a real in-process `VLLMEngine` generates groups without end; a trainer
loop takes a batch of `--batch` groups, then (in the updating settings) calls
`producer.update_weights` with fresh weights, and takes the next batch: one update per step,
as an RL loop that syncs every step does. The trainer itself is simulated as free (a trainer
on another device: `--train-s` seconds of `asyncio.sleep` per step, 0 by default), so updates
come as often as generation allows, the most demanding case. Settings, for `--seconds` of wall
time each (and `--min-steps` steps at least) after a warm-up batch (and a warm-up update):

- base: an engine without LoRA, no updates (the reference for the next two);
- full, abort / full, keep: the same engine, all the model's weights every step (two perturbed
  copies, built before the run and alternated, so every update changes every tensor);
- LoRA, 1 adapter: an engine started with LoRA, serving one rank-8 adapter, no updates (what
  the LoRA kernels cost by themselves; the reference for the next);
- LoRA, update: the same engine, a new rank-8 adapter (on all seven projections) every step;
  the producer does not pause for it (`adapter_updates_without_pause`);
- LoRA, update, pause: the same, with the trainer pausing the producer ("keep" mode: the
  running requests freeze in vLLM) around each adapter update, the choice a trainer has.

The settings without updates run with `max_staleness` None (no version to be stale against),
the updating ones with `max_staleness` 1, the usual async-RL bound. Every setting runs on the
same workload: random prompts, `--group-size` samples of `--new-tokens` tokens each (eos
ignored), `--batch` groups in flight at most. The engines stream every token as it is sampled
(`stream_interval` 1, the same for all settings: with less, tokens arrive in bursts over a
second apart on the 98M model, too coarse to see a stall), and a task stamps every arrival of
tokens (`wait_generated`): that timeline gives generated tokens/s, the tokens/s over time, and
the stall at each step: the longest gap with no token received that overlaps the
`update_weights` call, or in the settings without updates the gap around the moment the trainer
got its batch. A step boundary stalls without any update too: the groups admitted as a batch
leaves are prefilled then, and on CPU a LoRA prefill step takes seconds; what an update adds is
its stall minus that of the same engine without updates. "Kept" is the tokens in groups handed
to the trainer; "wasted" is what the producer threw away (expired past the staleness bound, or
failed). Aborted samples are not thrown away: the producer continues them from their tokens so
far, after a re-prefill.

    python benchmarks/lora_throughput.py --out benchmarks/results   # the ~98M Llama, ~9 min
    python benchmarks/lora_throughput.py --quick                    # the tiny model, 6 steps each

Prints a table and writes `lora_throughput.{md,json,png}` to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from _common import DEFAULT_OUT, info_line, new_figure, print_section, run_info, save_outputs
from lora_update import MODELS, random_adapter

from asyncroll import Producer, SamplingConfig
from asyncroll.app.models import build_tiny_model
from asyncroll.lora import LoraAdapter, LoraSlots

RANK = 8
STREAM_INTERVAL = 1
BIN_S = 2.0  # width of the tokens/s-over-time bins
WAIT_S = 600.0  # deadline of every wait on the engine or the producer


@dataclass(frozen=True)
class Setting:
    name: str
    engine: Literal["base", "lora"]
    update: Literal["none", "full", "adapter"]
    pause_mode: Literal["abort", "keep"] = "abort"
    reference: str = ""  # the no-update setting of the same engine ("" for those themselves)
    pause: bool = False  # the trainer pauses the producer around each (adapter) update


SETTINGS = (
    Setting("base", "base", "none"),
    Setting("full, abort", "base", "full", "abort", reference="base"),
    Setting("full, keep", "base", "full", "keep", reference="base"),
    Setting("LoRA, 1 adapter", "lora", "none"),
    Setting("LoRA, update", "lora", "adapter", reference="LoRA, 1 adapter"),
    Setting("LoRA, update, pause", "lora", "adapter", "keep", "LoRA, 1 adapter", pause=True),
)
COLORS = {"base": "#555555", "full, abort": "#e6550d", "full, keep": "#fdae6b",
          "LoRA, 1 adapter": "#3182bd", "LoRA, update": "#31a354",
          "LoRA, update, pause": "#a1d99b"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    asyncio.run(measure(parse_args(argv)))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-98M")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured wall time each")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternated")
    parser.add_argument("--batch", type=int, default=4, help="groups per step (and in flight)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument(
        "--slots",
        type=int,
        default=2,
        help="LoRA adapters registered at once "
        "(2: the policy and the one before it, what max_staleness 1 needs)",
    )
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=("base", "lora"),
        default=["base", "lora"],
        help="which engine's settings to run",
    )
    parser.add_argument("--train-s", type=float, default=0.0, help="simulated train time/step")
    parser.add_argument("--min-steps", type=int, default=1, help="steps per window, at least")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 6 small steps each")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        # What the smoke test asserts (tokens generated and kept in the window, an update per
        # step where the setting updates) on the smallest groups, in 6 steps whatever the
        # time: at most 4 batches wait in the buffer and one is in flight as the window opens,
        # so the 6th batch holds a group admitted, and so generated, inside it. The two
        # engine starts are most of the run.
        args.model, args.seconds, args.rounds, args.min_steps = "tiny", 0.0, 1, 6
        args.batch, args.group_size, args.new_tokens, args.prompt_len = 2, 2, 4, 8
    return args


async def measure(args: argparse.Namespace, engines: Mapping[str, Any] | None = None) -> None:
    """Every setting's runs, then the report. `engines`: an engine per kind ("base", "lora":
    the tiny model's, LoRA with rank 8 or more) to run on instead of starting them (the test
    suite's smoke run uses its session's)."""
    model = build_tiny_model(MODELS[args.model])
    rounds = await _measure(model, args, engines or {})
    _report({name: _pool(runs) for name, runs in rounds.items() if runs}, rounds, args)


async def _measure(
    model: Path, args: argparse.Namespace, given: Mapping[str, Any]
) -> dict[str, list[dict[str, Any]]]:
    """Every setting `args.rounds` times, the settings of one engine taking turns round by
    round (so load from other processes hits them alike); each setting starts from version 0
    and the starting weights (or adapter). Engines in `given` are used, the others started."""
    from safetensors.torch import load_file

    weights = list(load_file(model / "model.safetensors").items())
    full = [_scaled_full(weights, s) for s in (1.001, 1.002)]  # alternated: each update changes
    adapters = [_scaled_adapter(random_adapter(weights, RANK), s) for s in (1.0, 1.001, 1.002)]
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in SETTINGS}
    for kind in args.engines:
        async with _engine(model, kind, args.slots, given.get(kind)) as engine:
            if kind == "lora":  # the adapter the no-update setting serves, as version 0
                await engine.update_weights(adapters[0], version=0)
            for round_ in range(args.rounds):
                for setting in (s for s in SETTINGS if s.engine == kind):
                    updates = full if setting.update == "full" else adapters[1:]
                    print(f"{setting.name}, round {round_ + 1}: {args.seconds:.0f} s",
                          file=sys.stderr, flush=True)  # fmt: skip
                    run = await _run(engine, setting, updates, args)
                    if setting.update == "full":  # back to version 0 for the next setting
                        await engine.update_weights(weights, version=0)
                    elif setting.update == "adapter":
                        await engine.update_weights(adapters[0], version=0)
                    _print_run(setting.name, run)
                    runs[setting.name].append(run)
    return runs


def _scaled_full(weights: list[tuple[str, Any]], scale: float) -> list[tuple[str, Any]]:
    return [(n, t * scale) for n, t in weights]


def _scaled_adapter(adapter: LoraAdapter, scale: float) -> LoraAdapter:
    return LoraAdapter(adapter.config, {k: t * scale for k, t in adapter.tensors.items()})


@asynccontextmanager
async def _engine(model: Path, kind: str, slots: int, given: Any | None) -> AsyncIterator[Any]:
    """`given`, left open, or an engine of `kind` started and closed here."""
    if given is not None:
        yield given
        return
    from asyncroll.engines import VLLMEngine

    lora = LoraSlots(max_rank=RANK, slots=slots) if kind == "lora" else None
    async with VLLMEngine(
        model, max_model_len=512, seed=0, lora=lora, stream_interval=STREAM_INTERVAL
    ) as engine:
        yield engine


async def _run(
    engine: Any, setting: Setting, updates: list[Any], args: argparse.Namespace
) -> dict[str, Any]:
    """One setting: warm up, then `args.seconds` of trainer steps; the timeline of token
    arrivals, every update's (start, end), the producer's counters over the window."""
    updating = setting.update != "none"
    producer = Producer(
        engine, _prompts(engine.vocab_size, args.prompt_len), _reward,
        group_size=args.group_size, batch_size=args.batch,
        max_staleness=1 if updating else None, max_inflight_groups=args.batch,
        max_buffer_groups=4 * args.batch, pause_mode=setting.pause_mode,
        sampling=SamplingConfig(max_new_tokens=args.new_tokens, ignore_eos=True),
    )  # fmt: skip
    weights = itertools.cycle(updates)
    arrivals: list[tuple[float, int]] = []
    update_spans: list[tuple[float, float]] = []
    async with producer, asyncio.TaskGroup() as tasks:
        tick = asyncio.Event()  # set at every arrival the recorder stamps
        recorder = tasks.create_task(_record(engine, arrivals, tick))
        await producer.produce_batch(timeout=WAIT_S)  # warm-up
        if updating:
            await producer.update_weights(next(weights))
        start, before = time.monotonic(), producer.progress.counters.copy()
        end = start + args.seconds
        steps = 0
        while steps < args.min_steps or time.monotonic() < end:
            await producer.produce_batch(timeout=WAIT_S)
            steps += 1
            if args.train_s:
                await asyncio.sleep(args.train_s)
            if updating:
                w = next(weights)
                t0 = time.monotonic()
                if setting.pause:  # the producer does not pause for an adapter by itself
                    async with producer.pausing():
                        await producer.update_weights(w)
                else:
                    await producer.update_weights(w)
                update_spans.append((t0, time.monotonic()))
            else:  # where the update would be: the stall a step boundary has without one
                update_spans.append((time.monotonic(),) * 2)
        stop = time.monotonic()
        counters = producer.progress.counters.minus(before)
        # One arrival after the window closes the gap the last step's stall is measured in.
        async with asyncio.timeout(WAIT_S):
            while arrivals[-1][0] < stop:
                tick.clear()
                await tick.wait()
        recorder.cancel()
    return _summary(arrivals, update_spans, start, stop, counters, steps)


def _prompts(vocab: int, length: int) -> Iterator[list[int]]:
    rng = np.random.default_rng(0)
    while True:
        yield rng.integers(3, vocab, length).tolist()


async def _reward(group: Any) -> list[float]:
    return [0.0] * group.num_samples


async def _record(engine: Any, arrivals: list[tuple[float, int]], tick: asyncio.Event) -> None:
    """Stamp every arrival of tokens (the engine's counter, when it moves) until cancelled;
    set `tick` after each."""
    seen = engine.generated_tokens
    arrivals.append((time.monotonic(), seen))  # where the counter starts
    while True:
        try:
            await engine.wait_generated(seen + 1, timeout=WAIT_S)
        except TimeoutError:
            continue  # nothing arrived for WAIT_S: a gap that long shows in the timeline
        seen = engine.generated_tokens
        arrivals.append((time.monotonic(), seen))
        tick.set()


def _summary(
    arrivals: list[tuple[float, int]], spans: list[tuple[float, float]], start: float,
    stop: float, counters: Any, steps: int,
) -> dict[str, Any]:  # fmt: skip
    # From the window's start to the first arrival after it ends (see `_run`).
    after = next(t for t, _ in arrivals if t >= stop)
    times = np.array([start, *(t for t, _ in arrivals if start < t <= after)])
    counts = np.array([c for _, c in arrivals])
    at = np.array([t for t, _ in arrivals])

    def count(t: float) -> int:  # the counter at time t: its value at the last arrival by t
        return int(counts[max(0, int(np.searchsorted(at, t, side="right")) - 1)])

    generated = count(stop) - count(start)
    gaps = np.diff(times)

    def stall(t0: float, t1: float) -> float:
        """The longest gap between arrivals that overlaps [t0, t1] (t0 == t1: the gap around
        that instant)."""
        overlapping = (times[1:] > t0) & (times[:-1] < t1)
        return float(gaps[overlapping].max()) if overlapping.any() else t1 - t0

    window = stop - start
    inside = (at > start) & (at <= stop)
    edges = np.arange(0.0, window + BIN_S, BIN_S)
    per_bin = np.histogram(
        at[inside] - start, edges, weights=np.diff(counts, prepend=counts[0])[inside]
    )
    widths = np.minimum(edges[1:], window) - edges[:-1]  # the last bin ends with the window
    return {
        "window_s": window,
        "steps": steps,
        "generated_tokens": generated,
        "generated_tps": generated / window,
        "kept_tokens": counters.consumed_tokens,
        "kept_tps": counters.consumed_tokens / window,
        "wasted_tokens": counters.wasted_tokens_expired + counters.wasted_tokens_failed,
        "aborted_samples": counters.aborted_samples,
        "failed_groups": counters.failed_groups,
        "expired_groups": counters.expired_groups,
        "updates": sum(t1 > t0 for t0, t1 in spans),
        "update_s": [t1 - t0 for t0, t1 in spans if t1 > t0],
        "stall_s": [stall(t0, t1) for t0, t1 in spans],  # one per step
        "update_at_s": [t0 - start for t0, t1 in spans if t1 > t0],
        "longest_gap_s": float(gaps.max()),
        "median_gap_s": float(np.median(gaps)),
        "bins_s": edges[:-1].tolist(),
        "bins_tps": (per_bin[0] / widths).tolist(),
    }


def _pool(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A setting's rounds as one run: tokens over the sum of the windows, every update."""
    window = sum(r["window_s"] for r in rounds)
    out: dict[str, Any] = {"window_s": window, "rounds": len(rounds)}
    for key in ("steps", "generated_tokens", "kept_tokens", "wasted_tokens", "aborted_samples",
                "failed_groups", "expired_groups", "updates"):  # fmt: skip
        out[key] = sum(r[key] for r in rounds)
    for key in ("update_s", "stall_s"):
        out[key] = [x for r in rounds for x in r[key]]
    out["generated_tps"] = out["generated_tokens"] / window
    out["kept_tps"] = out["kept_tokens"] / window
    out["longest_gap_s"] = max(r["longest_gap_s"] for r in rounds)
    out["median_gap_s"] = statistics.median(r["median_gap_s"] for r in rounds)
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _print_run(name: str, r: dict[str, Any]) -> None:
    print(
        f"{name}: {r['generated_tps']:.0f} tok/s generated, {r['kept_tps']:.0f} kept, "
        f"{r['updates']} updates, median update {_median(r['update_s']) * 1e3:.0f} ms, "
        f"median stall {_median(r['stall_s']) * 1e3:.0f} ms",
        file=sys.stderr,
        flush=True,
    )


def _report(
    runs: dict[str, dict[str, Any]], rounds: dict[str, list[dict[str, Any]]],
    args: argparse.Namespace,
) -> None:  # fmt: skip
    info = run_info()
    rows = []
    base = runs.get("base")
    for s in (s for s in SETTINGS if s.name in runs):
        r = runs[s.name]
        ref = runs.get(s.reference)
        ratio = r["generated_tps"] / ref["generated_tps"] if ref else 1.0
        kept = r["kept_tps"] / ref["kept_tps"] if ref else 1.0
        vs_base = r["generated_tps"] / base["generated_tps"] if base else float("nan")
        ms = [1e3 * _median(r["update_s"]), 1e3 * max(r["update_s"], default=float("nan"))]
        stall = [1e3 * _median(r["stall_s"]), 1e3 * max(r["stall_s"], default=float("nan"))]
        rows.append([
            s.name, r["generated_tps"], f"{ratio:.2f}", f"{vs_base:.2f}", r["kept_tps"],
            f"{kept:.2f}", r["updates"], *ms, *stall, 1e3 * r["longest_gap_s"],
            r["aborted_samples"], r["wasted_tokens"],
        ])  # fmt: skip
    model = MODELS[args.model]
    text = "## LoRA throughput: generation across policy updates, adapter vs full weights\n\n"
    text += info_line(info) + "\n\n"
    text += (
        f"Model {args.model} ({model.num_layers} layers, hidden {model.hidden_size}, float32), "
        f"in-process VLLMEngine; {args.rounds} x {args.seconds:.0f} s per setting (the "
        "settings of an engine taking turns), each after a warm-up; groups of "
        f"{args.group_size} x {args.new_tokens} new tokens (eos ignored), {args.batch} groups "
        f"per step and in flight, one update per step (train time {args.train_s} s); "
        f"adapter rank {RANK} on all seven projections. tok/s: generated (every token sampled) "
        "and kept (in groups handed to the trainer); ratio: vs the same engine without updates; "
        "update ms: `producer.update_weights` as the trainer sees it; stall ms: the longest "
        "gap with no token received that overlaps an update (without updates: around the "
        "moment the trainer got its batch)\n"
    )
    text += print_section(
        "Tokens/s across updates",
        ["setting", "gen tok/s", "ratio", "vs base", "kept tok/s", "kept ratio", "updates",
         "update ms (median)", "update ms (max)", "stall ms (median)", "stall ms (max)",
         "longest gap ms", "aborted samples", "wasted tokens"],
        rows,
    )  # fmt: skip
    config = vars(args) | {"out": str(args.out)}
    payload = {"info": info, "config": config, "pooled": runs, "rounds": rounds}
    save_outputs(args.out, "lora_throughput", _plot(runs, rounds), payload, text)


def _plot(runs: dict[str, dict[str, Any]], rounds: dict[str, list[dict[str, Any]]]) -> Any:
    """One panel per setting: generated tokens/s over time in every round (solid: the first,
    dashed: the next), its updates as vertical lines of the same style."""
    fig, axes = new_figure(len(runs), 1, width=9.0, height=1.7)
    top = max(max(r["bins_tps"], default=0.0) for rs in rounds.values() for r in rs) or 1.0
    for ax, (name, pooled) in zip(axes, runs.items(), strict=True):
        color = COLORS[name]
        for k, r in enumerate(rounds[name]):
            style = "-" if k == 0 else "--"
            ax.plot(np.asarray(r["bins_s"]) + BIN_S / 2, r["bins_tps"], style, color=color)
            for t in r["update_at_s"]:
                ax.axvline(t, color="k", ls=style, lw=0.6, alpha=0.5)
        ax.set_ylim(0, 1.1 * top)
        ax.set_ylabel("tok/s", fontsize=8)
        ax.set_title(
            f"{name}: {pooled['generated_tps']:.0f} tok/s generated, {pooled['kept_tps']:.0f} "
            f"kept, {pooled['updates']} updates",
            fontsize=9, loc="left",
        )  # fmt: skip
    axes[-1].set_xlabel(f"s since the warm-up ({BIN_S:.0f} s bins; vertical lines: updates)")
    fig.suptitle("Generation across a policy update every step: LoRA adapter vs full weights")
    return fig


if __name__ == "__main__":  # vLLM starts its processes with spawn: the guard is required
    sys.exit(main())
