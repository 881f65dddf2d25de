"""This process's place in a multi-rank trainer (torchrun, torch.multiprocessing), and the
few collectives asyncroll runs over it, each with a deadline and a named failure.

Rank 0 owns the rollouts: the producer, its engine and its ledger live in its process only;
the other ranks never import vLLM. Every rank runs the same loop, and each step of it is one
`Ranks` call on every rank, in the same order:

    shard = await ranks.batch(producer, split)        # rank 0 produces; each rank gets its share
    stats = await asyncio.to_thread(train_step, ...)  # every rank (FSDP / DDP collectives)
    version = await ranks.update_weights(model, producer)   # every rank gathers; rank 0 loads

While rank 0 works alone (a batch that takes minutes to generate, vLLM loading weights), the
others wait on a control group of their own (gloo, CPU tensors) that rank 0 sends a keepalive
on every `keepalive_s`: a wait for rank 0 is then never a collective timeout, and a collective
that does time out (`timeout_s`) means a rank stopped answering. A rank that raises writes its
error where every rank can read it (a folder of the job's, one machine) before it exits; the
others' next collective fails as soon as its sockets close, and each raises `RankFailed` naming
the rank and its error, or the rank that died without one (its pid gone: SIGKILL, out of
memory), or, when every rank lives and none failed, the phase nobody finished. Under torchrun
a failed rank makes the launcher send SIGTERM to the others: `Ranks` turns that into the same
`RankFailed` after the `async with` blocks inside it (the producer and its engine) have closed.

Bounds: a rank that raises or dies is seen by every other within one keepalive period (rank 0
waiting alone) or at once (ranks in a collective: the sockets close); a rank that hangs is seen
within `timeout_s`, the deadline of every collective asyncroll runs and, when `Ranks` starts
the process group, of the trainer's own (FSDP's, DDP's) too.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import enum
import logging
import os
import shutil
import signal
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import psutil
import torch
import torch.distributed as dist

from asyncroll.distributed import folder
from asyncroll.distributed.gather import GatherStats

if TYPE_CHECKING:
    from asyncroll.producer import Producer
    from asyncroll.train.micro import Shard

T = TypeVar("T")
log = logging.getLogger("asyncroll.distributed")


class RankFailed(RuntimeError):
    """Another rank (or this one's launcher) ended the run: `rank` is the rank that failed
    first (None when none can be named) and the message says what it did."""

    def __init__(self, message: str, *, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


class _Message(enum.IntEnum):
    """What rank 0 sends on the control group (the first entry of each header)."""

    KEEPALIVE = 0  # still working alone: keep waiting
    DONE = 1  # its work ended: `value` is what it returned (a version), or 0
    ERROR = 2  # its work raised: the message follows
    STOP = 3  # the producer ran out of prompts: the loop ends on every rank
    DATA = 4  # each rank's share follows (sizes, then bytes)


_HEADER = 4  # kind, phase, step, value


class Ranks:
    """The ranks of this job (see the module docstring), entered with `async with` on every
    rank. It starts the default process group from the launcher's environment (backend gloo
    on CPU, nccl with CUDA; `timeout_s` its collectives' deadline) unless the trainer did.

    `timeout_s` bounds how long any collective waits for a rank that stopped answering;
    `keepalive_s` (default a tenth of it) is how often rank 0 tells the others it still
    works alone, so it also bounds how long rank 0 takes to see a rank that died while it
    waited for a batch."""

    def __init__(
        self,
        *,
        timeout_s: float = 300.0,
        keepalive_s: float | None = None,
        backend: str | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 seconds")
        keepalive = timeout_s / 10 if keepalive_s is None else keepalive_s
        if not 0 < keepalive <= timeout_s / 4:
            raise ValueError(
                f"keepalive_s={keepalive_s}: must be > 0 and at most timeout_s / 4 "
                f"({timeout_s / 4:g} s), so that a keepalive always arrives before a timeout"
            )
        self.timeout_s = timeout_s
        self.keepalive_s = keepalive
        self._backend = backend
        self._started_group = False
        self._control: Any = None
        self._pids: list[int] = []
        self._folder: Path | None = None
        self._task: asyncio.Task[Any] | None = None
        self._terminated = False
        self._previous_handler: Any = signal.SIG_DFL
        self._steps = 0
        self.last_gather: GatherStats | None = None  # the last update's, for its metrics
        self.last_version = 0  # the producer's version after the last update (every rank)
        self.rank = -1
        self.world_size = 0

    @property
    def rollout(self) -> bool:
        """Whether this rank owns the rollouts (rank 0): create the producer here only."""
        return self.rank == 0

    # -- entering and leaving ---------------------------------------------------------------

    async def __aenter__(self) -> Ranks:
        # Groups are made on this thread, blocking the loop for the rendezvous (nothing runs
        # yet): made on a worker thread, DDP aborted the process at its exit with 3 ranks
        # ("terminate called without an active exception").
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if not dist.is_initialized():
            backend = self._backend or ("nccl" if torch.cuda.is_available() else "gloo")
            dist.init_process_group(backend, timeout=timeout)
            self._started_group = True
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._control = dist.new_group(backend="gloo", timeout=timeout)
        self._pids = await self._collective("start", self._share_pids)
        self._folder = Path(await self._collective("start", self._share_folder))
        self._task = asyncio.current_task()
        with contextlib.suppress(ValueError):  # not the main thread: the launcher's SIGTERM
            self._previous_handler = signal.getsignal(signal.SIGTERM)  # then ends the process
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._on_sigterm)
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None and not self._terminated:
            await self._finish()
            return
        # The run ends with an error: a launcher's SIGTERM (torchrun sends one to every rank
        # as soon as one fails) must not kill this process before its error is out.
        self._restore_sigterm(signal.SIG_IGN)
        self._fail(exc)

    async def _finish(self) -> None:
        await self._collective("the end", dist.barrier, group=self._control)
        self._restore_sigterm(self._previous_handler)
        if self.rank == 0 and self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        dist.destroy_process_group(self._control)
        if self._started_group:
            dist.destroy_process_group()

    def _restore_sigterm(self, handler: Any) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, handler)

    def _fail(self, exc: BaseException | None) -> None:
        """Raise what ended the run, named, and remove the job's folder if this rank is the
        last one out (`asyncroll.distributed.folder`). A rank that fails first goes at once:
        its exit is what the others see; one that fails for another rank looks a moment for
        the others to end."""
        try:
            self._name_failure(exc)
        except RankFailed as failure:
            self._leave(wait_s=0.0 if failure.rank == self.rank else 2.0)
            raise
        self._leave(wait_s=0.0)

    def _leave(self, wait_s: float) -> None:
        if self._folder is not None:
            folder.remove_if_last(self._folder, os.getpid(), wait_s)

    def _name_failure(self, exc: BaseException | None) -> None:
        if self._terminated:
            if isinstance(exc, RankFailed):
                raise exc  # it already names the rank that failed first
            raise self._failure("SIGTERM", "this rank was sent SIGTERM") from exc
        if exc is not None:
            if isinstance(exc, RankFailed):
                if exc.rank is None:  # nobody could be named: tell the ranks still waiting
                    self._report(exc)
                return
            if isinstance(exc, Exception) and _collective_error(exc):
                # Raised inside the trainer's own collectives (FSDP's, DDP's): most often
                # another rank's failure, seen here as closed sockets.
                failure = self._failure("the trainer's step", f"{type(exc).__name__}: {exc}")
                if failure.rank is not None and failure.rank != self.rank:
                    raise failure from exc
            self._report(exc)
        # no collective now: the others see this rank's sockets close; the exception goes on

    def _on_sigterm(self) -> None:
        """torchrun sends SIGTERM to every rank when one fails (and when it is itself
        stopped): end the task inside `async with Ranks()`, so that the blocks inside it (the
        producer, the engine: vLLM's processes) close as for any error."""
        self._terminated = True
        if self._task is not None:
            self._task.cancel()

    def _share_pids(self) -> list[int]:
        pids = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(pids, torch.tensor([os.getpid()]), group=self._control)
        return [int(p) for p in pids]

    def _share_folder(self) -> str:
        """A folder of the job's, made by rank 0 (ranks share one machine): where a failing
        rank writes its error for the others to read."""
        path = str(folder.make(self._pids)) if self.rank == 0 else ""
        return _broadcast_bytes(path.encode(), self._control).decode()

    def _report(self, exc: BaseException) -> None:
        if self._folder is None:
            return
        text = f"{type(exc).__name__}: {exc}".strip()
        with contextlib.suppress(OSError):
            report = self._folder / f"rank{self.rank}.error"
            partial = report.with_suffix(".partial")
            partial.write_text(text)
            partial.replace(report)  # complete or absent for a reader

    # -- the steps of the loop ----------------------------------------------------------------

    async def batch(
        self,
        producer: Producer | None,
        split: Callable[[Any], list[Shard]],
        *,
        timeout: float | None = None,
    ) -> tuple[Shard, Any] | None:
        """This rank's share of the next batch, and on rank 0 the batch itself
        (`ProduceBatchResult`, None elsewhere); None on every rank once the producer has no
        prompts left (`ProducerExhausted`). `timeout`: `produce_batch`'s, whose
        `TimeoutError` ends every rank as any failure of rank 0 does.

        Rank 0 awaits `producer.produce_batch()`, gives the result to `split` (one share per
        rank, e.g. `split_batch(to_batch(result.groups), ranks.world_size, ...)`) and sends
        each rank its own: the others never see the groups, only their share, as tensors."""
        from asyncroll.producer import ProducerExhausted
        from asyncroll.train.micro import Shard

        self._steps += 1
        if self.rank == 0:
            if producer is None:
                raise ValueError("rank 0 owns the rollouts: give it the producer")

            async def produce() -> Any:
                try:
                    return await producer.produce_batch(timeout=timeout)
                except ProducerExhausted:
                    return None  # the end of the data, not a failure: STOP on every rank

            result = await self._alone("batch", produce)
            if result is None:
                return None
            shares = split(result)
            if len(shares) != self.world_size:
                raise ValueError(f"split returned {len(shares)} shares for {self.world_size} ranks")
            from asyncroll.distributed import wire

            payloads = [wire.encode(share) for share in shares]
            await self._send_header(_Message.DATA, "batch")
            data = await self._collective("batch", self._scatter, payloads)
            return wire.decode(data, Shard), result
        if producer is not None:
            raise ValueError(
                f"rank {self.rank} got a producer: only rank 0 owns the rollouts (create the "
                "producer and its engine where ranks.rollout is True)"
            )
        kind, _ = await self._follow("batch")
        if kind is _Message.STOP:
            return None
        kind, _ = await self._follow("batch")  # DATA: the shares follow
        from asyncroll.distributed import wire

        data = await self._collective("batch", self._scatter, None)
        return wire.decode(data, Shard), None

    async def update_weights(
        self,
        model: torch.nn.Module,
        producer: Producer | None,
        *,
        bucket_bytes: int = 1 << 30,
        adapter: bool = False,
    ) -> int:
        """Gather the model's full weights on every rank, bucket by bucket, and load them
        into rank 0's producer (`Producer.update_weights`); returns the new version on every
        rank. `adapter=True` sends only a `wrap_lora` adapter's tensors (a `LoraAdapter`).

        Every rank gathers every parameter once, in one order (checked), in buckets of at
        most `bucket_bytes` of gathered tensors; rank 0 keeps CPU copies, the others drop each
        bucket. The gather is finished before the engine sees a tensor, so no collective can
        interleave with the engine's transfer (see `gather`)."""
        from asyncroll.distributed import gather

        if self.rank == 0 and producer is None:
            raise ValueError("rank 0 owns the rollouts: give it the producer")
        await self._collective("update_weights", gather.check_same_parameters, model, self._control)
        full = await self._collective(
            "update_weights", gather.full_weights, model, keep=self.rank == 0,
            bucket_bytes=bucket_bytes, adapter=adapter,
        )  # fmt: skip
        if self.rank == 0:
            assert producer is not None
            weights = gather.adapter_from(model, full.tensors) if adapter else full.tensors
            version = await self._alone("update_weights", lambda: producer.update_weights(weights))
        else:
            _, version = await self._follow("update_weights")
        self.last_gather, self.last_version = full.stats, version
        return version

    async def decide(self, value: bool | None) -> bool:
        """Rank 0's `value` on every rank (the others give None): a decision that must be
        the same everywhere, such as ending the loop early once the task is solved."""
        if self.rank == 0:
            if value is None:
                raise ValueError("rank 0 decides: give it True or False")
            await self._send_header(_Message.DONE, "decide", int(value))
            return value
        _, sent = await self._follow("decide")
        return bool(sent)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` off the event loop, for the trainer's step on every rank
        (`train_step`: its forward and backward run FSDP's or DDP's collectives). Use it
        rather than `asyncio.to_thread`: it runs in a daemon thread, so a collective that a
        failed run leaves waiting cannot hold the process open at exit (a worker thread of
        asyncio's would, until the collective's timeout), and a collective that fails
        because another rank died raises `RankFailed` naming that rank."""
        return await self._collective("the trainer's step", fn, *args, **kwargs)

    async def alone(self, phase: str, work: Callable[[], Awaitable[T]] | None) -> T | None:
        """Run `work` on rank 0 while the others wait (give None there), e.g. a checkpoint of
        the producer or an evaluation; a failure there ends every rank (`RankFailed`)."""
        if self.rank == 0:
            if work is None:
                raise ValueError("rank 0 runs the work: give it the callable")
            return await self._alone(phase, work)
        await self._follow(phase)
        return None

    # -- rank 0 working alone, the others following ---------------------------------------

    async def _alone(self, phase: str, work: Callable[[], Awaitable[T]]) -> T:
        """Await `work()` on rank 0, telling the others every `keepalive_s` that it goes on,
        then that it ended (its int result rides along: a version) or how it failed."""
        task = asyncio.ensure_future(work())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.keepalive_s)
                if done:
                    break
                await self._send_header(_Message.KEEPALIVE, phase)
        except BaseException:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise
        exc = task.exception()
        if exc is not None:
            message = f"{type(exc).__name__}: {exc}".strip().encode()
            await self._send_header(_Message.ERROR, phase)
            await self._collective(phase, _broadcast_bytes, message, self._control)
            raise exc
        result = task.result()
        if result is None:
            await self._send_header(_Message.STOP, phase)
            return result
        value = result if isinstance(result, int) and not isinstance(result, bool) else 0
        await self._send_header(_Message.DONE, phase, value)
        return result

    async def _follow(self, phase: str) -> tuple[_Message, int]:
        """Wait (ranks > 0) until rank 0 ends its work alone in `phase`: (kind, value)."""
        while True:
            kind, sent_phase, step, value = await self._collective(phase, self._receive_header)
            if (sent_phase, step) != (_phase_code(phase), self._steps):
                raise RankFailed(
                    f"rank 0 is at {_phase_name(sent_phase)} of step {step}, rank {self.rank} at "
                    f"{phase} of step {self._steps}: every rank must make the same Ranks calls "
                    "in the same order",
                    rank=self.rank,
                )
            if kind is _Message.KEEPALIVE:
                continue
            if kind is _Message.ERROR:
                message = await self._collective(phase, _broadcast_bytes, b"", self._control)
                raise RankFailed(f"rank 0 failed in {phase}: {message.decode()}", rank=0)
            return kind, value

    async def _send_header(self, kind: _Message, phase: str, value: int = 0) -> None:
        header = torch.tensor(
            [int(kind), _phase_code(phase), self._steps, value], dtype=torch.int64
        )
        await self._collective(phase, dist.broadcast, header, 0, group=self._control)

    def _receive_header(self) -> tuple[_Message, int, int, int]:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self._control)
        kind, phase, step, value = (int(x) for x in header)
        return _Message(kind), phase, step, value

    def _scatter(self, payloads: list[bytes] | None) -> bytes:
        """Rank 0's `payloads[r]` to each rank r: the sizes, then the bytes padded to the
        largest (gloo scatters tensors of one size)."""
        sizes = torch.zeros(self.world_size, dtype=torch.int64)
        if payloads is not None:
            sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
        dist.broadcast(sizes, 0, group=self._control)
        width = int(sizes.max())
        out = torch.empty(width, dtype=torch.uint8)
        chunks = None
        if payloads is not None:
            chunks = [_padded(p, width) for p in payloads]
        dist.scatter(out, chunks, src=0, group=self._control)
        return out[: int(sizes[self.rank])].numpy().tobytes()

    # -- collectives with named failures --------------------------------------------------------

    async def _collective(self, phase: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` (blocking: a collective) in a thread of its own, so that the
        event loop (rank 0's producer and engine) runs meanwhile; a failure becomes
        `RankFailed` naming the rank that caused it. The thread is a daemon: a collective
        that the run's end leaves waiting cannot keep the process alive."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        thread = threading.Thread(target=run, name=f"asyncroll-{phase}", daemon=True)
        thread.start()
        try:
            result = await future
            thread.join()  # it has only to return: gone before the next collective starts
            return result
        except Exception as exc:
            if isinstance(exc, RankFailed) or not _collective_error(exc):
                raise  # this rank's own error: `__aexit__` reports it
            raise self._failure(phase, f"{type(exc).__name__}: {exc}") from exc

    def _failure(self, phase: str, seen: str) -> RankFailed:
        """What ended the run, as well as this rank can tell: the first rank that wrote an
        error, else a rank whose process is gone, else the phase nobody finished."""
        reports = {r: text for r, text in self._reports().items() if r != self.rank}
        if reports:
            rank = min(reports)
            return RankFailed(
                f"rank {rank} failed: {reports[rank]} (rank {self.rank} was in {phase})",
                rank=rank,
            )
        dead = self._dead_ranks()
        if dead:
            rank = dead[0]
            return RankFailed(
                f"rank {rank} (pid {self._pids[rank]}) died without an error (killed: SIGKILL, "
                f"out of memory?) while rank {self.rank} was in {phase}",
                rank=rank,
            )
        if self._terminated:
            return RankFailed(
                f"rank {self.rank} was sent SIGTERM (by its launcher, or a person) in {phase}; "
                "no rank reported an error",
                rank=None,
            )
        return RankFailed(
            f"rank {self.rank} in {phase}: {seen}; every rank is alive and none reported an "
            f"error: a rank did not join within timeout_s={self.timeout_s:g} s (its loop makes "
            "other calls, or hangs)",
            rank=None,
        )

    def _reports(self) -> dict[int, str]:
        if self._folder is None:
            return {}
        out = {}
        for rank in range(self.world_size):
            with contextlib.suppress(OSError):
                out[rank] = (self._folder / f"rank{rank}.error").read_text()
        return out

    def _dead_ranks(self, wait_s: float = 2.0) -> list[int]:
        """Ranks whose process is gone or a zombie. A peer's sockets close while its
        process ends, so it may still exist for a moment: looked at for up to `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [r for r, pid in enumerate(self._pids) if r != self.rank and not _alive(pid)]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)


_NAMES: dict[int, str] = {}


def _phase_code(phase: str) -> int:
    """A phase's number on the wire (ranks compare them to catch loops that differ)."""
    code = zlib.crc32(phase.encode()) & 0x7FFFFFFF
    _NAMES[code] = phase
    return code


def _phase_name(code: int) -> str:
    return _NAMES.get(code, "a call this rank never made")


def _collective_error(exc: Exception) -> bool:
    """Whether `exc` is how torch.distributed reports a failed collective (gloo's and NCCL's
    errors are RuntimeErrors naming their backend)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        word in text for word in ("gloo", "NCCL", "Connection closed", "Connection reset")
    )


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _settle(future: asyncio.Future[T], result: T | None, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)  # type: ignore[arg-type]


def _padded(data: bytes, width: int) -> torch.Tensor:
    out = torch.zeros(width, dtype=torch.uint8)
    if data:
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _broadcast_bytes(data: bytes, group: Any) -> bytes:
    """`data` from rank 0 to every rank (the others pass anything)."""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, 0, group=group)
    if not int(size):
        return b""
    buf = (
        _padded(data, int(size))
        if dist.get_rank() == 0
        else torch.empty(int(size), dtype=torch.uint8)
    )
    dist.broadcast(buf, 0, group=group)
    return buf.numpy().tobytes()
