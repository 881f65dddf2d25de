"""The report's data from a run's record: one pass over `read_record`, into what the page
needs at once (the run's header, every step's metrics, an index of every group for the step
table and the search) and what it loads on demand (the groups' tokens, one chunk of steps per
file).

A chunk holds the groups handed out for steps `[k * steps_per_chunk, (k + 1) *
steps_per_chunk)`, the dropped groups recorded while those steps ran (a dropped group has no
step: it belongs to the last step written before it, its `near` step) and the trainer's lines
for those groups. Each group is encoded once, as it is read, so that the build holds the
report's bytes and no decoded record.

Float arrays are written as base64 of their little-endian float32 bytes ("f4:...") when every
value is a float32 (the record's floats are float32 values widened, so this is exact and a
quarter of their decimal text), else of float64 ("f8:..."); None is NaN in them (JSON holds no
NaN, so a record cannot tell the two apart either). `decode_floats` reads one back.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from asyncroll.record.format import (
    GroupLine,
    RecordError,
    RunLine,
    SampleLine,
    StepLine,
    TrainLine,
    read_record,
)

STEPS_PER_CHUNK = 10

_encoder = msgspec.json.Encoder()


def encode_floats(values: Sequence[float | None] | None) -> str | None:
    """A float array as "f4:<base64>" (exact float32) or "f8:<base64>"; None stays None."""
    if values is None:
        return None
    wide = np.array(values, dtype="<f8")  # None -> NaN
    narrow = wide.astype("<f4")
    if np.array_equal(narrow.astype("<f8"), wide, equal_nan=True):
        return "f4:" + base64.b64encode(narrow.tobytes()).decode()
    return "f8:" + base64.b64encode(wide.tobytes()).decode()


def decode_floats(text: str | None) -> list[float | None] | None:
    """The values `encode_floats` wrote, NaN as None (what the page's JavaScript reads)."""
    if text is None:
        return None
    kind, _, payload = text.partition(":")
    array = np.frombuffer(base64.b64decode(payload), dtype="<f4" if kind == "f4" else "<f8")
    return [None if np.isnan(v) else float(v) for v in array]


class ReportSample(msgspec.Struct, kw_only=True):
    """A sample as the page reads it: `SampleLine` with its logprobs encoded."""

    index: int
    status: str
    finish_reason: str | None
    reward: float | None
    error: str | None
    tokens: list[int]
    pieces: list[str] | None
    logprobs: str | None
    versions: list[int]
    loss_mask: list[int] | None
    turn_ends: list[int] | None


class ReportTrain(msgspec.Struct, kw_only=True):
    """A `TrainLine` as the page reads it, its arrays encoded."""

    step: int
    uid: int
    index: int
    logprobs: str | None
    advantages: str | None
    extra: dict[str, Any]


class ReportGroup(msgspec.Struct, kw_only=True):
    """A `GroupLine` as the page reads it; `near` is the step it belongs to in the report (its
    own, or for a dropped group the last step written before it)."""

    uid: int
    prompt_id: str
    task: str
    status: str
    error: str | None
    step: int | None
    near: int
    version: int
    drop_reason: str | None
    start_version: int
    attempts: int
    latency_s: float
    prompt_tokens: list[int]
    prompt_text: str | None
    samples: list[ReportSample]


class GroupIndex(msgspec.Struct, kw_only=True):
    """Every group of the run, one entry per list (columns, so that the page's index is small):
    what the step table and the search read without loading a chunk."""

    uid: list[int] = msgspec.field(default_factory=list)
    prompt_id: list[str] = msgspec.field(default_factory=list)
    task: list[str] = msgspec.field(default_factory=list)
    status: list[str] = msgspec.field(default_factory=list)
    step: list[int | None] = msgspec.field(default_factory=list)
    near: list[int] = msgspec.field(default_factory=list)
    drop_reason: list[str | None] = msgspec.field(default_factory=list)
    chunk: list[int] = msgspec.field(default_factory=list)
    rewards: list[list[float | None]] = msgspec.field(default_factory=list)
    tokens: list[int] = msgspec.field(default_factory=list)
    prompt: list[str | None] = msgspec.field(default_factory=list)  # the prompt's first chars


class Steps(msgspec.Struct, kw_only=True):
    """Every step's `StepLine` as columns; `metrics[key][i]` is None where step i lacks it."""

    step: list[int] = msgspec.field(default_factory=list)
    version: list[int] = msgspec.field(default_factory=list)
    time_s: list[float] = msgspec.field(default_factory=list)
    metrics: dict[str, list[float | None]] = msgspec.field(default_factory=dict)


class ChunkInfo(msgspec.Struct, kw_only=True):
    """One data file of the report: which steps it covers and what it holds."""

    chunk: int
    file: str
    first_step: int
    last_step: int
    groups: int
    bytes: int = 0


class RunSummary(msgspec.Struct, kw_only=True):
    """What the page loads first (data/run.js)."""

    run_dir: str
    runs: list[RunLine]
    steps_per_chunk: int
    steps: Steps
    groups: GroupIndex
    chunks: list[ChunkInfo] = msgspec.field(default_factory=list)
    lines: int = 0


PROMPT_PREVIEW = 160


class ReportData:
    """The report's data of one record: `summary` and, per chunk, its groups' and trainer
    lines' encoded bytes (`chunk_parts`)."""

    def __init__(self, run_dir: str | os.PathLike[str], steps_per_chunk: int) -> None:
        if steps_per_chunk < 1:
            raise ValueError(f"steps_per_chunk must be at least 1, not {steps_per_chunk}")
        self.steps_per_chunk = steps_per_chunk
        self.summary = RunSummary(
            run_dir=str(run_dir),
            runs=[],
            steps_per_chunk=steps_per_chunk,
            steps=Steps(),
            groups=GroupIndex(),
        )
        self.groups: dict[int, list[bytes]] = {}
        self.train: dict[int, list[bytes]] = {}
        # the step of each entry of `groups` (a dropped group's `near`) and of `train`, per
        # chunk: what a resumed run's `RunLine` supersedes is found by them
        self._group_steps: dict[int, list[int]] = {}
        self._train_steps: dict[int, list[int]] = {}
        self._chunk_of_uid: dict[int, int] = {}
        self._last_step: int | None = None
        self._step_rows: dict[int, StepLine] = {}

    def chunk_of(self, step: int) -> int:
        return step // self.steps_per_chunk

    def add_run(self, line: RunLine) -> None:
        self.summary.runs.append(line)
        if line.first_step is not None:
            self._supersede(line.first_step)

    def _supersede(self, first_step: int) -> None:
        """A resumed run starts at `first_step`: what the record holds of that step and later
        ones (the run that died after its checkpoint ran them too) goes, in every chunk and
        in the index; the resumed run's lines take their place."""
        first_chunk = self.chunk_of(first_step)
        _keep_before(first_step, first_chunk, self.groups, self._group_steps)
        _keep_before(first_step, first_chunk, self.train, self._train_steps)
        g = self.summary.groups
        kept = [i for i, n in enumerate(g.near) if n < first_step]
        if len(kept) < len(g.near):
            for field in g.__struct_fields__:
                column = getattr(g, field)
                setattr(g, field, [column[i] for i in kept])
        for step in [s for s in self._step_rows if s >= first_step]:
            del self._step_rows[step]
        if self._last_step is not None:
            self._last_step = min(self._last_step, first_step - 1)

    def add_group(self, line: GroupLine) -> None:
        if line.step is not None:
            self._last_step = line.step
        near = line.step if line.step is not None else (self._last_step or 0)
        chunk = self.chunk_of(near)
        self._chunk_of_uid[line.uid] = chunk
        group = ReportGroup(
            uid=line.uid,
            prompt_id=line.prompt_id,
            task=line.task,
            status=line.status,
            error=line.error,
            step=line.step,
            near=near,
            version=line.version,
            drop_reason=line.drop_reason,
            start_version=line.start_version,
            attempts=line.attempts,
            latency_s=line.latency_s,
            prompt_tokens=line.prompt_tokens,
            prompt_text=line.prompt_text,
            samples=[_sample(s) for s in line.samples],
        )
        self.groups.setdefault(chunk, []).append(_encoder.encode(group))
        self._group_steps.setdefault(chunk, []).append(near)
        g = self.summary.groups
        g.uid.append(line.uid)
        g.prompt_id.append(line.prompt_id)
        g.task.append(line.task)
        g.status.append(line.status)
        g.step.append(line.step)
        g.near.append(near)
        g.drop_reason.append(line.drop_reason)
        g.chunk.append(chunk)
        g.rewards.append([s.reward for s in line.samples])
        g.tokens.append(sum(len(s.tokens) for s in line.samples))
        g.prompt.append(None if line.prompt_text is None else line.prompt_text[:PROMPT_PREVIEW])

    def add_train(self, line: TrainLine) -> None:
        chunk = self._chunk_of_uid.get(line.uid, self.chunk_of(line.step))
        train = ReportTrain(
            step=line.step,
            uid=line.uid,
            index=line.index,
            logprobs=encode_floats(line.logprobs),
            advantages=encode_floats(line.advantages),
            extra=line.extra,
        )
        self.train.setdefault(chunk, []).append(_encoder.encode(train))
        self._train_steps.setdefault(chunk, []).append(line.step)

    def add_step(self, line: StepLine) -> None:
        self._last_step = line.step
        self._step_rows[line.step] = line  # a step written twice (no `first_step`): the later

    def finish(self) -> RunSummary:
        """The summary with the steps in order, as columns."""
        steps = self.summary.steps
        rows = [self._step_rows[k] for k in sorted(self._step_rows)]
        keys = sorted({key for row in rows for key in row.metrics})
        steps.step = [r.step for r in rows]
        steps.version = [r.version for r in rows]
        steps.time_s = [r.time_s for r in rows]
        steps.metrics = {key: [r.metrics.get(key) for r in rows] for key in keys}
        return self.summary


def _keep_before(
    first_step: int, first_chunk: int, parts: dict[int, list[bytes]], steps: dict[int, list[int]]
) -> None:
    """Keep, in the chunks from `first_chunk` on, the encoded entries whose step (`steps`,
    parallel to `parts`) is before `first_step`; a chunk left empty goes."""
    for chunk in [c for c in parts if c >= first_chunk]:
        kept = [i for i, n in enumerate(steps[chunk]) if n < first_step]
        if kept:
            parts[chunk] = [parts[chunk][i] for i in kept]
            steps[chunk] = [steps[chunk][i] for i in kept]
        else:
            del parts[chunk], steps[chunk]


def _sample(s: SampleLine) -> ReportSample:
    return ReportSample(
        index=s.index,
        status=s.status,
        finish_reason=s.finish_reason,
        reward=s.reward,
        error=s.error,
        tokens=s.tokens,
        pieces=s.pieces,
        logprobs=encode_floats(s.logprobs),
        versions=s.versions,
        loss_mask=s.loss_mask,
        turn_ends=s.turn_ends,
    )


def read_report_data(
    run_dir: str | os.PathLike[str], steps_per_chunk: int = STEPS_PER_CHUNK
) -> ReportData:
    """One pass over the run's record (`RecordError` when it has none or no line of it
    decodes)."""
    data = ReportData(run_dir, steps_per_chunk)
    for line in read_record(run_dir):
        data.summary.lines += 1
        if isinstance(line, GroupLine):
            data.add_group(line)
        elif isinstance(line, TrainLine):
            data.add_train(line)
        elif isinstance(line, StepLine):
            data.add_step(line)
        else:
            data.add_run(line)
    if not data.summary.lines:
        raise RecordError(f"the record in {Path(run_dir)} holds no lines: nothing to report")
    data.finish()
    return data
