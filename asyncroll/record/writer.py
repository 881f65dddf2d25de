"""Writing the run record (`asyncroll.record.format`) off the event loop.

`Producer(..., record="runs/x")` (or `record=RecordConfig(dir="runs/x", ...)`) builds a `Record`
and the producer feeds it: every batch `produce_batch` hands out, a sample of the dropped
groups (`drops_per_reason` of each reason, then one in `drop_every`), and at its exit a last
flush. The trainer adds its side through `producer.record`: `attach(groups, step=...,
logprobs=..., advantages=...)` and `step_metrics(step, metrics)`. Without a record,
`producer.record` is a disabled `Record` whose calls do nothing, so a training loop calls it
unconditionally.

The event loop never waits on the disk, and never shares its interpreter lock with the
record's work. What the loop (or the trainer's thread) does is hand over references to frozen
groups and already-copied arrays: a lock held for a `deque.append`. A feeder thread encodes
each item with the codec (microseconds a group, in C) and sends it down a pipe to the
record's writer process (`asyncroll.record.child`), which builds the lines (the per-token
lists, the pieces, the JSON) and writes them. In a thread of this process that work held the
lock in stretches of up to the interpreter's switch interval (5 ms), each of which the loop
waited out: a 10 ms stretch of the loop's own work became 20. What may wait is bounded by
`max_pending_tokens` (every item weighs its response tokens, at least one; an item counts
until the writer has taken it): an item that would pass it is dropped and counted
(`Record.stats`, and `record/dropped_pending` in every step line). A slow or blocked disk so
costs lines, never generation. The writer's own counters (lines, bytes, files) come back
with its acknowledgements; the producer's (drops, items left out) go with each message, and
step lines carry both.

The writer process starts at the producer's entry (a Python that imports msgspec and numpy,
then the tokenizer's library when there is one: about 0.3 s of CPU, waited for beside the
engine's first update) and ends with the pipe: at the producer's exit, or when the producer
dies. A tokenizer is pickled to it, so one that cannot be is refused when the producer is
built.

On disk the record is bounded by `max_bytes` (default 1 GiB, over every file of the record,
those of earlier runs it continues included). Group and train lines stop at `max_bytes`
minus a sixteenth, kept for the step lines, which stop at `max_bytes`; lines left out are
counted (`record/skipped_budget`). Files rotate at `file_bytes` (64 MiB) into
`rollouts-NNNNNN.jsonl`. Each line is written whole with its newline, and flushed to the OS
as soon as the writer has caught up: a killed run leaves every line but, at worst, the last one cut
short, which `read_record` skips.

A producer loaded from a checkpoint (`Producer.load`) continues the record: a new file with a
new `RunLine`. One that was not refuses a folder that already holds a record, at entry: two
runs' steps interleaved in one record would make neither readable.
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from asyncroll.codec import encode, encode_value
from asyncroll.launcher_env import without_launcher_variables
from asyncroll.record.format import FILE_GLOB, RECORD_DIR, RunLine, record_files
from asyncroll.record.wire import (
    ACKS,
    Batch,
    Counts,
    Drop,
    Message,
    Opening,
    Step,
    Train,
)
from asyncroll.types import RolloutGroup

if TYPE_CHECKING:
    from asyncroll._core.progress import ProduceBatchResult

log = logging.getLogger(__name__)

# The writer's start: a Python, msgspec and numpy, the tokenizer's library (transformers is
# seconds on a loaded machine); this only bounds a writer that never answers.
START_TIMEOUT_S = 120.0


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
    max_pending_tokens: int = 1 << 20  # what may wait for the writer, in tokens

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
    """One piece of work for the feeder thread, numbered in the order it was handed over."""

    seq: int
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
        self._wake = threading.Condition(self._lock)  # the feeder: something to send
        self._done = threading.Condition(self._lock)  # flush(): an acknowledgement came
        self._seq = -1  # of the last item handed over
        self._acked = -1  # the last item the writer wrote and flushed
        self._closed = False  # nothing more is taken
        self._ended = False  # the writer process said its last word (or died)
        self._error: str | None = None  # why the writer ended early
        self._process: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self._drop_counts: collections.Counter[str] = collections.Counter()
        self._started = 0.0
        if option is not None:
            self.folder = _writable(option.dir)
            self._tokenizer = _pickled(option.tokenizer)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    @property
    def pid(self) -> int | None:
        """The writer process's pid, while it runs."""
        process = self._process
        return None if process is None or process.returncode is not None else process.pid

    # -- the producer's side (event loop) --------------------------------------------------------

    def start(self, *, resumed: bool, model: str | None, settings: Mapping[str, Any]) -> None:
        """Start the writer process and hand over the run's `RunLine` (at the producer's
        entry; `started` then waits for the writer to be ready). A run that was not resumed
        refuses a folder that holds a record already."""
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
        self._started = time.time()
        started = datetime.datetime.fromtimestamp(self._started, datetime.UTC).isoformat()
        record = {
            "max_bytes": cfg.max_bytes,
            "step_bytes": cfg.step_bytes,
            "file_bytes": cfg.file_bytes,
            "drops_per_reason": cfg.drops_per_reason,
            "drop_every": cfg.drop_every,
        }
        run = RunLine(
            started=started,
            model=model,
            config={**settings, "record": record},
            first_step=self.steps + 1,
        )
        self.stats.bytes = sum(p.stat().st_size for p in existing)
        first = Opening(
            seq=0,
            path=list(sys.path),
            folder=str(self.folder),
            next_file=_number(existing[-1]) + 1 if existing else 0,
            bytes_before=self.stats.bytes,
            started=self._started,
            max_bytes=cfg.max_bytes,
            step_bytes=cfg.step_bytes,
            file_bytes=cfg.file_bytes,
            tokenizer=self._tokenizer,
            run=msgspec.msgpack.encode(run),
        )
        inbox_read, inbox_write = os.pipe()
        ack_read, ack_write = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "asyncroll.record.child", str(inbox_read), str(ack_write)],
                pass_fds=(inbox_read, ack_write),
                start_new_session=True,  # a terminal's ^C is the producer's to handle
                env=without_launcher_variables(os.environ),
            )
        finally:  # the writer's ends are the writer's: its exit closes them for good
            os.close(inbox_read)
            os.close(ack_write)
        inbox = Connection(inbox_write, readable=False)
        acks = Connection(ack_read, writable=False)
        self._offer(_Item(0, "run", first, self._started), 1)
        self._threads = [
            threading.Thread(target=self._feed, args=(inbox,), name="asyncroll-record-feed"),
            threading.Thread(target=self._hear, args=(acks,), name="asyncroll-record-acks"),
        ]
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    def started(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait (blocking) until the writer process has written the run's first line; raise
        if it could not (it exited: its error is in the message) or did not within
        `timeout`."""
        if self.config is None:
            return
        with self._done:
            self._done.wait_for(lambda: self._acked >= 0 or self._ended, timeout)
            if self._acked >= 0:
                return
            why = self._error or f"it did not answer within {timeout} s"
        raise RuntimeError(
            f"record={self.config.dir!r}: the run record's writer process did not start: "
            f"{why} (its own output above says more); the run was not started"
        )

    def handed_out(self, batch: ProduceBatchResult) -> None:
        """`produce_batch` hands `batch` out: its groups are the next step's."""
        if self.config is None:
            return
        self.steps += 1
        weight = sum([g.num_tokens for g in batch.groups])
        self._offer(_Item(0, "batch", (self.steps, batch), time.time()), weight)

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
            item = _Item(0, "drop", (group, reason, version), time.time())
            self._offer(item, group.num_tokens)

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
        built by the writer process."""
        if self.config is None:
            return
        groups = list(groups)
        tokens = [len(s.tokens) for g in groups for s in g.samples]
        lp = _rows(logprobs, tokens, "logprobs")
        adv = _rows(advantages, tokens, "advantages")
        more = {k: _rows(v, tokens, f"extra[{k!r}]") for k, v in (extra or {}).items()}
        rows = {"logprobs": lp, "advantages": adv, "extra": more}
        self._offer(_Item(0, "train", (step, groups, rows), time.time()), sum(tokens))

    def step_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """The trainer's numbers of `step`: written in one `StepLine` with the metrics of the
        batch handed out for that step (`ProduceBatchResult.metrics()`). A step whose
        trainer numbers never come is written with the producer's alone, `STEPS_KEPT` batches
        later or at the end."""
        if self.config is None:
            return
        numbers = {str(k): float(v) for k, v in metrics.items()}
        self._offer(_Item(0, "step", (step, numbers), time.time()), 1 + len(numbers) // 16)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (blocking: call it from a thread, not the event loop) until everything handed
        over so far is written and flushed to the OS; False if `timeout` passed first or the
        writer ended without it."""
        if self.config is None:
            return True
        with self._done:
            last = self._seq
            self._done.wait_for(lambda: self._acked >= last or self._ended, timeout)
            return self._acked >= last and self._error is None

    def close(self, timeout: float | None = None) -> bool:
        """Hand the writer what is waiting, let it write it, flush and exit (blocking). False
        if it was still writing after `timeout` (a disk that does not answer): it is then
        killed, and what it had not written is lost."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        process = self._process
        if process is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        self._threads[0].join(_left(deadline))  # the feeder hands over the rest, then ends
        finished = True
        try:
            process.wait(_left(deadline))
        except subprocess.TimeoutExpired:
            finished = False
            log.warning(
                "the run record's writer did not finish within %s s (a slow disk?): the "
                "lines not yet written to %s are lost",
                timeout, self.folder,
            )  # fmt: skip
            process.kill()
            process.wait()
        for thread in self._threads:  # both end with the process: its pipes are closed
            thread.join()
        return finished and self._error is None

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
            self._seq += 1
            item.seq = self._seq
            self._pending.append((item, weight))
            self._pending_tokens += weight
            self._wake.notify()

    # -- the feeder and the acknowledgements (threads of their own) -------------------------------

    def _feed(self, inbox: Connection) -> None:
        """Encode each waiting item and send it to the writer. An item counts against
        `max_pending_tokens` until the writer has taken it, so what waits in this process
        stays within the bound whatever the writer does."""
        encode = msgspec.msgpack.Encoder().encode
        try:
            while True:
                with self._lock:
                    self._wake.wait_for(lambda: bool(self._pending) or self._closed)
                    if not self._pending:
                        break
                    item, weight = self._pending[0]
                    counts = Counts(
                        drops_seen=self.stats.drops_seen,
                        drops_sampled=self.stats.drops_sampled,
                        dropped_pending=self.stats.dropped_pending,
                        dropped_closed=self.stats.dropped_closed,
                    )
                inbox.send_bytes(encode(_message(item, counts)))
                with self._lock:
                    self._pending.popleft()
                    self._pending_tokens -= weight
        except OSError:  # the writer is gone (`_hear` says why): what waits is lost
            with self._lock:
                self._drop_all()
        finally:
            inbox.close()  # the writer's end of file: it finishes and exits

    def _hear(self, acks: Connection) -> None:
        """Take the writer's acknowledgements until it exits."""
        try:
            while True:
                ack = ACKS.decode(acks.recv_bytes())
                with self._lock:
                    self.stats.groups = ack.stats.groups
                    self.stats.skipped_budget = ack.stats.skipped_budget
                    self.stats.bytes = ack.stats.bytes
                    self.stats.files = ack.stats.files
                    self._acked = max(self._acked, ack.seq)
                    if ack.error is not None:
                        self._error = ack.error
                    self._done.notify_all()
        except (EOFError, OSError):
            pass
        finally:
            acks.close()
            with self._lock:
                self._ended = True
                if self._error is None and not self._closed:
                    self._error = "it exited before the run's end"
                if self._error is not None:
                    log.warning(
                        "the run record's writer failed: %s; no more lines go to %s",
                        self._error, self.folder,
                    )  # fmt: skip
                    self._drop_all()
                self._done.notify_all()

    def _drop_all(self) -> None:
        """The writer takes nothing more (called with the lock held)."""
        self._closed = True
        self.stats.dropped_closed += len(self._pending)
        self._pending.clear()
        self._pending_tokens = 0
        self._wake.notify_all()


def _message(item: _Item, counts: Counts) -> Message:
    """`item` as the writer's message: the groups as the codec's bytes."""
    match item.kind:
        case "run":
            first: Opening = item.payload
            return first
        case "batch":
            step, batch = item.payload
            return Batch(
                seq=item.seq,
                counts=counts,
                step=step,
                version=batch.version,
                at=item.at,
                metrics=batch.metrics(),
                groups=[encode(g) for g in batch.groups],
            )
        case "drop":
            group, reason, version = item.payload
            return Drop(
                seq=item.seq, counts=counts, version=version, reason=reason, group=encode(group)
            )
        case "train":
            step, groups, rows = item.payload
            return Train(
                seq=item.seq,
                counts=counts,
                step=step,
                groups=[encode(g) for g in groups],
                rows=encode_value(rows),
            )
        case _:
            step, numbers = item.payload
            return Step(seq=item.seq, counts=counts, step=step, at=item.at, numbers=numbers)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _pickled(tokenizer: Any) -> bytes | None:
    """The tokenizer as the writer process gets it; one it cannot get is refused now."""
    if tokenizer is None:
        return None
    kind = type(tokenizer)
    if kind.__module__ == "__main__":
        raise ValueError(
            f"RecordConfig.tokenizer: {kind.__qualname__} is defined in the script being run "
            "(__main__), which the record's writer process cannot import; move the class into "
            "a module, or give a tokenizers.Tokenizer or a transformers tokenizer"
        )
    try:
        return pickle.dumps(tokenizer)
    except Exception as exc:
        raise ValueError(
            f"RecordConfig.tokenizer: the {kind.__qualname__} cannot be pickled for the "
            f"record's writer process ({type(exc).__name__}: {exc}); give a "
            "tokenizers.Tokenizer, a transformers tokenizer, or an object of a class defined "
            "at a module's top level"
        ) from exc


def _rows(values: Any, tokens: list[int], name: str) -> np.ndarray | list[np.ndarray] | None:
    """`values` as numpy, copied: a [rows] or [rows, L] array, or one 1-D array per row over
    its response (`tokens[row]` values). Checked here, where the caller sees the error."""
    if values is None:
        return None
    rows = len(tokens)
    if isinstance(values, (list, tuple)):
        out = [np.array(_numpy(v), dtype=np.float64).reshape(-1) for v in values]
        if len(out) != rows:
            raise ValueError(f"record.attach: {name} has {len(out)} rows, the groups {rows}")
        for row, (v, n) in enumerate(zip(out, tokens, strict=True)):
            if len(v) != n:
                raise ValueError(
                    f"record.attach: {name}[{row}] has {len(v)} values for the sample's {n} "
                    "response tokens"
                )
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
