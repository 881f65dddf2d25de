"""The run record's lines: what a run writes about its rollouts, and what the report reads.

One JSON object per line (JSON Lines, `kind` names the line's type), in files
`<run>/record/rollouts-NNNNNN.jsonl` that the writer starts one after another as each reaches
its size. JSON Lines because every tool a user has reads it (`jq`, `pandas.read_json(...,
lines=True)`, `duckdb`, a text editor) and because msgspec writes it at a few hundred MB/s with
no new dependency; Parquet would need pyarrow, and the codec's binary is only readable by
asyncroll. The per-token fields are parallel lists, one entry per response token, in the same
order as the `RolloutState` arrays they copy, so a sample is one line and reading one sample
never needs another file. Floats are the float32 values widened to float64, which JSON holds
exactly: `np.float32(x)` of a read value is bit for bit the value that was written.

Lines of one run, in the order they are written:

* `RunLine` first, once per writer start (a resumed run appends a second one, whose
  `first_step` supersedes what the record holds of that step and later ones: the run that
  died after its checkpoint ran them, the resumed one runs them again);
* `GroupLine` for each group handed out (`step` is the trainer step it was handed out for), and
  for a sample of the dropped ones (`step` None, `drop_reason` set);
* `TrainLine` for what the trainer attaches to a handed-out sample (its logprobs, advantages);
* `StepLine` once per step with that step's metrics (the producer's and the trainer's).

`read_record(run_dir)` yields every line of every file in order, decoded into these structs.
A reader of a resumed run drops, at each `RunLine` with a `first_step`, the lines read so far
of that step and later: the groups handed out for them, the trainer's lines and the step lines
(the report does, counting a dropped group as of the last step written before it).
`FORMAT` rises when a field changes meaning; readers refuse a newer one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

FORMAT = 1
RECORD_DIR = "record"
FILE_GLOB = "rollouts-*.jsonl"


class _Line(msgspec.Struct, tag_field="kind", kw_only=True):
    """A record line: its `kind` field says which of the four it is."""


class RunLine(_Line, tag="run", kw_only=True):
    """The record's header: which format, when, and what produced the tokens."""

    format: int = FORMAT
    started: str  # ISO 8601, UTC
    model: str | None = None  # the engine's model name or path, when known
    # The settings a reader needs to make sense of the samples (group size, max_new_tokens,
    # the record's own budget); free-form and never read back into a run.
    config: dict[str, Any] = {}
    # The step of this run's first batch: 1 for a new run, the checkpoint's step + 1 for a
    # resumed one, whose lines of that step and later replace the earlier lines of the same
    # steps. None in records written before it was added: nothing is replaced.
    first_step: int | None = None


class SampleLine(msgspec.Struct, kw_only=True):
    """One sample of a group, token by token. The lists are parallel to `tokens`."""

    index: int  # position in the group
    status: str  # `Status` value
    finish_reason: str | None
    reward: float | None
    error: str | None
    tokens: list[int]
    # The decoded piece of each token (the tokenizer's own piece, so that pieces joined give
    # the text); None when the run has no tokenizer.
    pieces: list[str] | None
    logprobs: list[float]  # behaviour policy: what the engine sampled with
    versions: list[int]  # policy version of each token
    loss_mask: list[int] | None  # 1 trained, 0 environment/tool/bridge; None: every token is 1
    turn_ends: list[int] | None  # end offset (exclusive) of each turn; None: one turn


class GroupLine(_Line, tag="group", kw_only=True):
    """A group as it was handed out (or dropped), with all its samples."""

    uid: int
    prompt_id: str
    task: str
    status: str  # the group's `Status` value
    error: str | None
    step: int | None  # the trainer step it was handed out for; None for a dropped group
    version: int  # the producer's policy version when it was handed out or dropped
    drop_reason: str | None = None  # `FailureReason` / "filtered" / "expired" for a dropped one
    start_version: int
    attempts: int
    latency_s: float
    prompt_tokens: list[int]
    prompt_text: str | None  # decoded prompt; None when the run has no tokenizer
    samples: list[SampleLine]


class TrainLine(_Line, tag="train", kw_only=True):
    """What the trainer computed for one handed-out sample at `step`. The lists are parallel to
    that sample's `tokens`; None at a token the trainer did not compute (e.g. not trained)."""

    step: int
    uid: int
    index: int  # the sample's position in its group
    logprobs: list[float | None] | None = None  # the trainer's logprobs of the sampled tokens
    advantages: list[float | None] | None = None  # per token; a per-sample one repeated
    extra: dict[str, Any] = {}  # anything else per sample the trainer attaches (scalars)


class StepLine(_Line, tag="step", kw_only=True):
    """One training step's numbers: `ProduceBatchResult.metrics()` merged with the trainer's."""

    step: int
    version: int
    time_s: float  # seconds since the run's `RunLine.started`
    metrics: dict[str, float]


Line = RunLine | GroupLine | TrainLine | StepLine

_decoder = msgspec.json.Decoder(Line)


class RecordError(ValueError):
    """A record that cannot be read: names the file and line."""


def record_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The record's files in the order they were written (their numbers are zero-padded)."""
    return sorted((Path(run_dir) / RECORD_DIR).glob(FILE_GLOB))


def read_record(run_dir: str | os.PathLike[str]) -> Iterator[Line]:
    """Every line of the run's record, in order. A file's last line with no newline after it
    (a run killed while writing it) is skipped; any other line that does not decode raises
    `RecordError`."""
    files = record_files(run_dir)
    if not files:
        raise RecordError(f"no record in {Path(run_dir) / RECORD_DIR} (files {FILE_GLOB})")
    for path in files:
        with path.open("rb") as f:
            lines = f.read().split(b"\n")
        for n, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                line = _decoder.decode(raw)
            except msgspec.DecodeError as exc:
                if n == len(lines):
                    break  # every line is written with its newline: this one was cut short
                raise RecordError(f"{path}:{n}: {exc}") from exc
            if isinstance(line, RunLine) and line.format > FORMAT:
                raise RecordError(
                    f"{path}:{n}: record format {line.format} is newer than this asyncroll "
                    f"reads ({FORMAT}); upgrade asyncroll"
                )
            yield line
