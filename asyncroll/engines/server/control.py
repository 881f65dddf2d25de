"""The control calls of `VLLMServerEngine`: pause, resume, the frame every weight update runs
in, and the calls on every replica that they share.

Why a module of its own. These are the calls that change what the engine lets through
(admission, `Dispatch`) and what the replicas in the rotation are asked to do; requests only
read admission (`request_path`), updates only run inside the frame (`updates`), and each
replica's own state is its supervisor's (`supervisor`). Each of them holds the control lock
(`ControlState`) from start to end, and hands the end (the resume that undoes a pause, the
lock given back) to a task of the engine's own (`ReplicaControl._end_control`): a caller that gives
up part-way is not held, and the replicas are never left paused while the engine counts
them up (a resume cancelled before it was sent once did that).

A replica that fails a call here leaves the rotation (`ReplicaControl.down`); one that refuses the
weights, or is found restarted, is synced again at once (UNSYNCED). No replica up is a state,
not death: the calls go on with the replicas that are up, and each one that comes back is
synced to what the engine serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence

from asyncroll._core.tasks import Tasks
from asyncroll._core.wakeup import Signal
from asyncroll.engines.base import EngineDeadError
from asyncroll.engines.server import supervisor as sup
from asyncroll.engines.server.client import ReplicaClient
from asyncroll.engines.server.nccl import NcclGroup
from asyncroll.engines.server.replicas import (
    Replica,
    ReplicaError,
    ReplicaState,
    UnsyncedReplicaError,
)
from asyncroll.engines.vllm.weight_check import WeightMismatchError


class Dispatch(enum.Enum):
    """Whether `generate` may send requests to the replicas now."""

    OPEN = "open"
    HELD = "held"  # paused or updating weights: requests wait here, not in a paused vLLM


class ReplicaControl:
    """Pauses, resumes and the update frame of one engine (see the module docstring), and
    the one writer of `admission`. `supervisors`: each replica's (filled by the engine once,
    at its construction); `progress`: notified whenever something a request may wait on
    changed; `tasks`: the engine's, for the ends that outlive their caller."""

    def __init__(
        self,
        replicas: list[Replica],
        state: sup.ControlState,
        client: ReplicaClient,
        supervisors: Mapping[Replica, sup.Supervisor],
        progress: Signal,
        tasks: Tasks,
        *,
        pause_timeout_s: float,
        health_interval_s: float,
    ) -> None:
        self._replicas = replicas
        self._state = state
        self._client = client
        self._supervisors = supervisors
        self._progress = progress
        self._tasks = tasks
        self._pause_timeout_s = pause_timeout_s
        self._health_interval_s = health_interval_s
        self.admission = Dispatch.OPEN
        self.group = NcclGroup(client, self.on_every, self.down, self.states)

    # -- pause and resume ------------------------------------------------------------------------

    async def pause(self) -> None:
        """`VLLMServerEngine.pause_generation`: hold admission, then pause every UP replica
        (keep mode); a pause whose caller gives up part-way is undone (`_end_control`). It
        waits for no replica's sync (`revive_due`): one that joins later reads under the
        control lock whether the engine is paused, and is paused then."""
        self._check_open()
        self.revive_due()
        await self._state.acquire()
        paused_before, done = self._state.paused, False
        try:
            self._check_open()
            self.admission = Dispatch.HELD
            self._state.paused = True
            await self.pause_up()
            done = True
        finally:
            undo = done or paused_before or self._state.closed
            await self._end_control(None if undo else self._reopen)

    async def resume(self) -> None:
        """`VLLMServerEngine.resume_generation`: resume every UP replica and open admission;
        one cut part-way is finished by the engine's own task. Like a pause, it waits for no
        replica's sync."""
        self._check_open()
        self.revive_due()
        await self._state.acquire()
        done = False
        try:
            self._check_open()
            await self._reopen()
            done = True
        finally:
            await self._end_control(None if done or self._state.closed else self._reopen)

    async def pause_up(self) -> None:
        """Pause every UP replica (keep mode: running requests keep their tokens and KV
        cache), within `pause_timeout_s` each; one that fails leaves the rotation."""
        await self._each_up(sup.PAUSE)

    async def _each_up(self, path: str) -> None:
        timeout_s = self._pause_timeout_s
        await self.on_every_up(lambda r: self._client.call(r, "POST", path, timeout_s=timeout_s))

    @contextlib.asynccontextmanager
    async def frozen(self) -> AsyncIterator[None]:
        """A weight update's frame: under the control lock, admission held; afterwards (also
        after a failure, or its caller giving up) every replica resumed and admission
        released, unless the caller had paused (`_end_control`)."""
        self._check_open()
        await self._revive_before_update()
        await self._state.acquire()
        paused_before = self._state.paused
        try:
            self._check_open()
            self.admission = Dispatch.HELD
            yield
        finally:
            reopen = not paused_before and not self._state.closed
            await self._end_control(self._reopen if reopen else None)

    async def _end_control(self, cleanup: Callable[[], Awaitable[None]] | None) -> None:
        """End a pause, resume or update (the control lock held): `cleanup` (the resume
        that undoes its pause), then the lock given back, in a task of the engine's own.
        The caller waits for it unless it gives up (its deadline: an asyncio timeout, which
        cancels once and is not waited past, or an anyio cancel scope, which cancels every
        await in it): the cleanup still reaches every replica, and the
        next pause or update, waiting for the lock, comes after it. A resume cancelled
        before it was sent once left replicas paused while the engine counted them up."""

        async def end() -> None:
            try:
                if cleanup is not None and not self._state.closed:
                    with contextlib.suppress(EngineDeadError):
                        await cleanup()
            finally:
                self._state.release()

        task = self._tasks.spawn(end(), name="control-cleanup")
        current = asyncio.current_task()
        if current is None or not current.cancelling():  # a caller giving up is not held
            await asyncio.shield(task)

    async def _reopen(self) -> None:
        """Under the control lock: resume every replica that is up and let held requests
        go, whatever the resume did."""
        try:
            await self._each_up("/resume")
        finally:
            self._state.paused = False
            self.admission = Dispatch.OPEN
            self._progress.notify()

    # -- calls on every replica ------------------------------------------------------------------

    async def on_every_up(self, call: Callable[[Replica], Awaitable[object]]) -> list[Replica]:
        """`call` on every UP replica at once (`on_every`); those that succeeded. None up
        is no error: what the replicas must serve is the engine's state, which each one
        that comes back is synced to. When every replica asked refused the weights
        (`WeightMismatchError`), that refusal is raised: the weights are at fault."""
        asked = [r for r in self._replicas if r.state is ReplicaState.UP]
        refusals: list[BaseException] = []
        done = await self.on_every(asked, call, refusals)
        if asked and len(refusals) == len(asked):
            raise WeightMismatchError(
                f"every replica refused the weights: {'; '.join(map(str, refusals))}"
            )
        return done

    async def on_every(
        self,
        replicas: Sequence[Replica],
        call: Callable[[Replica], Awaitable[object]],
        refusals: list[BaseException] | None = None,
    ) -> list[Replica]:
        """`call` on each of `replicas` at once; one that fails (`ReplicaError`) leaves the
        rotation, any other error is raised. A refusal of the weights
        (`replica_load.ReplicaWeightsError`: it may hold part of them) leaves it UNSYNCED,
        synced again at once with the engine's weights, and is added to `refusals`; so does
        a replica found restarted (`UnsyncedReplicaError`). Those that succeeded, in order."""
        results = await _each(call(r) for r in replicas)
        for replica, result in zip(replicas, results, strict=True):
            refused = isinstance(result, WeightMismatchError)
            restarted = isinstance(result, UnsyncedReplicaError)
            if isinstance(result, ReplicaError) and (refused or restarted):
                if refusals is not None and refused:
                    refusals.append(result)
                replica.mark_unsynced(str(result))
                self.leave_group(replica)
                self._progress.notify()
            elif isinstance(result, ReplicaError):
                self.down(replica, result)
            elif isinstance(result, BaseException):
                raise result
        return [
            r
            for r, result in zip(replicas, results, strict=True)
            if not isinstance(result, BaseException)
        ]

    # -- the rotation ----------------------------------------------------------------------------

    def revive_due(self) -> None:
        """Start a sync of every new replica and of every down one due for a probe, each in
        its own task (its supervisor's). Nobody waits for them: a request waits for a
        replica's state within its own deadline, a pause or update goes on with the
        replicas that are up (one whose probe or reload hangs stalls nobody)."""
        now = asyncio.get_running_loop().time()
        for supervisor in self._supervisors.values():
            if supervisor.due(now):
                supervisor.start()

    async def _revive_before_update(self) -> None:
        """Before an update: the due syncs started and, when no replica is up, waited for up
        to `pause_timeout_s` (within the caller's own deadline: cancelling this wait leaves
        the syncs running), so that a replica that is synced quickly (at the engine's start,
        above all) takes part. Not before a pause or resume: it would add to their bound."""
        self.revive_due()
        syncing = [s.task for s in self._supervisors.values() if s.task is not None]
        if syncing and not any(r.state is ReplicaState.UP for r in self._replicas):
            await asyncio.wait(syncing, timeout=self._pause_timeout_s)

    async def check_replicas(self) -> None:
        """`VLLMServerEngine.check_replicas`: sync every replica not up now, at once."""
        await asyncio.gather(
            *(
                s.sync(now=True)
                for r, s in self._supervisors.items()
                if r.state is not ReplicaState.UP
            )
        )

    def down(self, replica: Replica, exc: BaseException) -> None:
        """`replica` leaves the rotation, and the NCCL group: its workers may be new
        processes when it answers again, so the next update rebuilds the group."""
        loop = asyncio.get_running_loop()
        replica.fail(str(exc), loop.time(), self._health_interval_s)
        self.leave_group(replica)
        self._progress.notify()

    def leave_group(self, replica: Replica) -> None:
        self.group.leave(replica)

    def failed(self, replica: Replica, exc: ReplicaError) -> None:
        """A call to `replica` failed outside the control calls (a request, an abort, an
        adapter's unload): its supervisor checks whether it stays (`Supervisor.failed`);
        nobody waits for the check (requests sent there later wait for its outcome, each
        within its own deadline)."""
        self._supervisors[replica].failed(exc)

    def states(self) -> str:
        """Every replica's state and last error, for an error message."""
        return "; ".join(f"{r.url} {r.state.value} ({r.error})" for r in self._replicas)

    def _check_open(self) -> None:
        if self._state.closed:
            raise EngineDeadError("VLLMServerEngine is closed")


async def _each(calls: Iterable[Awaitable[object]]) -> list[object]:
    """Run `calls` at once; each one's result or exception, in order. Not `asyncio.gather`:
    cancelled, a gather raises a `CancelledError` of its own making, which an anyio cancel
    scope (the producer's, around a pause) does not recognise as its own and lets escape
    (the control-plane simulation found it); here the caller's own cancellation is raised,
    and the calls are cancelled."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
            task.add_done_callback(_retrieve)
        raise
    return [_outcome(t) for t in tasks]


def _outcome(task: asyncio.Future[object]) -> object:
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception() or task.result()


def _retrieve(task: asyncio.Future[object]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a call cut with its caller is no unhandled error
