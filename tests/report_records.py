"""Run records written by hand for the report's tests: the lines of `asyncroll.record.format`,
encoded with msgspec as the record's writer encodes them, so that a test of the report can be
pointed at a real run's folder instead by changing the one line that makes its folder."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from asyncroll.record.format import (
    RECORD_DIR,
    GroupLine,
    Line,
    RunLine,
    SampleLine,
    StepLine,
    TrainLine,
)

PIECES = ["q", " ", "a", "b", "\n", "<tool>", "é", "</", "x", "🙂"]


def _f32(values: np.ndarray) -> list[float]:
    """float32 values widened to float64, as the record holds them."""
    return [float(v) for v in values.astype(np.float32)]


def sample_line(
    rng: np.random.Generator, index: int, n: int, version: int, *, chat: bool
) -> SampleLine:
    """One sample of `n` tokens whose tokens lag up to two versions behind `version`; a chat
    sample has three turns, the middle one an untrained environment reply (loss mask 0)."""
    tokens = rng.integers(0, len(PIECES), n)
    versions = np.sort(rng.integers(max(version - 2, 0), version + 1, n))
    mask, turn_ends = None, None
    if chat:
        a, b = n // 3, 2 * n // 3
        mask = [1] * a + [0] * (b - a) + [1] * (n - b)
        turn_ends = [a, b, n]
    return SampleLine(
        index=index,
        status="completed",
        finish_reason="stop" if index % 2 else "length",
        reward=float(rng.integers(0, 5)) / 4,
        error=None,
        tokens=[int(t) for t in tokens],
        pieces=[PIECES[t] for t in tokens],
        logprobs=_f32(-rng.random(n)),
        versions=[int(v) for v in versions],
        loss_mask=mask,
        turn_ends=turn_ends,
    )


def record_lines(
    *,
    steps: int = 3,
    groups: int = 2,
    samples: int = 2,
    tokens: int = 12,
    first_step: int = 1,
    dropped_every: int = 2,
    seed: int = 0,
) -> list[Line]:
    """A run of `steps` steps of `groups` groups of `samples` samples; odd groups are chat
    episodes. Each step's groups are handed out, then trained (`TrainLine`s with the trainer's
    logprobs, None at untrained tokens), then the step's metrics; every `dropped_every`-th step
    also drops a group (sampled by the record: `step` None, a `drop_reason`)."""
    rng = np.random.default_rng(seed)
    lines: list[Line] = [
        RunLine(started="2026-12-07T06:00:00+00:00", model="tiny", config={"group_size": samples})
    ]
    uid = 0
    for step in range(first_step, first_step + steps):
        version = step - first_step
        handed: list[GroupLine] = []
        for g in range(groups + (1 if dropped_every and step % dropped_every == 0 else 0)):
            dropped = g == groups
            uid += 1
            group = GroupLine(
                uid=uid,
                prompt_id=f"p{uid % 5}-{g}",
                task="chat" if g % 2 else "echo",
                status="failed" if dropped else "completed",
                error="engine: boom" if dropped else None,
                step=None if dropped else step,
                version=version,
                drop_reason="engine_error" if dropped else None,
                start_version=max(version - 1, 0),
                attempts=1,
                latency_s=0.25,
                prompt_tokens=[1, 2, 3],
                prompt_text=f'prompt <{uid}> & "{g}"',
                samples=[
                    sample_line(rng, i, tokens + i, version, chat=bool(g % 2))
                    for i in range(samples)
                ],
            )
            lines.append(group)
            if not dropped:
                handed.append(group)
        for group in handed:
            for s in group.samples:
                mask = s.loss_mask or [1] * len(s.tokens)
                noise = rng.normal(0, 0.05, len(s.tokens))
                advantage = float(np.float32((s.reward or 0) - 0.5))
                lines.append(
                    TrainLine(
                        step=step,
                        uid=group.uid,
                        index=s.index,
                        logprobs=[
                            float(np.float32(lp + d)) if m else None
                            for lp, d, m in zip(s.logprobs, noise, mask, strict=True)
                        ],
                        advantages=[advantage if m else None for m in mask],
                        extra={"ratio_mean": 1.0},
                    )
                )
        rewards = [s.reward for g in handed for s in g.samples if s.reward is not None]
        metrics = {
            "rollout/reward_mean": float(np.mean(rewards)),
            "rollout/staleness_mean": 0.5,
            "rollout/staleness_max": 2.0,
            "rollout/tokens_per_s": 100.0 + step,
            "rollout/wait_ratio": 0.25,
            "rollout/failed_groups_by_reason/engine_error": float(step % dropped_every == 0),
            "rollout/filtered_groups": 0.0,
            "train/loss": 1.0 / step,
        }
        if step % 2:
            metrics["eval/pass@1"] = step / (first_step + steps)
        lines.append(StepLine(step=step, version=version, time_s=step * 1.5, metrics=metrics))
    return lines


def write_record(run_dir: Path, lines: list[Line], *, files: int = 2) -> Path:
    """Write `lines` to `run_dir`'s record as `files` files of consecutive lines (as the writer
    starts a new file when one reaches its size); returns `run_dir`."""
    folder = run_dir / RECORD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    encoder = msgspec.json.Encoder()
    for n, part in enumerate(np.array_split(np.arange(len(lines)), files)):
        path = folder / f"rollouts-{n:06d}.jsonl"
        path.write_bytes(b"".join(encoder.encode(lines[i]) + b"\n" for i in part))
    return run_dir


def make_run(run_dir: Path, **kwargs: int) -> tuple[Path, list[Line]]:
    """A run folder with a record of `record_lines(**kwargs)`, and those lines."""
    lines = record_lines(**kwargs)
    return write_record(run_dir, lines), lines
