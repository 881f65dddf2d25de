"""What `asyncroll demo` records and reports: one `StepRecord` per training step and one
`EvalRecord` per evaluation (appended to metrics.jsonl and eval.jsonl as they happen), the
progress bar's postfix, and at the end summary.txt and demo.png. The run loop
(`asyncroll.app.demo`) builds them; nothing here runs the model."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import psutil

from asyncroll import ProduceBatchResult


class StepRecord(msgspec.Struct, kw_only=True):
    """What the demo logs per training step (also written to metrics.jsonl)."""

    step: int
    version: int
    reward: float
    train_s: float
    wait_s: float
    wall_s: float
    tokens_per_s: float
    failed_groups: int
    filtered_groups: int
    expired_groups: int
    rss_mib: float
    loss: float
    staleness_mean: float
    idle_s: float  # time with no group in flight since the previous step
    offpolicy: dict[str, float]  # asyncroll.train.loss.mismatch_metrics of the step's batch
    tokens: int = 0  # response tokens of the batch (what the step trained on)
    # the task's own view of the batch (tool_echo: `asyncroll.app.demo_tool.step_metrics`) and the
    # policy's mean entropy at the trained tokens ("entropy")
    task_metrics: dict[str, float] = msgspec.field(default_factory=dict)


class EvalRecord(msgspec.Struct, kw_only=True):
    """One evaluation on the held-out set (also written to eval.jsonl): after `step` training
    steps, at policy `version`; `accuracy` is its pass@1 (greedy), `train_wall_s` the training
    loop's wall time so far (evaluations included)."""

    step: int
    version: int | None
    accuracy: float
    reward: float
    eval_s: float
    train_wall_s: float
    metrics: dict[str, float]


def tree_rss_mib() -> float:
    """RSS of this process and its children (vLLM runs its engine core and worker there)."""
    me = psutil.Process()
    total: int = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def eval_record(step: int, result: Any, train_wall_s: float) -> EvalRecord:
    metrics = result.metrics()
    return EvalRecord(
        step=step,
        version=result.version,
        accuracy=metrics["eval/pass@1"],
        reward=metrics["eval/reward_mean"],
        eval_s=result.wall_s,
        train_wall_s=train_wall_s,
        metrics=metrics,
    )


def eval_line(e: EvalRecord, error: str | None) -> str:
    line = (
        f"eval after step {e.step} (version {e.version}): accuracy {e.accuracy:.3f}, "
        f"reward {e.reward:.3f} ({e.eval_s:.1f} s)"
    )
    return line if error is None else f"{line}; ended early: {error}"


def step_record(
    step: int,
    batch: ProduceBatchResult,
    loss: float,
    offpolicy: dict[str, float],
    train_s: float,
    waited: float,
    start: float,
) -> StepRecord:
    m = batch.metrics()
    return StepRecord(
        step=step,
        version=batch.version,
        reward=_population_reward(batch),
        train_s=train_s,
        wait_s=waited,
        wall_s=time.perf_counter() - start,
        tokens_per_s=m["rollout/tokens_per_s"],
        failed_groups=int(batch.totals.failed_groups),
        filtered_groups=int(batch.totals.filtered_groups),
        expired_groups=int(batch.totals.expired_groups),
        rss_mib=tree_rss_mib(),
        loss=loss,
        staleness_mean=m["rollout/staleness_mean"],
        idle_s=batch.delta.idle_s,
        offpolicy=offpolicy,
        tokens=sum(s.num_tokens for g in batch.groups for s in g.samples),
    )


def step_numbers(r: StepRecord) -> dict[str, float]:
    """The trainer's side of a step for the run record's step line (the producer's metrics of
    the batch are the record's own): loss, times, the waiting share, memory, the mismatch and
    the task's metrics."""
    return {
        "train/loss": r.loss,
        "train/s": r.train_s,
        "train/wait_s": r.wait_s,
        "train/wall_s": r.wall_s,
        "train/wait_ratio": r.wait_s / r.wall_s if r.wall_s else 0.0,
        "train/reward": r.reward,
        "train/rss_mib": r.rss_mib,
        **r.offpolicy,
        **{f"task/{k}": v for k, v in r.task_metrics.items()},
    }


def eval_numbers(e: EvalRecord) -> dict[str, float]:
    """An evaluation's numbers for the run record's step line of the step it followed."""
    return {**e.metrics, "eval/s": e.eval_s}


def _population_reward(batch: ProduceBatchResult) -> float:
    """Mean reward of every sample scored since the previous batch, before the filter drops
    zero-variance groups (the kept groups alone would overstate it); the batch's own mean if
    nothing new was scored."""
    d = batch.delta
    if d.reward_count:
        return d.reward_sum / d.reward_count
    return float(np.mean([s.reward for g in batch.groups for s in g.samples]))


def postfix(r: StepRecord) -> dict[str, Any]:
    return {
        "reward": f"{r.reward:.3f}",
        "tok/s": f"{r.tokens_per_s:.0f}",
        "filtered": r.filtered_groups,
        "failed": r.failed_groups,
        "expired": r.expired_groups,
        "rss": f"{r.rss_mib / 1024:.2f}G",
        "kl": f"{r.offpolicy.get('offpolicy/kl', 0.0):.2g}",
    }


def log_record(out: Path, record: StepRecord | EvalRecord, name: str = "metrics.jsonl") -> None:
    with (out / name).open("ab") as f:
        f.write(msgspec.json.encode(record) + b"\n")


def summarise(
    out: Path,
    records: list[StepRecord],
    counters: Any,
    staleness: Counter[int],
    task: str,
    evals: list[EvalRecord],
    report: Path | None = None,
) -> str:
    """The run's summary table (written to summary.txt, with the plot to demo.png; empty
    when no step ran): the demo prints it."""
    if not records:
        return ""
    k = max(1, len(records) // 5)
    first = float(np.mean([r.reward for r in records[:k]]))
    last = float(np.mean([r.reward for r in records[-k:]]))
    rows = [
        ("steps", len(records)),
        (f"reward, first {k} steps", f"{first:.3f}"),
        (f"reward, last {k} steps", f"{last:.3f}"),
        ("groups consumed / filtered / failed / expired",
         f"{counters.consumed_groups} / {counters.filtered_groups} / "
         f"{counters.failed_groups} / {counters.expired_groups}"),
        ("wall s per step (median)", f"{np.median([r.wall_s for r in records]):.2f}"),
        ("train s per step (median)", f"{np.median([r.train_s for r in records]):.2f}"),
        ("trainer waiting for rollouts",
         f"{sum(r.wait_s for r in records) / sum(r.wall_s for r in records):.0%}"),
        ("peak RSS of process tree", f"{max(r.rss_mib for r in records) / 1024:.2f} GiB"),
        ("trained tokens by staleness", _shares(staleness)),
        ("KL(behaviour || trainer) by staleness", _mean_kl(records)),
    ]  # fmt: skip
    if counters.episodes:
        rows.append((
            "policy / environment tokens, turns per episode",
            f"{counters.policy_tokens} / {counters.environment_tokens}, "
            f"{(counters.policy_turns + counters.environment_turns) / counters.episodes:.1f}",
        ))  # fmt: skip
    if evals:
        rows += [
            ("held-out accuracy, first / last evaluation",
             f"{evals[0].accuracy:.3f} (step {evals[0].step}) / {evals[-1].accuracy:.3f} "
             f"(step {evals[-1].step})"),
            ("evaluations, s each (median)",
             f"{len(evals)}, {np.median([e.eval_s for e in evals]):.2f}"),
            ("training loop wall s (evaluations included)", f"{evals[-1].train_wall_s:.0f}"),
        ]  # fmt: skip
    rows.append(("run record", str(out / "record")))
    if report is not None:
        rows.append(("report (open in a browser)", str(report)))
    width = max(len(str(r[0])) for r in rows)
    text = "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
    (out / "summary.txt").write_text(text + "\n")
    _plot(out / "demo.png", records, task, evals)
    return text


def _shares(counts: Counter[int]) -> str:
    total = sum(counts.values()) or 1
    return ", ".join(f"{k}: {v / total:.0%}" for k, v in sorted(counts.items()))


def _mean_kl(records: list[StepRecord]) -> str:
    """Mean over steps of each staleness' KL estimate: how far the tokens' sampler was from the
    trainer's policy, which the correction has to make up for."""
    per: dict[int, list[float]] = {}
    for r in records:
        for key, value in r.offpolicy.items():
            name, _, stat = key.removeprefix("offpolicy/staleness_").partition("/")
            if stat == "kl" and name.isdigit():
                per.setdefault(int(name), []).append(value)
    return ", ".join(f"{k}: {np.mean(v):.2g}" for k, v in sorted(per.items()))


def _plot(path: Path, records: list[StepRecord], task: str, evals: list[EvalRecord]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    axes[0].plot(steps, [r.reward for r in records], label="training reward")
    if evals:
        axes[0].plot(
            [e.step for e in evals], [e.accuracy for e in evals], "o-", label="held-out accuracy"
        )
        axes[0].legend()
    axes[0].set(title=f"reward ({task} task)", xlabel="step", ylim=(0, 1))
    for name in ("filtered_groups", "failed_groups", "expired_groups"):
        axes[1].plot(steps, [getattr(r, name) for r in records], label=name)
    axes[1].set(title="dropped groups (cumulative)", xlabel="step")
    axes[1].legend()
    axes[2].plot(steps, [r.rss_mib / 1024 for r in records])
    axes[2].set(title="RSS of process tree (GiB)", xlabel="step", ylim=(0, None))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
