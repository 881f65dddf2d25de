"""`ProcessPool`: sync reward calls in worker processes that can be killed.

A thread cannot be killed: a verifier that hangs (a backtracking regex, a sympy simplification
that never ends, a C call that never returns) holds its thread until the trainer's process
exits. A process can: each call here has a hard wall-clock deadline (`timeout_s`, from when the
worker has the call), after which its worker is killed (SIGKILL, with its process group: what
the verifier forked goes too) and replaced, and the call raises `RewardDeadline`. A worker that
dies on its own (a segfault, `os._exit`, `sys.exit`, the OOM killer) fails its call with
`RewardFailure` naming the signal or exit code, and is replaced. A worker is retired after
`max_calls` calls or once its resident memory passes `max_rss_mib`, so a leaking verifier costs
a restart, not the machine.

Built on `multiprocessing` directly (its "forkserver" context: workers are forks of a clean
server process that preloaded asyncroll, safe beside vLLM's threads, where forking the trainer
is not, and quick to replace), with a pipe per worker that the event loop watches
(`add_reader`): no manager thread, and a kill is one system call at the deadline.
`benchmarks/reward_executor.py` measures it against threads and pebble's `ProcessPool`.

Nothing outlives the pool: `close()` (the producer's exit, the end of an evaluation) kills
every worker and its group at once; a worker whose parent dies is killed by the kernel
(`PR_SET_PDEATHSIG`, Linux: a worker's parent is the fork server, which exits with the
trainer); the workers are daemonic, so `multiprocessing` ends them at interpreter exit too.

The reward function is pickled once, when the pool is built: one that cannot be (a lambda, a
function defined inside another) is refused there, naming what failed. It is loaded by
reference in each worker, from its module; a function of a script's `__main__` needs the
script's ``if __name__ == "__main__":`` guard, as all multiprocessing does. The fork server
imports the modules the function loads from when it starts (`modules_of`: those of the pools
built before the first worker starts, the producer's and its evaluators'), so a worker does
not import them again on every start. A start and the reap of a killed worker wait off the
event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

from asyncroll._core import reward_worker

log = logging.getLogger("asyncroll.rewards")
START_TIMEOUT_S = 120.0  # a worker imports the reward function's module (torch, sympy...)
# Imported once by multiprocessing's fork server, so a worker starts as a fork of it in
# milliseconds instead of importing asyncroll anew (most of a fresh interpreter's start), and
# the trainer's script (`__main__`, where a reward function may live: each worker would import
# it, torch and all, again) is imported there once too.
_PRELOAD = ["__main__", "asyncroll", "asyncroll._core.reward_worker"]
# The modules the pools' reward functions load from (`modules_of`), preloaded with the above
# when the fork server starts: a worker that loads its function from a module the server had
# not imported imports it itself, on every start (each evaluation's workers, each replacement
# of a killed or recycled worker), and pays for that module's own imports each time.
_REQUESTED: set[str] = set()
_NOT_MODULES = frozenset({"__main__", "__mp_main__", "builtins", "copyreg"})


def _context(modules: Iterable[str] = ()) -> Any:
    """The "forkserver" context (a clean single-threaded server forks the workers: safe beside
    vLLM's threads, where "fork" of the trainer is not), with asyncroll and `modules`
    preloaded if the server has not started yet; "spawn" where there is no fork server
    (Windows)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    from multiprocessing import forkserver

    if getattr(forkserver._forkserver, "_forkserver_pid", None) is None:  # not started yet
        _REQUESTED.update(modules)
        context.set_forkserver_preload([*_PRELOAD, *sorted(_REQUESTED - set(_PRELOAD))])
    return context


def modules_of(fn_bytes: bytes) -> list[str]:
    """The modules a worker imports to load the pickled function: those its pickle names
    (read here by loading it once, which imports nothing new: the trainer has them all)."""
    recorder = _Recorder(io.BytesIO(fn_bytes))
    with contextlib.suppress(Exception):  # a copy that does not load here: preload nothing
        recorder.load()
    return sorted(recorder.modules - _NOT_MODULES)


class _Recorder(pickle.Unpickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.modules: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.modules.add(module)
        return super().find_class(module, name)


class RewardDeadline(Exception):
    """The reward function ran longer than its deadline (queue time not included); its text
    says so in words that follow the function's name ("took longer than ...")."""


class RewardFailure(Exception):
    """A reward call failed in a way the function's name reads before ("raised KeyError...",
    "crashed its worker process..."); `fatal` when no later call can succeed either."""

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


def pickled(fn: Callable[..., Any], name: str) -> bytes:
    """`fn` pickled for the workers, or `ValueError` naming what could not be sent."""
    try:
        return pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(
            f"reward_executor='process' sends the reward function {name!r} to worker "
            f"processes, and it cannot be pickled ({type(exc).__name__}: {exc}): define it "
            "at module level (a lambda, or a function defined inside another, cannot be "
            "sent), or keep reward_executor='thread'"
        ) from None


GROUP_EXIT_TIMEOUT_S = 5.0


def _wait_groups_gone(groups: list[int], timeout_s: float) -> None:
    """Wait until no process of these process groups runs. A SIGKILL sent to a group is
    acted on when each member is next scheduled, which a loaded machine may put off: a
    verifier's forked child was seen alive just after its worker's group had been killed.
    A group whose worker was reaped and that forked nothing is empty at the first look."""
    deadline = time.monotonic() + timeout_s
    left = [g for g in groups if _group_runs(g)]
    while left:
        if time.monotonic() >= deadline:
            log.warning("reward worker processes still running after SIGKILL: groups %s", left)
            return
        time.sleep(0.01)
        left = [g for g in left if _group_runs(g)]


def _group_runs(pgid: int) -> bool:
    """Whether a process of group `pgid` runs (a zombie, dead but not reaped, does not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    for process in psutil.process_iter(["status"]):
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                return True
    return False


class _Worker:
    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.calls = 0

    def kill(self, *, reap: bool = True) -> None:
        """SIGKILL the worker and its process group (what its verifier forked), then reap it:
        here, or (`reap=False`, on the event loop) in a thread of its own. The reap waits for
        the dying process and the fork server's word of it, which a loaded machine may not
        schedule for a while (100 ms to 1 s each under a load of 12 on 2 cores): on the loop,
        that wait stalled every group in flight."""
        pid = self.process.pid
        if pid is not None:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            if self.process.exitcode is None:  # not reaped yet: the pid is still the worker's
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        self.conn.close()
        if pid is None:
            return
        if reap:
            self.process.join(timeout=5.0)  # a SIGKILLed process is reaped at once
        else:
            threading.Thread(
                target=self.process.join, args=(5.0,), name="asyncroll-reward-reap", daemon=True
            ).start()

    def died(self) -> str:
        """How the worker ended, once its pipe closed."""
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        if code is None:
            return "closed its pipe"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
            return f"was killed by signal {-code}"
        return f"exited with code {code} (sys.exit or os._exit in the reward function?)"


class ProcessPool:
    """At most `workers` sync reward calls at once, each in a worker process (see the module
    docstring). `call` waits for a free worker (queue time, not timed), then runs."""

    def __init__(
        self,
        fn: Callable[[Any], Any],
        name: str,
        *,
        workers: int,
        max_calls: int | None,
        max_rss_mib: float | None,
    ) -> None:
        self._fn_bytes = pickled(fn, name)
        self.name = name
        self.workers = workers
        self.max_calls = max_calls
        self.max_rss_bytes = None if max_rss_mib is None else int(max_rss_mib * 2**20)
        self._context = _context(modules_of(self._fn_bytes))
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._spares: list[asyncio.Task[_Worker]] = []  # replacements being started
        self._slots: asyncio.Semaphore | None = None  # made on the loop that uses it
        self.fatal: str | None = None  # why no call can succeed (the function cannot load)
        self.started = 0  # worker processes started (tests and the curious)
        self.killed = 0  # workers killed: deadlines, crashes, recycling, cancellations
        self.recycled = 0  # of which retired after max_calls or past max_rss_mib

    async def call(self, payload: Any, n: int, timeout_s: float) -> list[float]:
        """The n rewards of one call, checked; `RewardDeadline`, `RewardFailure`, or
        `RolloutError` for a result that is not n finite numbers."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            if self.fatal is not None:
                raise RewardFailure(self.fatal, fatal=True)
            worker = await self._worker()
            self._busy.add(worker)
            keep = False
            try:
                answer = await self._run(worker, payload, n, timeout_s)
                keep = self._keeps(worker, answer[-1])
            finally:
                self._busy.discard(worker)
                if keep:
                    self._idle.append(worker)
                else:  # a deadline, a crash, a cancellation, or retired: never reused
                    self._retire(worker, reap=False)
                    self._spare()
        return self._result(answer)

    def close(self) -> None:
        """Kill every worker now (idle, busy or starting), and return once what their
        verifiers forked has died too (`GROUP_EXIT_TIMEOUT_S`); a later call starts fresh
        ones."""
        groups = []
        for task in self._spares:
            if task.done() and not task.cancelled() and task.exception() is None:
                groups.append(task.result().process.pid)
                self._retire(task.result())
            task.cancel()  # one still starting kills its process as it is cancelled
        self._spares.clear()
        for worker in [*self._idle, *self._busy]:
            groups.append(worker.process.pid)
            self._retire(worker)
        self._idle.clear()
        _wait_groups_gone([g for g in groups if g is not None], GROUP_EXIT_TIMEOUT_S)

    @property
    def alive(self) -> int:
        """Worker processes running now."""
        return len(self._idle) + len(self._busy)

    def pids(self) -> list[int]:
        return [w.process.pid for w in (*self._idle, *self._busy) if w.process.pid is not None]

    def _retire(self, worker: _Worker, *, reap: bool = True) -> None:
        self._busy.discard(worker)
        worker.kill(reap=reap)
        self.killed += 1

    def _keeps(self, worker: _Worker, rss: int) -> bool:
        worker.calls += 1
        spent = self.max_calls is not None and worker.calls >= self.max_calls
        if spent or (self.max_rss_bytes is not None and rss > self.max_rss_bytes):
            self.recycled += 1
            return False
        return True

    @staticmethod
    def _result(answer: tuple[Any, ...]) -> list[float]:
        from asyncroll._core.rollout import RolloutError

        kind, value = answer[0], answer[1]
        if kind == "ok":
            return list(value)
        if kind == "invalid":
            raise RolloutError(value)
        raise RewardFailure(f"raised {value}")

    def _spare(self) -> None:
        """Start a replacement now, while the killed call's group lands: the next call on
        this slot finds it started (or starting) instead of paying a whole start."""
        if self.fatal is None and len(self._spares) + self.alive < self.workers:
            task = asyncio.ensure_future(self._start())
            task.add_done_callback(_retrieved)  # a failed start is the next call's to raise
            self._spares.append(task)

    async def _worker(self) -> _Worker:
        while self._idle:
            worker = self._idle.pop()
            if worker.process.is_alive():
                return worker
            self._retire(worker)  # died while idle (the OOM killer): start another
        if self._spares:
            return await self._spares.pop(0)
        return await self._start()

    async def _start(self) -> _Worker:
        parent, child = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=reward_worker.main,
            args=(child,),
            name=f"asyncroll-reward-{self.started}",
            daemon=True,
        )
        worker = _Worker(process, parent)
        self.started += 1  # here: a start cancelled midway goes on, and is killed after
        # Off the loop: a start waits for the fork server (its preload the first time, seconds;
        # then its fork, which a loaded machine may not schedule for a while).
        starting = asyncio.ensure_future(asyncio.to_thread(process.start))

        def abandoned(_: object) -> None:
            child.close()
            if process.pid is None:  # it never started
                parent.close()
                self.started -= 1
            else:
                worker.kill()
                self.killed += 1

        try:
            await asyncio.shield(starting)
        except BaseException:
            starting.add_done_callback(abandoned)
            raise
        child.close()
        try:
            await asyncio.to_thread(parent.send_bytes, self._fn_bytes)  # may exceed a pipe
            message = await _receive(worker, START_TIMEOUT_S)
        except BaseException:
            worker.kill()
            self.killed += 1
            raise
        if message is None:
            worker.kill()
            self.killed += 1
            self.fatal = (
                f"its worker process did not start within {START_TIMEOUT_S} s (importing the "
                "function's module hung?)"
            )
            raise RewardFailure(self.fatal, fatal=True)
        if isinstance(message, str):  # it died before it was ready
            self.killed += 1
            raise RewardFailure(f"could not start its worker process: it {message}")
        if message[0] == "load_error":
            worker.kill()
            self.killed += 1
            self.fatal = (
                f"could not be loaded in a worker process: {message[1]}; a function must be "
                "importable by its module and name there (a script's functions need its "
                '`if __name__ == "__main__":` guard)'
            )
            raise RewardFailure(self.fatal, fatal=True)
        return worker

    async def _run(self, worker: _Worker, payload: Any, n: int, timeout_s: float) -> Any:
        try:
            worker.conn.send((n, payload))
        except OSError:  # died between two calls, unseen
            raise RewardFailure(f"crashed its worker process: it {worker.died()}") from None
        message = await _receive(worker, timeout_s)
        if message is None:
            raise RewardDeadline(
                f"took longer than reward_timeout_s={timeout_s}: its worker process was killed"
            )
        if isinstance(message, str):
            raise RewardFailure(f"crashed its worker process: it {message}")
        return message


def _retrieved(task: asyncio.Task[_Worker]) -> None:
    if not task.cancelled():
        task.exception()


async def _receive(worker: _Worker, timeout_s: float) -> tuple[Any, ...] | str | None:
    """The worker's next message; None past `timeout_s`; how it died (a string) if its pipe
    closed first."""
    loop = asyncio.get_running_loop()
    arrived: asyncio.Future[None] = loop.create_future()
    fd = worker.conn.fileno()

    def readable() -> None:
        if not arrived.done():
            arrived.set_result(None)

    loop.add_reader(fd, readable)
    try:
        async with asyncio.timeout(timeout_s):
            await arrived
    except TimeoutError:
        return None
    finally:
        loop.remove_reader(fd)
    try:
        message: tuple[Any, ...] = worker.conn.recv()
    except (EOFError, OSError):
        return await asyncio.to_thread(worker.died)
    return message
