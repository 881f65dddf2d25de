"""Turning what the producer and the trainer hand over into record lines, and writing them.

This runs in the record's writer process (`asyncroll.record.child`): the per-token lists, the
pieces, the JSON and the disk never take the trainer's interpreter lock. `Lines` owns the
open file, the budget on disk, the rotation and the steps waiting for the trainer's metrics;
it is given decoded messages (`asyncroll.record.wire`) one at a time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import numpy as np

from asyncroll.codec import decode, decode_value
from asyncroll.record.format import GroupLine, RunLine, SampleLine, StepLine, TrainLine
from asyncroll.record.wire import (
    STEP_SHARE,
    STEPS_KEPT,
    Batch,
    Counts,
    Drop,
    Message,
    Opening,
    Step,
    Train,
    WriterStats,
)
from asyncroll.types import RolloutGroup


class Lines:
    """The writer's state: the open file, the budget, the pieces, the steps waiting for the
    trainer's metrics. `stats` is what it wrote and left out; `counts` the producer's own
    counters as last sent, which step lines carry beside them."""

    def __init__(self, start: Opening, tokenizer: Any) -> None:
        self.start = start
        self.folder = Path(start.folder)
        self.next_file = start.next_file
        self.stats = WriterStats(bytes=start.bytes_before)
        self.counts = Counts()
        self.tokenizer = tokenizer
        self.piece = _pieces(tokenizer)
        self.file: BinaryIO | None = None
        self.file_bytes = 0
        self.steps: dict[int, tuple[int, float, dict[str, float]]] = {}
        self.version = 0  # of the last batch: a step line of the trainer's numbers alone
        self.encoder = msgspec.json.Encoder()
        kept = start.step_bytes
        self.group_limit = start.max_bytes - (
            start.max_bytes // STEP_SHARE if kept is None else kept
        )

    def write(self, message: Message) -> None:
        if not isinstance(message, Opening):
            self.counts = message.counts
        match message:
            case Opening():
                self.line(msgspec.msgpack.decode(message.run, type=RunLine), step=True)
            case Batch():
                for data in message.groups:
                    self.line(self.group(decode(data), message.step, message.version, None))
                    self.stats.groups += 1
                self.steps[message.step] = (message.version, message.at, message.metrics)
                self.version = message.version
                for old in [s for s in self.steps if s <= message.step - STEPS_KEPT]:
                    self.step_line(old, {})
            case Drop():
                group = decode(message.group)
                self.line(self.group(group, None, message.version, message.reason))
                self.stats.groups += 1
            case Train():
                rows = decode_value(message.rows)
                groups = [decode(data) for data in message.groups]
                for line in self.train(message.step, groups, **rows):
                    self.line(line)
            case Step():
                self.step_line(message.step, message.numbers, at=message.at)

    def step_line(self, step: int, numbers: dict[str, float], at: float | None = None) -> None:
        version, handed, produced = self.steps.pop(step, (self.version, at or time.time(), {}))
        stats = {**msgspec.structs.asdict(self.counts), **msgspec.structs.asdict(self.stats)}
        metrics = {**produced, **numbers, **{f"record/{k}": float(v) for k, v in stats.items()}}
        line = StepLine(
            step=step,
            version=version,
            time_s=(at or handed) - self.start.started,
            # JSON has no NaN or infinity (msgspec writes null, which no float reads back):
            # a metric with no value this step (a mean of nothing) is left out
            metrics={k: v for k, v in metrics.items() if math.isfinite(v)},
        )
        self.line(line, step=True)

    def group(
        self, group: RolloutGroup, step: int | None, version: int, reason: str | None
    ) -> GroupLine:
        piece = self.piece
        samples = []
        for i, s in enumerate(group.samples):
            tokens = s.tokens.tolist()
            samples.append(
                SampleLine(
                    index=i,
                    status=s.status.value,
                    finish_reason=s.finish_reason,
                    reward=s.reward,
                    error=s.error,
                    tokens=tokens,
                    pieces=None if piece is None else [piece(t) for t in tokens],
                    logprobs=s.logprobs.astype(np.float64).tolist(),
                    versions=s.versions.tolist(),
                    loss_mask=None if s.loss_mask is None else s.loss_mask.tolist(),
                    turn_ends=None if s.turn_ends is None else s.turn_ends.tolist(),
                )
            )
        prompt = group.prompt_tokens.tolist()
        return GroupLine(
            uid=group.uid,
            prompt_id=group.prompt_id,
            task=group.task,
            status=group.status.value,
            error=group.error,
            step=step,
            version=version,
            drop_reason=reason,
            start_version=group.start_version,
            attempts=group.attempts,
            latency_s=group.latency_s,
            prompt_tokens=prompt,
            prompt_text=None if self.tokenizer is None else _decode(self.tokenizer, prompt),
            samples=samples,
        )

    def train(
        self,
        step: int,
        groups: list[RolloutGroup],
        logprobs: RowValues,
        advantages: RowValues,
        extra: dict[str, RowValues],
    ) -> list[TrainLine]:
        out = []
        row = 0
        for group in groups:
            p = len(group.prompt_tokens)
            for i, s in enumerate(group.samples):
                n = len(s.tokens)
                trained = None if s.loss_mask is None else s.loss_mask.astype(bool)
                out.append(
                    TrainLine(
                        step=step,
                        uid=group.uid,
                        index=i,
                        logprobs=_tokens_of(logprobs, row, p, n, trained),
                        advantages=_tokens_of(advantages, row, p, n, trained),
                        extra={
                            k: float(np.asarray(v[row]).reshape(-1)[0])
                            for k, v in extra.items()
                            if v is not None
                        },
                    )
                )
                row += 1
        return out

    def line(self, line: Any, *, step: bool = False) -> None:
        """Write one line within the budget, rotating files at `file_bytes`."""
        data = self.encoder.encode(line) + b"\n"
        limit = self.start.max_bytes if step else self.group_limit
        if self.stats.bytes + len(data) > limit:
            self.stats.skipped_budget += 1
            return
        if self.file is None or (
            self.file_bytes and self.file_bytes + len(data) > self.start.file_bytes
        ):
            self.rotate()
        assert self.file is not None
        self.file.write(data)
        self.file_bytes += len(data)
        self.stats.bytes += len(data)

    def rotate(self) -> None:
        self.close()
        path = self.folder / f"rollouts-{self.next_file:06d}.jsonl"
        self.next_file += 1
        self.file = path.open("xb")
        self.file_bytes = 0
        self.stats.files += 1

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def finish(self) -> None:
        """At the end: the steps still waiting for the trainer's metrics, then flush."""
        for step in sorted(self.steps):
            self.step_line(step, {})
        self.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


RowValues = list[np.ndarray] | np.ndarray | None


def _tokens_of(
    values: RowValues, row: int, prompt: int, n: int, trained: np.ndarray | None
) -> list[float | None] | None:
    """Row `row`'s value at each of its `n` response tokens, None where not trained."""
    if values is None:
        return None
    v = values[row]
    if isinstance(values, list):  # `Record.attach` checked that it has n values
        per = v
    elif v.ndim == 0:
        per = np.full(n, float(v))
    else:
        per = v[prompt : prompt + n]
    out: list[float | None] = per.tolist()
    if trained is not None:
        for k in np.flatnonzero(~trained).tolist():
            out[k] = None
    return out


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False))


def _pieces(tokenizer: Any) -> Callable[[int], str] | None:
    """Each token id's piece (its own decode), cached per id: a vocabulary's worth of decodes
    at most, each once."""
    if tokenizer is None:
        return None
    cache: dict[int, str] = {}

    def piece(token: int) -> str:
        text = cache.get(token)
        if text is None:
            text = cache[token] = _decode(tokenizer, [token])
        return text

    return piece
