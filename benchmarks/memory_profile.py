"""Memory over a long producer run: asyncroll next to a baseline that keeps what it drops.

Why: the upstream trainer that motivated asyncroll kept failed and filtered rollout groups in its
replay buffer forever, so memory grew with every dropped group. This benchmark runs the same
producer, engine and workload twice, each in its own process so their RSS curves cannot
contaminate each other:

- **asyncroll**: the producer as shipped; failed/filtered groups are dropped on arrival.
- **baseline**: the same producer with its buffer swapped for `HoardingBuffer`, a
  `RolloutBuffer` subclass whose `put` also appends every failed or filtered group (the decoded
  `RolloutGroup`, arrays included) to a list that nothing reads. Everything else is identical:
  admission, the byte bound of what is stored, hand-out. It is *kinder* than upstream, which
  held token ids, logprobs and routed experts as Python lists (~9x the bytes of numpy arrays).

The engine is `SimEngine` (a simulation: no model, no language) at zero latency with a
routed-experts-like uint8 payload per sample. Per group a seeded draw on its uid decides the
outcome, identically in both processes: the reward function raises (FAILED, after generation,
so the group carries its full payload), or returns equal rewards so DAPO's `nonzero_std` filter
drops it (FILTERED), or the group is kept. A seeded draw per attempt makes the engine answer
part of the samples with finish reason "abort" (ABORTED: the producer stores the partial group
and resumes it). The trainer takes a batch, "trains" for `--train-s` seconds while the producer
fills the buffer up to its bound, and updates the weights (a pause, a drain, a version bump).

Per step (one `produce_batch`) each process samples RSS, the Python heap (tracemalloc, only
with `--tracemalloc`: on 2 cores it added ~40% to the CPU time of a `--quick` run, and its own
bookkeeping to RSS), the buffer's bytes and groups, the live `RolloutState` objects (a scan of
the garbage collector's objects) and `torch.cuda.memory_allocated` where a CUDA GPU is present.
The slope is a least-squares fit of RSS over groups started, from the end of the warm-up (the
buffer filling up to its bound) to the moment every prompt has started (after it the trainer
only drains the buffer).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import psutil
from _common import (
    DEFAULT_OUT,
    MIB,
    info_line,
    new_figure,
    print_section,
    rss_bytes,
    run_info,
    save_outputs,
    slope,
)
from tqdm import tqdm

from asyncroll import (
    Episode,
    Producer,
    ProducerExhausted,
    PutOutcome,
    RolloutBuffer,
    RolloutGroup,
    RolloutState,
    SamplingConfig,
    SimConfig,
    SimEngine,
)
from asyncroll.engines import GenerateRequest, SampleOutput

VARIANTS = ("asyncroll", "baseline")
PROMPT = list(range(2, 18))  # 16 prompt tokens; only their count matters here
# The peak target: what the buffer may hold plus this much for in-flight groups and the heap.
PEAK_SLACK_MIB = 64


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """Everything both processes must share for the comparison to be fair."""

    groups: int
    group_size: int
    max_new_tokens: int
    payload_bytes: int
    failed: float
    filtered: float
    aborted: float
    batch_size: int
    max_inflight: int
    max_buffer_bytes: int
    train_s: float
    update_every: int
    warmup: float
    max_growth_bytes: int
    min_available_bytes: int
    tracemalloc: bool
    seed: int
    engine: str = "sim"
    turns: int = 1  # > 1: every sample is an episode of this many policy turns (rollout_fn)


TOOL_ANSWER = [5, 6]  # the multi-turn variant's environment tokens after each policy turn


def make_agent(w: Workload) -> Any:
    """The multi-turn variant's rollout function: `turns` policy turns sharing max_new_tokens,
    a 2-token tool answer after each but the last."""
    per_turn = max(1, w.max_new_tokens // w.turns)

    async def agent(episode: Episode) -> None:
        for turn in range(w.turns):
            await episode.generate(max_new_tokens=per_turn)
            if turn + 1 < w.turns:
                episode.append(TOOL_ANSWER)

    return agent


class RewardFailure(RuntimeError):
    """The simulated reward failure (what makes a group FAILED after generation)."""


def _draw(seed: int, key: str) -> float:
    """A uniform draw that depends only on (seed, key), the same in every process."""
    return random.Random(f"{seed}/{key}").random()


def make_reward(w: Workload) -> Callable[[RolloutGroup], list[float]]:
    """Rewards that make a group FAILED, FILTERED (by `nonzero_std`) or kept, by a draw on its
    uid."""

    def reward(group: RolloutGroup) -> list[float]:
        u = _draw(w.seed, f"group/{group.uid}")
        if u < w.failed:
            raise RewardFailure(f"simulated reward failure of group {group.uid}")
        if u < w.failed + w.filtered:
            return [0.0] * group.num_samples  # zero std: DAPO's filter drops it
        return [float(i % 2) for i in range(group.num_samples)]

    return reward


class WorkloadEngine(SimEngine):
    """`SimEngine` whose answers are cut short ("abort") for a seeded share of attempts."""

    def __init__(self, config: SimConfig, *, aborted: float, seed: int) -> None:
        super().__init__(config)
        self.aborted = aborted
        self.seed = seed

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        outputs = await super().generate(request)
        if _draw(self.seed, f"abort/{request.request_id}") < self.aborted:
            return [_cut_short(out) for out in outputs]
        return list(outputs)


def _cut_short(out: SampleOutput) -> SampleOutput:
    """The first half of an answer, as an engine returns a request aborted midway."""
    k = len(out.tokens) // 2
    experts = out.routed_experts
    return msgspec.structs.replace(
        out,
        tokens=out.tokens[:k],
        logprobs=out.logprobs[:k],
        versions=out.versions[:k],
        routed_experts=None if experts is None else experts[:k],
        finish_reason="abort",
    )


class HoardingBuffer(RolloutBuffer):
    """The baseline: the pre-fix behaviour, where failed and filtered groups stay in memory.

    It stores, bounds and hands out exactly what `RolloutBuffer` does; the only difference is
    that `put` appends every FAILED or FILTERED group to `hoard`, which nothing ever reads.
    """

    def __init__(self, like: RolloutBuffer) -> None:
        super().__init__(
            max_groups=like.max_groups,
            max_bytes=like.max_bytes,
            reserve_bytes=like.reserve_bytes,
            max_staleness=like.max_staleness,
            order=like.order,
        )
        self.hoard: list[RolloutGroup] = []

    def put(self, group: RolloutGroup, reserved: int | None = None) -> PutOutcome:
        outcome = super().put(group, reserved)
        if outcome in (PutOutcome.DROPPED_FAILED, PutOutcome.DROPPED_FILTERED):
            self.hoard.append(group)
        return outcome


def build_engine(w: Workload) -> Any:
    """SimEngine with seeded aborts, or real vLLM on the tiny local model (its aborts are real:
    every weight update pauses and aborts what is in flight)."""
    if w.engine == "vllm":
        from asyncroll.app.models import build_tiny_model
        from asyncroll.engines import VLLMEngine

        return VLLMEngine(build_tiny_model(), max_model_len=len(PROMPT) + w.max_new_tokens + 8)
    return WorkloadEngine(
        SimConfig(payload_bytes_per_sample=w.payload_bytes, seed=w.seed),
        aborted=w.aborted,
        seed=w.seed,
    )


def build_producer(w: Workload, variant: str, engine: Any) -> Producer:
    producer = Producer(
        engine,
        (PROMPT for _ in range(w.groups)),
        make_reward(w),
        filter="nonzero_std",
        group_size=w.group_size,
        sampling=SamplingConfig(max_new_tokens=w.max_new_tokens),
        batch_size=w.batch_size,
        max_inflight_groups=w.max_inflight,
        max_buffer_groups=max(1024, 4 * w.batch_size),
        max_buffer_bytes=w.max_buffer_bytes,
        reward_in_thread=False,  # the reward is trivial: a thread hop would cost more than it
        **(
            {
                "rollout_fn": make_agent(w),
                "max_turns": w.turns,
                "max_episode_tokens": w.max_new_tokens + len(TOOL_ANSWER) * (w.turns - 1),
            }
            if w.turns > 1
            else {}
        ),
    )
    if variant == "baseline":
        producer.buffer = HoardingBuffer(producer.buffer)
    return producer


class Probe:
    """Samples one process's memory and the producer's state (one row per step)."""

    def __init__(self, producer: Producer, *, heap: bool) -> None:
        self.producer = producer
        self.heap = heap
        self.t0 = time.monotonic()
        self.cuda = _cuda_allocated()
        self.rows: list[dict[str, Any]] = []

    def sample(self) -> dict[str, Any]:
        c = self.producer.progress.counters
        b = self.producer.buffer.stats()
        row = {
            "t_s": time.monotonic() - self.t0,
            "groups": c.started_groups,
            "consumed": c.consumed_groups,
            "dropped": c.failed_groups + c.filtered_groups,
            "aborted": c.aborted_groups,
            "rss_mib": rss_bytes() / MIB,
            "heap_mib": tracemalloc.get_traced_memory()[0] / MIB if self.heap else None,
            "buffer_mib": b.held_bytes / MIB,
            "buffer_groups": b.ready_groups + b.resume_groups,
            "live_states": _count_states(),
            "cuda_mib": self.cuda() / MIB if self.cuda else None,
        }
        self.rows.append(row)
        return row


def _count_states() -> int:
    """Live `RolloutState` objects (msgspec structs are tracked by the garbage collector).
    One scan costs a few ms per 100,000 objects; it runs once per step."""
    return sum(1 for o in gc.get_objects() if type(o) is RolloutState)


def _cuda_allocated() -> Callable[[], int] | None:
    """`torch.cuda.memory_allocated` when a CUDA GPU is there; torch is imported only then
    (importing it costs ~2 s and ~300 MiB of RSS, which would blur a CPU-only curve)."""
    if "torch" not in sys.modules and not Path("/dev/nvidiactl").exists():
        return None
    import torch

    return torch.cuda.memory_allocated if torch.cuda.is_available() else None


async def run_variant(w: Workload, variant: str) -> dict[str, Any]:
    """One process's run: steps until the prompts are used up or the memory guard trips."""
    engine = build_engine(w)
    try:
        return await _run(w, variant, build_producer(w, variant, engine))
    finally:
        await engine.close()


async def _run(w: Workload, variant: str, producer: Producer) -> dict[str, Any]:
    gc.collect()
    probe = Probe(producer, heap=w.tracemalloc)
    start = probe.sample()
    stopped_by = None
    wall0 = time.monotonic()
    async with producer:
        with tqdm(total=w.groups, desc=variant, unit="group", leave=False) as bar:
            step = 0
            while stopped_by is None:
                try:
                    result = await producer.produce_batch(w.batch_size)
                except ProducerExhausted:
                    break
                step += 1
                await asyncio.sleep(w.train_s)  # "training": the producer fills the buffer
                del result  # the trainer is done with the batch once it has trained on it
                if w.update_every and step % w.update_every == 0:
                    await producer.update_weights()
                producer.check_ledger()
                row = probe.sample()
                bar.update(row["groups"] - bar.n)
                stopped_by = _guard(w, row["rss_mib"] - start["rss_mib"])
    return {
        "variant": variant,
        "rows": probe.rows,
        "wall_s": time.monotonic() - wall0,
        "stopped_by": stopped_by,
        "max_buffer_bytes": producer.buffer.max_bytes,
        "totals": msgspec.to_builtins(producer.progress.counters),
    }


def _guard(w: Workload, growth_mib: float) -> str | None:
    """Why to stop early (to protect the machine), or None."""
    if growth_mib * MIB > w.max_growth_bytes:
        return f"memory guard: RSS grew more than {w.max_growth_bytes / MIB:,.0f} MiB"
    available = psutil.virtual_memory().available
    if available < w.min_available_bytes:
        return f"memory guard: only {available / MIB:,.0f} MiB of memory left available"
    return None


def summarize(run: dict[str, Any], w: Workload) -> dict[str, Any]:
    rows = run["rows"]
    rss = [r["rss_mib"] for r in rows]
    steady = _steady(rows, w)
    per_k = [r["groups"] / 1000 for r in steady]
    return {
        "variant": run["variant"],
        "groups": rows[-1]["groups"],
        "start_mib": rss[0],
        "peak_mib": max(rss),
        "end_mib": rss[-1],
        "slope_mib_per_1k": slope(per_k, [r["rss_mib"] for r in steady]),
        "states_end": rows[-1]["live_states"],
        "heap_end_mib": rows[-1]["heap_mib"],
        "buffer_peak_mib": max(r["buffer_mib"] for r in rows),
        "wall_s": run["wall_s"],
        "aborted_groups": run["totals"]["aborted_groups"],
        "stopped_by": run["stopped_by"] or "no",
    }


def _steady(rows: list[dict[str, Any]], w: Workload) -> list[dict[str, Any]]:
    """The rows the slope is fitted on: after the warm-up (the buffer filling up to its bound)
    and up to the first row where every prompt has started (after it the trainer only drains
    the buffer, which would read as a falling slope)."""
    total = rows[-1]["groups"]
    end = next((i for i, r in enumerate(rows) if r["groups"] >= total), len(rows) - 1)
    return [r for r in rows[: end + 1] if r["groups"] >= w.warmup * total]


SUMMARY_COLUMNS = {
    "variant": "variant",
    "groups": "groups",
    "start_mib": "start",
    "peak_mib": "peak",
    "end_mib": "end",
    "slope_mib_per_1k": "slope MiB/1k",
    "states_end": "live states end",
    "heap_end_mib": "heap end",
    "buffer_peak_mib": "buffer peak",
    "wall_s": "wall s",
    "stopped_by": "stopped early",
}


def _engine_label(w: Workload) -> str:
    if w.engine == "vllm":
        return "real vLLM generation, tiny local model"
    return "SimEngine simulation, not generation"


def report(w: Workload, runs: list[dict[str, Any]], out_dir: Path) -> dict[str, Any]:
    info = run_info()
    sums = {r["variant"]: summarize(r, w) for r in runs}
    ours, base = sums["asyncroll"], sums["baseline"]
    ratio = ours["slope_mib_per_1k"] / base["slope_mib_per_1k"]
    bound = ours["start_mib"] + w.max_buffer_bytes / MIB + PEAK_SLACK_MIB
    text = f"## Memory profile ({_engine_label(w)})\n\n{info_line(info)}\n\n"
    text += _workload_line(w) + "\n"
    text += print_section(
        "RSS per variant (MiB; slope fitted after the warm-up, per 1,000 groups started)",
        list(SUMMARY_COLUMNS.values()),
        [[_or_na(s[key]) for key in SUMMARY_COLUMNS] for s in sums.values()],
    )
    peak_target = f"<= start + max_bytes + {PEAK_SLACK_MIB} = {bound:,.0f}"
    text += print_section(
        "Targets",
        ["figure", "measured", "target", "met"],
        [
            ["slope asyncroll / baseline", f"{ratio * 100:.2g}%", "<= 1%", _yes(ratio <= 0.01)],
            ["peak RSS asyncroll (MiB)", f"{ours['peak_mib']:,.0f}", peak_target,
             _yes(ours["peak_mib"] <= bound)],
        ],
    )  # fmt: skip
    payload = {
        "info": info,
        "workload": msgspec.to_builtins(w),
        "summary": sums,
        "slope_ratio": ratio,
        "peak_bound_mib": bound,
        "runs": runs,
    }
    save_outputs(out_dir, "memory_profile", plot(runs, w, bound, info), payload, text)
    return payload


def _workload_line(w: Workload) -> str:
    return (
        f"Workload: {w.groups:,} groups of {w.group_size} x {w.max_new_tokens} tokens, "
        f"{w.payload_bytes / 1024:,.0f} KiB payload per sample; failed {w.failed:.0%}, "
        f"filtered {w.filtered:.0%}, aborted {w.aborted:.0%} of attempts; batch {w.batch_size}, "
        f"buffer max {w.max_buffer_bytes / MIB:,.0f} MiB, train {w.train_s * 1000:.0f} ms/step, "
        f"tracemalloc {'on' if w.tracemalloc else 'off'}"
        + (f"; {w.turns}-turn episodes (no payload: episodes do not carry it)." if w.turns > 1
           else ".")
    )  # fmt: skip


def _or_na(value: Any) -> Any:
    return "n/a" if value is None else value


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def plot(runs: list[dict[str, Any]], w: Workload, bound: float, info: dict[str, Any]) -> Any:
    fig, (ax_rss, ax_ours, ax_states) = new_figure(1, 3, width=5.2)
    for run in runs:
        rows = run["rows"]
        x = [r["groups"] for r in rows]
        line = ax_rss.plot(x, [r["rss_mib"] for r in rows], label=f"{run['variant']} RSS")[0]
        if w.tracemalloc:
            heap = [r["heap_mib"] for r in rows]
            ax_rss.plot(x, heap, "--", color=line.get_color(), label=f"{run['variant']} heap")
        ax_states.plot(x, [r["live_states"] for r in rows], label=run["variant"])
        if run["variant"] == "asyncroll":
            _plot_close_up(ax_ours, rows, bound, line.get_color())
    ax_rss.axhline(bound, color="grey", linestyle=":", label="asyncroll bound")
    ax_rss.set(xlabel="groups started", ylabel="MiB", title="Process memory")
    ax_states.set(xlabel="groups started", ylabel="objects", title="Live RolloutState objects")
    ax_states.set_yscale("symlog")
    for ax in (ax_rss, ax_ours, ax_states):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"asyncroll vs a baseline that keeps failed/filtered groups ({_engine_label(w)})\n"
        f"{w.groups:,} groups, {w.failed + w.filtered:.0%} dropped, "
        f"{w.payload_bytes / 1024:,.0f} KiB/sample · {info['date']} · {info['commit']}",
        fontsize=9,
    )
    return fig


def _plot_close_up(ax: Any, rows: list[dict[str, Any]], bound: float, color: str) -> None:
    """asyncroll alone, at a scale where a slope would show: RSS next to what the buffer holds."""
    x = [r["groups"] for r in rows]
    ax.plot(x, [r["rss_mib"] for r in rows], color=color, label="RSS")
    ax.plot(x, [r["buffer_mib"] for r in rows], color=color, alpha=0.5, label="buffer holds")
    ax.axhline(bound, color="grey", linestyle=":", label="bound: start + max_bytes + 64 MiB")
    ax.set(xlabel="groups started", ylabel="MiB", title="asyncroll close-up", ylim=(0, None))


def run_children(w: Workload, variants: Sequence[str]) -> list[dict[str, Any]]:
    """Run each variant in a fresh interpreter, one after the other (2 cores: no overlap)."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="asyncroll-mem-") as tmp:
        spec = Path(tmp) / "workload.json"
        spec.write_bytes(msgspec.json.encode(w))
        for variant in variants:
            out = Path(tmp) / f"{variant}.json"
            cmd = [sys.executable, __file__, "--child", variant, str(spec), str(out)]
            subprocess.run(cmd, check=True)
            runs.append(json.loads(out.read_text()))
    return runs


def child(variant: str, spec: Path, out: Path) -> None:
    w = msgspec.json.decode(spec.read_bytes(), type=Workload)
    if w.tracemalloc:
        tracemalloc.start(1)
    out.write_text(json.dumps(asyncio.run(run_variant(w, variant))))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small run for CI (< 1 min on 2 cores)")
    p.add_argument("--groups", type=int, help="groups to start (default 20,000; quick 3,000)")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, help="default 512 (vllm: 64)")
    p.add_argument("--payload-kib", type=float, default=256, help="routed-experts-like bytes")
    p.add_argument("--failed", type=float, default=0.1, help="share of groups whose reward fails")
    p.add_argument("--filtered", type=float, default=0.6, help="share dropped by nonzero_std")
    p.add_argument("--aborted", type=float, default=0.05, help="share of attempts cut short")
    p.add_argument("--batch-size", type=int, help="groups per step (default 32; quick 8)")
    p.add_argument("--max-inflight", type=int, default=64)
    p.add_argument("--max-buffer-mib", type=float, help="buffer bound (256; quick 64)")
    p.add_argument("--train-s", type=float, help="seconds per training step (0.1; quick 0.02)")
    p.add_argument("--update-every", type=int, default=1, help="steps per weight update (0: none)")
    p.add_argument("--warmup", type=float, default=0.2, help="share of the run before the fit")
    p.add_argument("--max-growth-gib", type=float, default=12, help="memory guard: RSS growth")
    p.add_argument("--min-available-gib", type=float, default=3, help="memory guard: free RAM")
    p.add_argument("--tracemalloc", action="store_true", help="also sample the Python heap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    p.add_argument("--turns", type=int, default=1, help="> 1: multi-turn episodes (rollout_fn)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for PNG/JSON/MD")
    p.add_argument("--child", nargs=3, metavar=("VARIANT", "SPEC", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def workload(args: argparse.Namespace) -> Workload:
    quick, vllm = args.quick, args.engine == "vllm"
    # vLLM on 2 CPU cores makes ~10k tokens/s: fewer, shorter groups, no simulated payload
    default_groups = (300 if quick else 2000) if vllm else (3000 if quick else 20000)
    w = Workload(
        groups=args.groups or default_groups,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens or (64 if vllm else 512),
        payload_bytes=0 if vllm or args.turns > 1 else int(args.payload_kib * 1024),
        failed=args.failed,
        filtered=args.filtered,
        aborted=0.0 if vllm else args.aborted,
        batch_size=args.batch_size or (8 if quick else 32),
        max_inflight=args.max_inflight,
        max_buffer_bytes=int((args.max_buffer_mib or (64 if quick else 256)) * MIB),
        train_s=args.train_s if args.train_s is not None else (0.02 if quick else 0.1),
        update_every=args.update_every,
        warmup=args.warmup,
        max_growth_bytes=int(args.max_growth_gib * (1 << 30)),
        min_available_bytes=int(args.min_available_gib * (1 << 30)),
        tracemalloc=args.tracemalloc,
        seed=args.seed,
        engine=args.engine,
        turns=args.turns,
    )
    if w.turns < 1:
        raise SystemExit("--turns must be >= 1")
    if w.group_size < 2:
        raise SystemExit("--group-size must be >= 2: the nonzero_std filter needs two rewards")
    if not (w.failed >= 0 and w.filtered >= 0 and w.failed + w.filtered <= 1):
        raise SystemExit("--failed and --filtered must be shares that add up to at most 1")
    return w


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        variant, spec, out = args.child
        child(variant, Path(spec), Path(out))
        return 0
    w = workload(args)
    report(w, run_children(w, VARIANTS), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
