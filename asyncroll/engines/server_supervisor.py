"""The control plane of `VLLMServerEngine`: the engine-wide state that pauses, resumes and
weight updates change, and one supervisor per replica that alone probes, re-syncs and
admits that replica.

Why this shape. A replica's failure must cost that replica only. So:

* A supervisor holds nothing another replica needs. Its probe and re-sync (`/health`,
  `/pause`, a full reload, the label, `/resume`, a liveness generate: each with its own
  deadline) hold only its replica's lock, never the engine-wide control lock. It works from
  a snapshot of what the engine serves (`ControlState.snapshot`) and puts its replica in the
  rotation only if no pause, resume or update ran meanwhile; else it syncs again after it.
  (A probe once held the engine-wide lock through a full reload, and a pause waiting for it
  outlived the producer's `abort_timeout_s` while another replica served.)
* A replica is paused before it is re-synced: one that left the rotation may still stream
  requests of its own, and none may see its weights change unpaused.
* Liveness exercises the engine core: a one-token generate (`ReplicaClient.check_alive`),
  not vLLM's `/health`, which a hung engine core passes. A failing replica is a circuit
  breaker: out of the rotation, probed again after a delay that doubles with each failure in
  a row (`replicas.backoff_s`), back in once a re-sync and a liveness probe pass.
* Paused replicas cannot generate (vLLM queues the request), and `/health` proves nothing of
  a hung core: a failure's check waits for the resume, then generates (no request is sent
  to the replica meanwhile); a replica whose generate failed (`CoreHealth.HUNG`) is not re-synced
  while the engine is paused, but after the resume. Checks made during the chaos run's
  updates (every 0.4 s) had let a wedged replica stay, or come back, on `/health` alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import typing
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from asyncroll._signal import Signal
from asyncroll.engines.base import EngineDeadError
from asyncroll.engines.replicas import (
    CoreHealth,
    Replica,
    ReplicaError,
    ReplicaState,
    UnsyncedReplicaError,
)
from asyncroll.engines.server_client import ReplicaClient
from asyncroll.engines.server_weights import Broadcast, Served, WeightFolders

PAUSE = "/pause?mode=keep&clear_cache=false"

Load = Callable[[Replica, Path | None, int], Awaitable[None]]
"""Load a folder (None: keep the weights) on one paused replica, reset its cache, label it."""
OwnModel = Callable[[Replica], Awaitable[Path]]
"""The model folder one replica was started from (`replica_load.own_model`)."""


class Snapshot(typing.NamedTuple):
    epoch: int
    weights: Served
    version: int
    paused: bool


class ControlState:
    """What every replica in the rotation serves (weights, version label, paused or not),
    changed only by a pause, resume or update under `lock`; `epoch` moves as each starts and
    ends, which tells a supervisor that synced meanwhile to sync again."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.epoch = 0
        self.weights: Served = None  # None: each replica serves its own
        self.version = 0
        self.paused = False
        self.closed = False
        self.changed = Signal()  # a pause, resume or update ended (or the engine closed)

    @contextlib.asynccontextmanager
    async def controlling(self) -> AsyncIterator[None]:
        try:
            async with self.lock:
                self.epoch += 1
                try:
                    yield
                finally:
                    self.epoch += 1
        finally:
            self.changed.notify()  # the lock is free, and `paused` may have changed

    @property
    def may_be_paused(self) -> bool:
        """Whether the replicas in the rotation may be paused now: the engine is, or a pause,
        resume or update is under way (an update pauses them without pausing the engine). A
        liveness generate would wait for the resume then."""
        return self.paused or self.lock.locked()

    def snapshot(self) -> Snapshot:
        return Snapshot(self.epoch, self.weights, self.version, self.paused)

    def moved_since(self, snapshot: Snapshot) -> bool:
        """Whether a pause, resume or update ran (or runs) since `snapshot`."""
        return self.epoch != snapshot.epoch or self.lock.locked()


async def catch_up(
    replica: Replica, weights: Served, version: int, load: Load, own: OwnModel
) -> ReplicaState:
    """Give a paused, answering replica `weights` and label `version`: UP then, or STALE
    when they came over NCCL (nothing to load: it receives the next broadcast). Before any
    update committed (`weights` None: each replica serves its own), one that an update
    reached may hold that update's weights, loaded or half-loaded, which its label 0 would
    not name: it reloads the model it was started from (`own`)."""
    if weights is Broadcast.SENT:
        return ReplicaState.STALE
    if weights is None and replica.loaded is not None:
        await load(replica, await own(replica), version)
        replica.loaded = None  # its own weights again
    else:
        await load(replica, weights, version)
    return ReplicaState.UP


class Supervisor:
    """One replica's probes, re-syncs and failures (see the module docstring). `on_down`:
    the engine's bookkeeping when it leaves the rotation (the NCCL group, above all);
    `on_unsynced`: when it turns out to serve weights the engine never gave it."""

    def __init__(
        self,
        replica: Replica,
        state: ControlState,
        client: ReplicaClient,
        folders: WeightFolders,
        load: Load,
        own: OwnModel,
        on_down: Callable[[Replica, BaseException], None],
        on_unsynced: Callable[[Replica], None],
    ) -> None:
        self.replica = replica
        self._state = state
        self._client = client
        self._folders = folders
        self._load = load
        self._own = own
        self._on_down = on_down
        self._on_unsynced = on_unsynced
        self.task: asyncio.Task[None] | None = None  # the sync in progress, if any
        self.check: asyncio.Task[None] | None = None  # the liveness check after a failure

    def due(self, now: float) -> bool:
        """Whether its replica needs a sync now: new (or restarted), or down and past its
        breaker's delay."""
        r = self.replica
        if self._untriable():
            return False
        return r.state is ReplicaState.UNSYNCED or (
            r.state is ReplicaState.DOWN and r.retry_at <= now
        )

    def _untriable(self) -> bool:
        """Whether its replica cannot come back now: its engine core was seen hung, only a
        generate can show it alive again, and a paused engine's replicas cannot generate.
        It stays out of the rotation until the resume lets its probe run (`/health`, which
        a hung core passes, once brought a wedged replica back during every pause)."""
        return self.replica.core is CoreHealth.HUNG and self._state.paused

    def start(self) -> asyncio.Task[None]:
        """Its sync in a task of its own (the one in progress, if any): the engine waits for
        it only when it must, and a caller that gives up does not cancel it."""
        if self.task is None:
            task = self.task = asyncio.ensure_future(self.sync())
            task.add_done_callback(self._ended)
        return self.task

    def _ended(self, task: asyncio.Task[None]) -> None:
        if self.task is task:
            self.task = None

    async def stop(self) -> None:
        """Cancel its sync and check (the engine closes) and wait for them to end."""
        tasks = [t for t in (self.task, self.check) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def sync(self, *, now: bool = False) -> None:
        """Bring the replica into the rotation: answering, paused first, serving the engine's
        weights under its label, resumed unless the engine is paused, its engine core alive.
        Any failure leaves it down until its next probe (`now`: probe even before
        `retry_at`). Concurrent callers wait for the one sync in progress."""
        replica = self.replica
        async with replica.syncing:
            due = now or asyncio.get_running_loop().time() >= replica.retry_at
            if replica.state is ReplicaState.UP or self._state.closed:
                return
            if replica.state is ReplicaState.DOWN and not due:
                return  # probed while this caller waited
            try:
                await self._client.call(
                    replica, "GET", "/health", timeout_s=self._client.health_timeout_s
                )
                while not await self._resync():
                    async with self._state.lock:  # wait for the pause, resume or update
                        pass
            except (ReplicaError, ValueError) as exc:  # ValueError: a folder gone from disk
                self._on_down(replica, exc)

    async def _resync(self) -> bool:
        """One try of `sync` after its health probe. Whether it is done: not when a pause,
        resume or update ran meanwhile (its snapshot may be out of date)."""
        replica, snapshot = self.replica, self._state.snapshot()
        if self._untriable():
            return True  # out until the resume (the route after it probes it again)
        await self._client.call(replica, "POST", PAUSE)
        with self._folders.pin(snapshot.weights):
            state = await catch_up(
                replica, snapshot.weights, snapshot.version, self._load, self._own
            )
        if state is ReplicaState.UP and not snapshot.paused:
            await self._client.call(replica, "POST", "/resume")
        if state is ReplicaState.UP:
            await self._client.check_alive(replica, paused=snapshot.paused)
        if self._state.closed:
            return True
        if self._state.moved_since(snapshot):
            return False
        if state is ReplicaState.UP:
            replica.mark_up()
        else:
            replica.state = state
        return True

    def failed(self, exc: ReplicaError) -> asyncio.Task[None] | None:
        """A call to the replica failed: it leaves the rotation unless its engine core is
        alive (then only that call failed). One check at a time: the failures of every
        request it was serving share it. The check's task (None: nothing to check), for a
        caller that must know the outcome; it runs on when that caller gives up. One that
        served weights the engine never gave it is a new process: out of the rotation (and
        the NCCL group) until synced again, whatever its probe says."""
        replica = self.replica
        if isinstance(exc, UnsyncedReplicaError):
            if replica.state is ReplicaState.UP:
                replica.mark_unsynced(str(exc))
                self._on_unsynced(replica)
            return None
        if replica.state is not ReplicaState.UP:
            return None
        if self.check is None:
            check = self.check = asyncio.ensure_future(self._check(exc))
            check.add_done_callback(self._checked)
        return self.check

    def _checked(self, task: asyncio.Task[None]) -> None:
        if self.check is task:
            self.check = None

    async def _check(self, exc: ReplicaError) -> None:
        """Whether the replica stays: a one-token generate, never `/health` alone (which a
        hung engine core passes: a wedged replica stayed in the rotation through every
        check made while an update ran). While the replicas may be paused a generate would
        wait for the resume, so the check waits for it first; meanwhile no request is sent
        there (`VLLMServerEngine._stream` waits for this check)."""
        replica, state = self.replica, self._state
        try:
            await state.changed.wait_until(lambda: not state.may_be_paused or state.closed)
            if state.closed or not _up(replica):  # it left the rotation meanwhile
                return
            await self._client.check_alive(replica, paused=False)
        except ReplicaError as probe:
            if _up(replica):
                self._on_down(replica, ReplicaError(replica.url, f"{exc}; then {probe}"))
        except EngineDeadError:
            pass  # the engine closed under it: nothing left to decide


def _up(replica: Replica) -> bool:
    """Whether `replica` is up, read through a call: its state changes across awaits, which
    mypy's narrowing does not know."""
    return replica.state is ReplicaState.UP
