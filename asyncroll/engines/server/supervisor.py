"""The control plane of `VLLMServerEngine`: the engine-wide state that pauses, resumes and
weight updates change, and one supervisor per replica that alone probes, re-syncs and
admits that replica.

Why this shape. A replica's failure must cost that replica only. So:

* A supervisor holds nothing another replica needs. Its probe and reload (`/health`,
  `/pause`, a full reload: each with its own deadline) hold only its replica's lock, never
  the engine-wide control lock. It loads a snapshot of what the engine serves
  (`ControlState.snapshot`), then joins (`Supervisor._join`): under the control lock it
  catches up on what ran since (a relabel, a pause or resume: a call each, never a reload
  unless the weights themselves changed), and it enters the rotation only if nothing ran
  while its engine core was tried. (A probe once held the engine-wide lock through a full
  reload, and a pause waiting for it outlived the producer's `abort_timeout_s`; a re-sync
  that started over after every pause, resume or update never came back when it reloaded
  more slowly than their gap.)
* A replica is paused before it is re-synced: one that left the rotation may still stream
  requests of its own, and none may see its weights change unpaused.
* Liveness exercises the engine core: a one-token generate (`ReplicaClient.check_alive`),
  not vLLM's `/health`, which a hung engine core passes. A failing replica is a circuit
  breaker: out of the rotation, probed again after a delay that doubles with each failure in
  a row (`replicas.backoff_s`), back in once a re-sync and a liveness probe pass.
* Paused replicas cannot generate (vLLM queues the request), and `/health` proves nothing of
  a hung core: a failure's check waits for the resume, then generates (requests to the
  replica wait for the check, each within its own deadline); a probe that a `/pause`
  overtook proves nothing (`ProbeOvertaken`) and is tried again after the resume; a replica
  whose generate failed (`CoreHealth.HUNG`) is not re-synced while the engine is paused.
* Nobody waits on a supervisor's task: callers wait for a replica's state, bounded by their
  own deadline and ended by their abort (`VLLMServerEngine._wait`).
"""

from __future__ import annotations

import asyncio
import contextlib
import typing
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from asyncroll._core.wakeup import Signal
from asyncroll.engines.base import EngineDeadError
from asyncroll.engines.server.client import ReplicaClient
from asyncroll.engines.server.replicas import (
    CoreHealth,
    ProbeOvertaken,
    Replica,
    ReplicaError,
    ReplicaState,
    UnsyncedReplicaError,
)
from asyncroll.engines.server.weights import Broadcast, Checkpoint, Served, WeightFolders

PAUSE = "/pause?mode=keep&clear_cache=false"

Load = Callable[[Replica, Checkpoint | None, int], Awaitable[None]]
"""Load a folder (None: keep the weights) on one paused replica, reset its cache, label it."""
OwnModel = Callable[[Replica], Awaitable[Path]]
"""The model folder one replica was started from (`replica_load.own_model`)."""


class Snapshot(typing.NamedTuple):
    epoch: int
    weights: Served
    version: int
    paused: bool
    adapter: object  # the LoRA adapter every request is sent with (None: the base weights)


class ControlState:
    """What every replica in the rotation serves (weights, version label, adapter, paused or
    not), changed only by a pause, resume or update holding `lock`; `epoch` moves as each
    starts and ends, which tells a supervisor that synced meanwhile to catch up.

    The lock is taken by `acquire` and given back by `release`, possibly by another task: a
    pause or update whose caller gave up hands its cleanup (the resume) to a task of the
    engine's own, which releases the lock only after it; the next pause waits for it, so a
    replica sees the calls in the order they were made. A supervisor's join takes it through
    `joining`, which lets every pause, resume or update waiting for it go first: a pause
    waits for one holder at most (`VLLMServerEngine.pause_bound_s`), not for the join of
    every replica that re-synced meanwhile, one after the other."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.epoch = 0
        self.weights: Served = None  # None: each replica serves its own
        self.version = 0
        self.adapter: object = None
        self.paused = False
        self.closed = False
        self.busy = False  # a pause, resume or update holds the lock (not a supervisor's join)
        self.waiting = 0  # pauses, resumes and updates waiting for the lock
        self.changed = Signal()  # a pause, resume or update ended (or the engine closed)

    async def acquire(self) -> None:
        self.waiting += 1
        try:
            await self.lock.acquire()
        except BaseException:
            self.waiting -= 1
            self.changed.notify()  # a join that let it go first looks again
            raise
        self.waiting -= 1
        self.epoch += 1
        self.busy = True

    @contextlib.asynccontextmanager
    async def joining(self) -> AsyncIterator[None]:
        """The lock, for a supervisor's join: taken only while no pause, resume or update
        waits for it (one that queued behind it gives it back at once, and waits for their
        end: `release` notifies `changed`)."""
        while True:
            await self.changed.wait_until(lambda: self.waiting == 0)
            await self.lock.acquire()
            if self.waiting == 0:
                break
            self.lock.release()
        try:
            yield
        finally:
            self.lock.release()

    def release(self) -> None:
        self.epoch += 1
        self.busy = False
        self.lock.release()
        self.changed.notify()  # the lock is free, and `paused` may have changed

    @property
    def may_be_paused(self) -> bool:
        """Whether the replicas in the rotation may be paused now: the engine is, or a pause,
        resume or update is under way (an update pauses them without pausing the engine). A
        liveness generate would wait for the resume then."""
        return self.paused or self.busy

    def snapshot(self) -> Snapshot:
        return Snapshot(self.epoch, self.weights, self.version, self.paused, self.adapter)

    def moved_since(self, snapshot: Snapshot) -> bool:
        """Whether a pause, resume or update ran (or runs) since `snapshot`."""
        return self.epoch != snapshot.epoch or self.busy


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
        await load(replica, Checkpoint.seal(await own(replica)), version)
        replica.loaded = None  # its own weights again
    else:
        await load(replica, weights, version)
    return ReplicaState.UP


class Supervisor:
    """One replica's probes, re-syncs and failures (see the module docstring). `on_down`:
    the engine's bookkeeping when it leaves the rotation (the NCCL group, above all);
    `on_unsynced`: when it turns out to serve weights the engine never gave it; `relabel`:
    set its version label; `on_change`: its state changed, or a sync or check ended (the
    engine's requests waiting on it look again)."""

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
        *,
        relabel: Callable[[Replica, int], Awaitable[None]],
        on_change: Callable[[], None],
        pause_timeout_s: float,
    ) -> None:
        self.replica = replica
        self._state = state
        self._client = client
        self._folders = folders
        self._load = load
        self._own = own
        self._on_down = on_down
        self._on_unsynced = on_unsynced
        self._relabel = relabel
        self._on_change = on_change
        self._pause_timeout_s = pause_timeout_s
        self.task: asyncio.Task[None] | None = None  # the sync in progress, if any
        self.check: asyncio.Task[None] | None = None  # the liveness check after a failure

    def idle(self) -> bool:
        """No sync of its replica under way (what a request waits for, within its deadline)."""
        return self.task is None

    def unchecked(self) -> bool:
        """No liveness check of its replica under way (the same)."""
        return self.check is None

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
        """Its sync in a task of its own (the one in progress, if any): nobody waits on the
        task itself (a request waits for the replica's state, bounded by its own deadline),
        and a caller that gives up does not cancel it."""
        if self.task is None:
            task = self.task = asyncio.ensure_future(self.sync())
            task.add_done_callback(self._ended)
        return self.task

    def _ended(self, task: asyncio.Task[None]) -> None:
        if self.task is task:
            self.task = None
        self._on_change()

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
                if not self._untriable():  # else out until the resume (the next route's probe)
                    await self._client.call(replica, "POST", PAUSE)
                    while not await self._resync():
                        pass
            except (ReplicaError, ValueError) as exc:  # ValueError: a folder gone or changed
                self._on_down(replica, exc)

    async def _resync(self) -> bool:
        """One load of the weights the engine serves now, on the paused replica, then
        `_join`. Whether it is done: not when the weights (or the adapter) changed while it
        loaded, which takes another load."""
        replica, snapshot = self.replica, self._state.snapshot()
        with self._folders.pin(snapshot.weights):
            state = await catch_up(
                replica, snapshot.weights, snapshot.version, self._load, self._own
            )
        if state is not ReplicaState.UP:  # STALE: it takes the next broadcast
            replica.state = state
            self._on_change()
            return True
        return await self._join(snapshot)

    async def _join(self, loaded: Snapshot) -> bool:
        """Into the rotation, serving `loaded`'s weights: under the control lock it catches
        up on what ran since it loaded (`_catch_up`), then its engine core is tried, outside
        the lock (a probe holds nothing a pause needs). It joins then if nothing ran
        meanwhile; else it catches up once more under the lock and joins there: a call or
        two, never a reload nor another probe (a re-sync once started over after every
        pause, resume or update, and a replica that reloaded, or answered a probe, more
        slowly than their gap never came back). False: the weights changed (or it
        restarted), load again."""
        label, probed = loaded.version, False
        while True:
            async with self._state.joining():  # no epoch of its own: it changes nothing
                now = self._state.snapshot()
                if now.weights != loaded.weights or now.adapter is not loaded.adapter:
                    return False
                if self._state.closed:
                    return True
                caught_up = await self._catch_up(now, label)
                if caught_up is None:
                    return False  # restarted since its load: its own weights again, reload
                label = caught_up
                if probed:  # its core answered; what ran since is caught up on, under the lock
                    return self._joined()
            try:
                await self._client.check_alive(self.replica, paused=now.paused)
            except ProbeOvertaken:
                continue
            if _closed(self._state):
                return True
            if not self._state.moved_since(now):
                return self._joined()  # no await since the check: nothing ran in between
            probed = True  # a pause, resume or update ran while it was tried: catch up, join

    async def _catch_up(self, now: Snapshot, label: int) -> int | None:
        """Under the control lock: the replica given `now`'s label (it carries `label`, the
        one it was last given) and paused or resumed as `now` says; the label it carries
        then (None: it restarted since its load). Within one `pause_timeout_s` in all, the
        lock's whole hold: a pause waiting for the lock waits for this at most
        (`VLLMServerEngine.pause_bound_s`); a replica that cannot answer a few calls
        within it is no replica to join."""
        replica = self.replica
        try:
            async with asyncio.timeout(self._pause_timeout_s):
                if not await self._carries(str(label)):
                    return None
                if now.version != label:
                    try:
                        await self._relabel(replica, now.version)
                    except UnsyncedReplicaError:
                        return None  # restarted just now: the label found another process
                path = PAUSE if now.paused else "/resume"
                await self._client.call(replica, "POST", path, timeout_s=self._pause_timeout_s)
        except TimeoutError:
            message = (
                f"catching up under the control lock: no reply within {self._pause_timeout_s} s"
            )
            raise ReplicaError(replica.url, message) from None
        return now.version

    def _joined(self) -> bool:
        self.replica.mark_up()
        self._on_change()
        return True

    async def _carries(self, label: str) -> bool:
        """Whether the replica still carries `label` (the one its load set): one that
        restarted since carries vLLM's initial one over its own weights, and a relabel would
        put the engine's label on them (the control-plane simulation found it)."""
        reply = await self._client.call(
            self.replica, "GET", "/weight_info", timeout_s=self._pause_timeout_s
        )
        return isinstance(reply, dict) and reply.get("weight_version") == label

    def failed(self, exc: ReplicaError) -> asyncio.Task[None] | None:
        """A call to the replica failed: it leaves the rotation unless its engine core is
        alive (then only that call failed). One check at a time: the failures of every
        request it was serving share it. The check's task (None: nothing to check); nobody
        waits for it (requests to the replica wait for its state). One that served weights
        the engine never gave it is a new process: out of the rotation (and the NCCL group)
        until synced again, whatever its probe says."""
        replica = self.replica
        if isinstance(exc, UnsyncedReplicaError):
            if replica.state is ReplicaState.UP:
                replica.mark_unsynced(str(exc))
                self._on_unsynced(replica)
                self._on_change()
            return None
        if replica.state is not ReplicaState.UP:
            return None
        if self.check is None:
            check = self.check = asyncio.ensure_future(self._check(exc))
            check.add_done_callback(self._checked)
            self._on_change()
        return self.check

    def _checked(self, task: asyncio.Task[None]) -> None:
        if self.check is task:
            self.check = None
        self._on_change()

    async def _check(self, exc: ReplicaError) -> None:
        """Whether the replica stays: a one-token generate, never `/health` alone (which a
        hung engine core passes: a wedged replica stayed in the rotation through every
        check made while an update ran). While the replicas may be paused a generate would
        wait for the resume, so the check waits for it first, and tries again when a pause
        overtook its generate; meanwhile no request is sent there (they wait for this
        check, each bounded by its own deadline)."""
        replica, state = self.replica, self._state
        try:
            while True:
                await state.changed.wait_until(lambda: not state.may_be_paused or state.closed)
                if state.closed or not _up(replica):  # it left the rotation meanwhile
                    return
                try:
                    await self._client.check_alive(replica, paused=False)
                    return
                except ProbeOvertaken:
                    continue
        except ReplicaError as probe:
            if _up(replica):
                self._on_down(replica, ReplicaError(replica.url, f"{exc}; then {probe}"))
        except EngineDeadError:
            pass  # the engine closed under it: nothing left to decide


def _closed(state: ControlState) -> bool:
    """`state.closed`, read through a call: it changes across awaits."""
    return state.closed


def _up(replica: Replica) -> bool:
    """Whether `replica` is up, read through a call: its state changes across awaits, which
    mypy's narrowing does not know."""
    return replica.state is ReplicaState.UP
