"""Writing the run record (`asyncroll.record.format`) off the event loop.

`Producer(..., record="runs/x")` (or `record=RecordConfig(dir="runs/x", ...)`) builds a `Record`
and the producer feeds it: every batch `produce_batch` hands out, a sample of the dropped
groups (`drops_per_reason` of each reason, then one in `drop_every`), and at its exit a last
flush. The trainer adds its side through `producer.record`: `attach(groups, step=...,
logprobs=..., advantages=...)` and `step_metrics(step, metrics)`. Without a record,
`producer.record` is a disabled `Record` whose calls do nothing, so a training loop calls it
unconditionally.

The event loop never waits on the disk. What the loop (or the trainer's thread) does is hand
over references to frozen groups and already-copied arrays: a lock held for a `deque.append`.
One writer thread per record turns them into lines, encodes them with msgspec and writes them.
What may wait is bounded by `max_pending_tokens` (every item weighs its response tokens, at
least one): an item that would pass it is dropped and counted (`Record.stats`, and
`record/dropped_pending` in every step line). A slow or blocked disk so costs lines, never
generation. The thread yields the GIL between lines (`time.sleep(0)`), so that a backlog of
lines does not hold the loop off for the interpreter's whole switch interval (5 ms).

On disk the record is bounded by `max_bytes` (default 1 GiB, over every file of the record,
those of earlier runs it continues included). Group and train lines stop at `max_bytes`
minus a sixteenth, kept for the step lines, which stop at `max_bytes`; lines left out are
counted (`record/skipped_budget`). Files rotate at `file_bytes` (64 MiB) into
`rollouts-NNNNNN.jsonl`. Each line is written whole with its newline, and flushed to the OS
as soon as the queue is empty: a killed run leaves every line but, at worst, the last one cut
short, which `read_record` skips.

A producer loaded from a checkpoint (`Producer.load`) continues the record: a new file with a
new `RunLine`. One that was not refuses a folder that already holds a record, at entry: two
runs' steps interleaved in one record would make neither readable.
"""

from __future__ import annotations

import collections
import datetime
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import msgspec
import numpy as np

from asyncroll.record.format import (
    FILE_GLOB,
    RECORD_DIR,
    GroupLine,
    RunLine,
    SampleLine,
    StepLine,
    TrainLine,
    record_files,
)
from asyncroll.types import RolloutGroup

if TYPE_CHECKING:
    from asyncroll._core.progress import ProduceBatchResult

log = logging.getLogger(__name__)

STEP_SHARE = 16  # 1/16 of max_bytes is kept for step lines once groups reach the budget
STEPS_KEPT = 8  # the producer's metrics of a step wait this many batches for the trainer's


class RecordConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where and how much of the run to record. `dir` is the run's folder: the record goes to
    `<dir>/record/`. `tokenizer` (anything with `decode(ids, skip_special_tokens=False)`: a
    `tokenizers.Tokenizer` or a transformers tokenizer) adds each token's piece and the
    prompt's text; without one, both are left out (None)."""

    dir: str
    max_bytes: int = 1 << 30
    # of max_bytes, what group and train lines leave to the step lines (None: a sixteenth)
    step_bytes: int | None = None
    file_bytes: int = 64 << 20
    tokenizer: Any = None
    drops_per_reason: int = 8  # the first dropped groups of each reason are all recorded
    drop_every: int = 50  # then one in this many (0: no more)
    max_pending_tokens: int = 1 << 20  # what may wait for the writer thread, in tokens

    def __post_init__(self) -> None:
        for name in ("max_bytes", "file_bytes", "max_pending_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"RecordConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.step_bytes is not None and not 0 <= self.step_bytes <= self.max_bytes:
            raise ValueError(
                f"RecordConfig.step_bytes={self.step_bytes}: must be in 0..max_bytes "
                f"({self.max_bytes}), or None for a sixteenth of it"
            )
        for name in ("drops_per_reason", "drop_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"RecordConfig.{name}={getattr(self, name)}: must be >= 0")


RecordOption = str | os.PathLike[str] | RecordConfig | None
"""What `Producer(record=...)` takes: a run folder, a `RecordConfig`, or None (no record)."""


class RecordStats(msgspec.Struct, kw_only=True):
    """What the record wrote and left out, cumulative (each step line carries them as
    `record/<name>`)."""

    groups: int = 0  # group lines written (handed-out and dropped)
    drops_seen: int = 0  # dropped groups the producer reported
    drops_sampled: int = 0  # of them, handed to the writer
    dropped_pending: int = 0  # items left out because `max_pending_tokens` were waiting
    skipped_budget: int = 0  # lines left out at `max_bytes`
    dropped_closed: int = 0  # items given after the record was closed
    bytes: int = 0  # on disk, over every file of the record
    files: int = 0  # files this writer started


class _Item(msgspec.Struct):
    """One piece of work for the writer thread."""

    kind: str  # "run", "batch", "drop", "train", "step"
    payload: Any
    at: float  # time.time() when handed over


class Record:
    """The run's record (see the module docstring). Built by `Producer`; disabled (every call
    does nothing) when the producer was given no `record`."""

    def __init__(self, option: RecordOption = None) -> None:
        if option is not None and not isinstance(option, RecordConfig):
            option = RecordConfig(dir=os.fspath(option))
        self.config = option
        self.stats = RecordStats()
        self.steps = 0  # batches handed out: the step of the next one is steps + 1
        self._pending: collections.deque[tuple[_Item, int]] = collections.deque()
        self._pending_tokens = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._drop_counts: collections.Counter[str] = collections.Counter()
        self._started = 0.0
        if option is not None:
            self.folder = _writable(option.dir)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    # -- the producer's side (event loop) --------------------------------------------------------

    def start(self, *, resumed: bool, model: str | None, settings: Mapping[str, Any]) -> None:
        """Start the writer thread and write the run's `RunLine` (at the producer's entry).
        A run that was not resumed refuses a folder that holds a record already."""
        cfg = self.config
        if cfg is None:
            return
        existing = record_files(cfg.dir)
        if existing and not resumed:
            raise ValueError(
                f"record={cfg.dir!r}: {self.folder} already holds a run's record "
                f"({len(existing)} files {FILE_GLOB}); give this run a new folder, delete "
                "those files, or load() that run's checkpoint to continue its record"
            )
        self.stats.bytes = sum(p.stat().st_size for p in existing)
        self._next_file = _number(existing[-1]) + 1 if existing else 0
        self._started = time.time()
        started = datetime.datetime.fromtimestamp(self._started, datetime.UTC).isoformat()
        record = {
            "max_bytes": cfg.max_bytes,
            "step_bytes": cfg.step_bytes,
            "file_bytes": cfg.file_bytes,
            "drops_per_reason": cfg.drops_per_reason,
            "drop_every": cfg.drop_every,
        }
        run = RunLine(started=started, model=model, config={**settings, "record": record})
        self._offer(_Item("run", run, self._started), 1)
        self._thread = threading.Thread(
            target=self._write_all, name="asyncroll-record", daemon=True
        )
        self._thread.start()

    def handed_out(self, batch: ProduceBatchResult) -> None:
        """`produce_batch` hands `batch` out: its groups are the next step's."""
        if self.config is None:
            return
        self.steps += 1
        weight = sum([g.num_tokens for g in batch.groups])
        self._offer(_Item("batch", (self.steps, batch), time.time()), weight)

    def dropped(self, group: RolloutGroup, reason: str, version: int) -> None:
        """A group failed, was filtered or expired (`reason`): recorded if sampled."""
        if self.config is None:
            return
        self.stats.drops_seen += 1
        n = self._drop_counts[reason]
        self._drop_counts[reason] = n + 1
        every = self.config.drop_every
        keep = self.config.drops_per_reason
        if n < keep or (every and (n - keep) % every == every - 1):
            self.stats.drops_sampled += 1
            self._offer(_Item("drop", (group, reason, version), time.time()), group.num_tokens)

    # -- the trainer's side (any thread) ---------------------------------------------------------

    def attach(
        self,
        groups: Sequence[RolloutGroup],
        *,
        step: int,
        logprobs: Any = None,
        advantages: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """What the trainer computed for the samples of `groups` at `step`, one row per sample
        (groups in order, their samples in order: `to_batch`'s rows).

        `logprobs`: the trainer's logprob of each sampled token, a [rows, L] array or tensor
        aligned with the prompt and response as `to_batch`'s `input_ids` are (what
        `token_logprobs` returns), or one 1-D array per row over its response tokens.
        `advantages`: [rows] (one per sample), [rows, L] as `logprobs`, or one 1-D array per
        row. Only tokens the loss trains (the sample's `loss_mask`) are kept; the others are
        None. `extra`: name -> one number per row. Arrays are copied here; the lines are
        built in the writer thread."""
        if self.config is None:
            return
        groups = list(groups)
        rows = sum(g.num_samples for g in groups)
        lp = _rows(logprobs, rows, "logprobs")
        adv = _rows(advantages, rows, "advantages")
        more = {k: _rows(v, rows, f"extra[{k!r}]") for k, v in (extra or {}).items()}
        weight = sum(g.num_tokens for g in groups)
        self._offer(_Item("train", (step, groups, lp, adv, more), time.time()), weight)

    def step_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """The trainer's numbers of `step`: written in one `StepLine` with the metrics of the
        batch handed out for that step (`ProduceBatchResult.metrics()`). A step whose
        trainer numbers never come is written with the producer's alone, `STEPS_KEPT` batches
        later or at the end."""
        if self.config is None:
            return
        numbers = {str(k): float(v) for k, v in metrics.items()}
        self._offer(_Item("step", (step, numbers), time.time()), 1 + len(numbers) // 16)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (blocking: call it from a thread, not the event loop) until everything handed
        over so far is written and flushed to the OS; False if `timeout` passed first."""
        if self.config is None:
            return True
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write what is waiting, flush and close the file, end the thread (blocking). False
        if the thread was still writing after `timeout` (a disk that does not answer): it is
        a daemon thread, and what it had not written is lost."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            log.warning(
                "the run record's writer did not finish within %s s (a slow disk?): %d items "
                "were not written to %s",
                timeout, len(self._pending), self.folder,
            )  # fmt: skip
            return False
        return True

    def _offer(self, item: _Item, weight: int) -> None:
        """Queue `item` unless the writer is `max_pending_tokens` behind: never waits."""
        assert self.config is not None
        weight = max(1, weight)
        with self._lock:
            if self._closed:
                self.stats.dropped_closed += 1
                return
            if self._pending_tokens + weight > self.config.max_pending_tokens and self._pending:
                self.stats.dropped_pending += 1
                return
            self._pending.append((item, weight))
            self._pending_tokens += weight
            self._wake.notify()

    # -- the writer thread -----------------------------------------------------------------------

    def _write_all(self) -> None:
        lines = _Lines(self)
        try:
            while True:
                with self._lock:
                    self._wake.wait_for(lambda: bool(self._pending) or self._closed)
                    if not self._pending:
                        break
                    item, weight = self._pending.popleft()
                    self._busy = True
                try:
                    lines.write(item)
                finally:
                    with self._lock:
                        self._pending_tokens -= weight
                        self._busy = False
                        if not self._pending:
                            lines.flush()
                            self._idle.notify_all()
            lines.finish()
        except Exception:  # a full disk, a bug: the run goes on without its record
            log.exception("the run record's writer failed: no more lines go to %s", self.folder)
            with self._lock:
                self._closed = True
                self.stats.dropped_closed += len(self._pending)
                self._pending.clear()
                self._idle.notify_all()
        finally:
            lines.close()

    def _open(self, path: Path) -> BinaryIO:
        """A new record file (a test replaces this to simulate a slow disk)."""
        return path.open("xb")


class _Lines:
    """The writer thread's state: the open file, the budget, the pieces, the steps waiting for
    the trainer's metrics."""

    def __init__(self, record: Record) -> None:
        assert record.config is not None
        self.record = record
        self.cfg = record.config
        self.stats = record.stats
        self.file: BinaryIO | None = None
        self.file_bytes = 0
        self.piece = _pieces(self.cfg.tokenizer)
        self.steps: dict[int, tuple[int, float, dict[str, float]]] = {}
        self.version = 0  # of the last batch: a step line of the trainer's numbers alone
        self.encoder = msgspec.json.Encoder()
        kept = self.cfg.step_bytes
        self.group_limit = self.cfg.max_bytes - (
            self.cfg.max_bytes // STEP_SHARE if kept is None else kept
        )

    def write(self, item: _Item) -> None:
        match item.kind:
            case "run":
                self.line(item.payload, step=True)
            case "batch":
                step, batch = item.payload
                for group in batch.groups:
                    self.line(self.group(group, step, batch.version, None), step=False)
                    self.stats.groups += 1
                    time.sleep(0)  # let the event loop have the GIL between lines
                self.steps[step] = (batch.version, item.at, batch.metrics())
                self.version = batch.version
                for old in [s for s in self.steps if s <= step - STEPS_KEPT]:
                    self.step_line(old, {})
            case "drop":
                group, reason, version = item.payload
                self.line(self.group(group, None, version, reason), step=False)
                self.stats.groups += 1
            case "train":
                for line in self.train(*item.payload):
                    self.line(line, step=False)
                    time.sleep(0)
            case "step":
                step, numbers = item.payload
                self.step_line(step, numbers, at=item.at)

    def step_line(self, step: int, numbers: dict[str, float], at: float | None = None) -> None:
        version, handed, produced = self.steps.pop(step, (self.version, at or time.time(), {}))
        stats = {f"record/{k}": float(v) for k, v in msgspec.structs.asdict(self.stats).items()}
        metrics = {**produced, **numbers, **stats}
        line = StepLine(
            step=step,
            version=version,
            time_s=(at or handed) - self.record._started,
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
        tokenizer = self.cfg.tokenizer
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
            prompt_text=None if tokenizer is None else _decode(tokenizer, prompt),
            samples=samples,
        )

    def train(
        self,
        step: int,
        groups: list[RolloutGroup],
        logprobs: _RowValues,
        advantages: _RowValues,
        extra: dict[str, _RowValues],
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

    def line(self, line: Any, *, step: bool) -> None:
        """Write one line within the budget, rotating files at `file_bytes`."""
        data = self.encoder.encode(line) + b"\n"
        limit = self.cfg.max_bytes if step else self.group_limit
        if self.stats.bytes + len(data) > limit:
            self.stats.skipped_budget += 1
            return
        if self.file is None or (
            self.file_bytes and self.file_bytes + len(data) > self.cfg.file_bytes
        ):
            self.rotate()
        assert self.file is not None
        self.file.write(data)
        self.file_bytes += len(data)
        self.stats.bytes += len(data)

    def rotate(self) -> None:
        self.close()
        record = self.record
        path = record.folder / f"rollouts-{record._next_file:06d}.jsonl"
        record._next_file += 1
        self.file = record._open(path)
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


_RowValues = list[np.ndarray] | np.ndarray | None


def _rows(values: Any, rows: int, name: str) -> _RowValues:
    """`values` as numpy, copied: a [rows] or [rows, L] array, or one 1-D array per row."""
    if values is None:
        return None
    if isinstance(values, (list, tuple)):
        out = [np.array(_numpy(v), dtype=np.float64).reshape(-1) for v in values]
        if len(out) != rows:
            raise ValueError(f"record.attach: {name} has {len(out)} rows, the groups {rows}")
        return out
    array = np.array(_numpy(values), dtype=np.float64)
    if array.ndim not in (1, 2) or len(array) != rows:
        raise ValueError(
            f"record.attach: {name} has shape {array.shape}; the groups have {rows} samples: "
            "give [samples] or [samples, L] (to_batch's rows) or one array per sample"
        )
    return array


def _numpy(value: Any) -> Any:
    """A torch tensor's values (detached, on the CPU) or `value` as it is."""
    if hasattr(value, "detach"):
        return value.detach().float().cpu().numpy()
    return value


def _tokens_of(
    values: _RowValues, row: int, prompt: int, n: int, trained: np.ndarray | None
) -> list[float | None] | None:
    """Row `row`'s value at each of its `n` response tokens, None where not trained."""
    if values is None:
        return None
    v = values[row]
    if isinstance(values, list):
        if len(v) != n:
            raise ValueError(f"record.attach: row {row} has {len(v)} values for {n} tokens")
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


def _number(path: Path) -> int:
    return int(path.stem.rsplit("-", 1)[1])


def _writable(run_dir: str) -> Path:
    """`<run_dir>/record`, made and checked writable now: a folder the run cannot write is
    refused when the producer is built, not found out at the first batch."""
    folder = Path(run_dir) / RECORD_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}-{threading.get_ident()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"record={run_dir!r}: the run record cannot be written to {folder} "
            f"({type(exc).__name__}: {exc}); give a folder this process can create and write"
        ) from exc
    return folder
