"""`RolloutBuffer`: a bounded store of encoded groups that drops failures on arrival.

What it holds is encoded bytes (see `asyncroll.codec`): the byte bound is exact, buffered data
cannot be changed by anyone after `put`, and a checkpoint is a plain copy.

Admission, not `put`, is where backpressure happens. Before a group is started its producer
reserves a slot and the bytes the group can grow to (its prompt, its metadata and every sample
at full length: the producer's estimate, `reserve_bytes` by default); the slot stays with the
group while it is in flight, ready or waiting to resume, and is given back when the group is
handed out or dropped. What the buffer holds plus what is reserved stays within `max_bytes` as
long as no group encodes larger than its reservation (a larger one raises the default for later
reservations). A group waiting to resume takes its reservation again before it restarts.
Because every group that can arrive already holds its slot, `put` never waits and a drain never
deadlocks.

Memory is recycled. A stored group of `RECYCLE_MIN_BYTES` or more is written into a uint8
array of its own (`codec.encode_into`); when the group leaves the buffer, the array is kept as
a spare and holds a later group once nothing references it any more (`_Spares`). A fresh
allocation per group would fault in a fresh page every 4 KiB (glibc hands large freed blocks
back to the kernel), which at 1 MiB groups cost more than encoding them. Spares count against
`max_bytes` (what the buffer holds plus its spares stays within the bound) and are kept only up
to twice what one hand-out cycle stores, so a generous bound does not fill up with them.

The buffer knows only what it holds. Counting what was dropped, and why, is the producer's job:
`put` returns an explicit outcome and `set_version` returns the groups it expired.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import sys
from collections.abc import Callable
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

from asyncroll._core.wakeup import Signal
from asyncroll.codec import decode, encode_into
from asyncroll.types import RolloutGroup, Status

Order = Literal["fifo", "stalest"]


class PutOutcome(enum.StrEnum):
    """What `put` did with a group. Only the two STORED outcomes keep anything."""

    STORED_READY = "stored_ready"
    STORED_RESUME = "stored_resume"
    DROPPED_FAILED = "dropped_failed"
    DROPPED_FILTERED = "dropped_filtered"
    DROPPED_EXPIRED = "dropped_expired"


class BufferStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of what the buffer holds and has reserved."""

    version: int
    ready_groups: int
    ready_samples: int
    ready_tokens: int
    ready_bytes: int
    resume_groups: int
    resume_samples: int
    resume_tokens: int
    resume_bytes: int
    reserved_groups: int
    reserved_bytes: int

    @property
    def held_bytes(self) -> int:
        return self.ready_bytes + self.resume_bytes


class _Entry:
    """One stored group: its bytes plus what the buffer must know without decoding it.
    `reserved` is the reservation it started with, which it takes again when it resumes;
    `storage` is the recycled array its bytes lie in (None: they are a `bytes` of their own)."""

    __slots__ = ("data", "min_version", "reserved", "samples", "seq", "storage", "tokens", "uid")

    def __init__(
        self,
        data: bytes | memoryview,
        group: RolloutGroup,
        seq: int,
        reserved: int,
        storage: npt.NDArray[np.uint8] | None = None,
    ) -> None:
        self.data = data
        self.storage = storage
        self.reserved = reserved
        self.uid = group.uid
        self.min_version = group.min_version
        self.samples = group.num_samples
        self.tokens = group.num_tokens
        self.seq = seq


RECYCLE_MIN_BYTES = 64 * 1024
"""Groups at least this large are stored in recycled arrays; smaller ones come from the
allocator's heap, which reuses freed memory well, and would only pay `encode_into`'s cost."""
_SCAN = 16  # spares looked at per stored group: the oldest are the likeliest to be free
_FREE_REFS = 3  # a free spare's references in `_Spares.take`: the list, `arr`, getrefcount's


class _Spares:
    """Arrays whose groups left the buffer, kept to store later groups in.

    A decoded group's views reference the array its bytes lie in, so an array is handed out
    again only while nothing but this list (and the scan's own name for it) references it:
    whoever holds a view of a group taken earlier (the trainer, a checkpoint, an `on_drop`
    callback) keeps its array out of reuse, and can never see its bytes change.
    """

    def __init__(self) -> None:
        self._arrays: list[npt.NDArray[np.uint8]] = []
        self.nbytes = 0

    def take(self, size: int) -> npt.NDArray[np.uint8]:
        """A free spare of at least `size` bytes (and not more than twice that), else a new
        array with some room to spare, so that a slightly larger group can reuse it later."""
        for i in range(min(len(self._arrays), _SCAN)):
            arr = self._arrays[i]
            if size <= len(arr) <= 2 * size and sys.getrefcount(arr) == _FREE_REFS:
                del self._arrays[i]
                self.nbytes -= len(arr)
                return arr
        return np.empty(size + size // 8, np.uint8)

    def keep(self, arr: npt.NDArray[np.uint8], room: int) -> None:
        """Keep `arr` as a spare if it fits in `room` bytes with the others."""
        self.trim(room - len(arr))
        if self.nbytes + len(arr) <= room:
            self._arrays.append(arr)
            self.nbytes += len(arr)

    def trim(self, room: int) -> None:
        """Drop the oldest spares until they take at most `room` bytes."""
        while self._arrays and self.nbytes > max(room, 0):
            self.nbytes -= len(self._arrays.pop(0))


class RolloutBuffer:
    """Bounded by `max_groups` (in flight + ready + waiting to resume) and `max_bytes`.

    `max_staleness` (None: unbounded) expires groups whose oldest token is more than that many
    versions behind the current `version`: on arrival in `put`, and for held groups when the
    version moves (`set_version`). Staleness only grows with the version, so expiring at the
    earliest moment gives the same hand-out as expiring at hand-out, and frees memory sooner.
    """

    def __init__(
        self,
        *,
        max_groups: int,
        max_bytes: int,
        reserve_bytes: int = 0,
        max_staleness: int | None = None,
        order: Order = "fifo",
    ) -> None:
        if max_groups < 1:
            raise ValueError(f"max_groups={max_groups}: the buffer must hold at least one group")
        if max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes}: must be positive")
        if reserve_bytes < 0 or reserve_bytes > max_bytes:
            raise ValueError(
                f"reserve_bytes={reserve_bytes} must be between 0 and max_bytes={max_bytes}: "
                "raise max_bytes or lower the per-group reservation"
            )
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: use None (unbounded) or >= 0")
        if order not in ("fifo", "stalest"):
            raise ValueError(f"order={order!r}: use 'fifo' or 'stalest'")
        self.max_groups = max_groups
        self.max_bytes = max_bytes
        self.reserve_bytes = reserve_bytes
        self.max_staleness = max_staleness
        self.order: Order = order
        self.changed = Signal()
        self._version = 0
        self._ready: dict[int, _Entry] = {}
        self._resume: dict[int, _Entry] = {}
        self._ready_bytes = 0
        self._resume_bytes = 0
        self._reserved = 0
        self._reserved_bytes = 0
        self._seq = itertools.count()
        self._spares = _Spares()
        self._recycled = 0  # bytes stored in recycled arrays since the last `take`
        self._demand = 0  # the same, over the cycle before

    # -- admission -------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def held_bytes(self) -> int:
        return self._ready_bytes + self._resume_bytes

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    @property
    def num_resume(self) -> int:
        return len(self._resume)

    @property
    def num_reserved(self) -> int:
        return self._reserved

    def can_reserve(self, nbytes: int | None = None) -> bool:
        """Whether one more group of up to `nbytes` encoded bytes (default `reserve_bytes`) may
        start now: a slot free and its bytes within bound.

        With nothing held and nothing in flight a reservation is always granted, so a single
        group larger than the estimate can never stall the buffer forever.
        """
        if self._reserved + len(self._ready) + len(self._resume) >= self.max_groups:
            return False
        return self._fits(self.reserve_bytes if nbytes is None else nbytes, self.held_bytes)

    def _fits(self, nbytes: int, held: int) -> bool:
        if held == 0 and self._reserved == 0:
            return True
        return held + self._reserved_bytes + nbytes <= self.max_bytes

    def try_reserve(self, nbytes: int | None = None) -> bool:
        """Reserve a slot and `nbytes` (default `reserve_bytes`) for a group about to start;
        False (nothing reserved) if full."""
        nbytes = self.reserve_bytes if nbytes is None else nbytes
        if not self.can_reserve(nbytes):
            return False
        self._reserved += 1
        self._reserved_bytes += nbytes
        return True

    async def reserve(self, timeout: float | None = None) -> None:
        """Wait until a slot can be reserved and reserve it; `TimeoutError` after `timeout`."""
        await self.changed.wait_until(self.can_reserve, timeout)
        self.try_reserve()

    def release(self, nbytes: int | None = None) -> None:
        """Give back a reservation (of `nbytes`, default `reserve_bytes`) whose group will never
        be put (it was never started)."""
        if self._reserved <= 0:
            raise RuntimeError("release() without a reservation")
        self._unreserve(self.reserve_bytes if nbytes is None else nbytes)
        self.changed.notify()

    def _unreserve(self, nbytes: int) -> None:
        self._reserved -= 1
        self._reserved_bytes = 0 if self._reserved == 0 else max(0, self._reserved_bytes - nbytes)

    # -- arrival ---------------------------------------------------------------------------------

    def is_stale(self, group: RolloutGroup) -> bool:
        return self.max_staleness is not None and (
            self._version - group.min_version > self.max_staleness
        )

    def put(self, group: RolloutGroup, reserved: int | None = None) -> PutOutcome:
        """Store or drop a finished attempt of a group; never blocks, never changes its status.

        Uses up the reservation (of `reserved` bytes, default `reserve_bytes`) the group started
        with. All or nothing: a group that cannot be encoded (`CodecError`) or whose status
        contradicts its samples (`ValueError`) raises before anything changes, and keeps its
        reservation. Dropped groups are not referenced after this returns (nothing is stored,
        logged or kept in an exception).
        """
        if self._reserved <= 0:
            raise RuntimeError(f"put() of group {group.uid} without a reservation")
        reserved = self.reserve_bytes if reserved is None else reserved
        outcome = self._outcome(group)
        entry = None
        if outcome in (PutOutcome.STORED_READY, PutOutcome.STORED_RESUME):
            entry = self._store(group, reserved)
        self._unreserve(reserved)
        if entry is not None and outcome is PutOutcome.STORED_READY:
            self._ready[entry.uid] = entry
            self._ready_bytes += len(entry.data)
        elif entry is not None:
            self._resume[entry.uid] = entry
            self._resume_bytes += len(entry.data)
        self.changed.notify()
        return outcome

    def _outcome(self, group: RolloutGroup) -> PutOutcome:
        """Where a group goes by its status, after checking that its samples agree: a group
        labelled COMPLETED (or ABORTED) is stored as trainable (or resumable), so the label
        alone is not trusted."""
        match group.status:
            case Status.COMPLETED | Status.ABORTED:
                _check_label(group)
        match group.status:
            case Status.COMPLETED:
                return (
                    PutOutcome.DROPPED_EXPIRED if self.is_stale(group) else PutOutcome.STORED_READY
                )
            case Status.ABORTED:
                return (
                    PutOutcome.DROPPED_EXPIRED if self.is_stale(group) else PutOutcome.STORED_RESUME
                )
            case Status.FAILED:
                return PutOutcome.DROPPED_FAILED
            case Status.FILTERED:
                return PutOutcome.DROPPED_FILTERED
            case Status.EXPIRED:
                return PutOutcome.DROPPED_EXPIRED
            case Status.PENDING:
                raise ValueError(f"put() of group {group.uid} that was never generated (PENDING)")

    def _store(self, group: RolloutGroup, reserved: int) -> _Entry:
        if group.uid in self._ready or group.uid in self._resume:
            raise ValueError(f"group {group.uid} is already in the buffer")
        storage: list[npt.NDArray[np.uint8]] = []

        def into(size: int) -> npt.NDArray[np.uint8] | None:
            if size < RECYCLE_MIN_BYTES:
                return None
            storage.append(self._spares.take(size))
            return storage[0]

        data = encode_into(group, into)
        if storage:
            self._recycled += len(data)
        self._spares.trim(self.max_bytes - self.held_bytes - len(data))
        self.reserve_bytes = min(self.max_bytes, max(self.reserve_bytes, len(data)))
        entry = _Entry(data, group, next(self._seq), max(reserved, len(data)), *storage)
        return entry

    def _release(self, entries: list[_Entry]) -> list[RolloutGroup]:
        """Decode entries that left the buffer and keep their arrays as spares."""
        groups = [decode(entry.data) for entry in entries]
        for entry in entries:
            if entry.storage is not None:
                self._spares.keep(entry.storage, self._spare_room())
        return groups

    def _spare_room(self) -> int:
        """Bytes the spares may take: within `max_bytes` with what is held, and no more than
        twice what one hand-out cycle stores (the trainer still holds the last batch's views
        while the next one is stored), so that a buffer whose bound is far above its working
        set does not grow to the bound with spares it never reuses."""
        demand = max(self._demand, self._recycled)
        return min(self.max_bytes - self.held_bytes, 2 * demand)

    # -- hand-out --------------------------------------------------------------------------------

    def take(self, n: int) -> list[RolloutGroup]:
        """Remove and decode `n` ready groups (FIFO, or oldest `min_version` first)."""
        if n < 0 or n > len(self._ready):
            raise ValueError(f"take({n}) with {len(self._ready)} ready groups")
        self._demand, self._recycled = self._recycled, 0
        if self.order == "fifo":
            chosen = list(itertools.islice(self._ready.values(), n))
        else:
            chosen = heapq.nsmallest(n, self._ready.values(), key=lambda e: (e.min_version, e.seq))
        for entry in chosen:
            del self._ready[entry.uid]
            self._ready_bytes -= len(entry.data)
        if chosen:
            self.changed.notify()
        return self._release(chosen)

    async def get_batch(self, n: int, timeout: float | None = None) -> list[RolloutGroup]:
        """Wait until `n` groups are ready and hand them out; `TimeoutError` (nothing taken)
        after `timeout` seconds. Raises `ValueError` if `n` can never be ready at once."""
        if n > self.max_groups:
            raise ValueError(f"get_batch({n}) can never be served: max_groups={self.max_groups}")
        await self.changed.wait_until(lambda: len(self._ready) >= n, timeout)
        return self.take(n)

    def can_resume(self) -> bool:
        """Whether the oldest group waiting to resume may start again now: its stored bytes
        become its reservation again, which must fit."""
        if not self._resume:
            return False
        entry = next(iter(self._resume.values()))
        return self._fits(entry.reserved, self.held_bytes - len(entry.data))

    def take_resume(self) -> tuple[RolloutGroup, int] | None:
        """Take the oldest group waiting to resume, if `can_resume`: its slot becomes an
        in-flight reservation. Returns the group and its reservation's bytes (for `put`)."""
        if not self.can_resume():
            return None
        entry = self._resume.pop(next(iter(self._resume)))
        self._resume_bytes -= len(entry.data)
        self._reserved += 1
        self._reserved_bytes += entry.reserved
        self.changed.notify()
        return self._release([entry])[0], entry.reserved

    def set_version(self, version: int) -> list[RolloutGroup]:
        """Move to policy `version`; remove and return the held groups that became stale."""
        if version < self._version:
            raise ValueError(f"version can only grow: {self._version} -> {version}")
        self._version = version
        if self.max_staleness is None:
            return []
        limit = version - self.max_staleness
        expired: list[_Entry] = []
        for store in (self._ready, self._resume):
            for entry in [e for e in store.values() if e.min_version < limit]:
                del store[entry.uid]
                expired.append(entry)
        self._ready_bytes = sum(len(e.data) for e in self._ready.values())
        self._resume_bytes = sum(len(e.data) for e in self._resume.values())
        if expired:
            self.changed.notify()
        return self._release(expired)

    # -- introspection and checkpoints -----------------------------------------------------------

    def stats(self) -> BufferStats:
        return BufferStats(
            version=self._version,
            ready_groups=len(self._ready),
            ready_samples=sum(e.samples for e in self._ready.values()),
            ready_tokens=sum(e.tokens for e in self._ready.values()),
            ready_bytes=self._ready_bytes,
            resume_groups=len(self._resume),
            resume_samples=sum(e.samples for e in self._resume.values()),
            resume_tokens=sum(e.tokens for e in self._resume.values()),
            resume_bytes=self._resume_bytes,
            reserved_groups=self._reserved,
            reserved_bytes=self._reserved_bytes,
        )

    def snapshot(self) -> tuple[list[bytes], list[bytes]]:
        """The encoded ready and resume groups, in hand-out order of arrival (for checkpoints)."""
        return (
            [bytes(e.data) for e in self._ready.values()],
            [bytes(e.data) for e in self._resume.values()],
        )

    def restore(
        self,
        version: int,
        ready: list[bytes],
        resume: list[bytes],
        reserve_for: Callable[[RolloutGroup], int] | None = None,
    ) -> None:
        """Load a `snapshot` into an empty buffer with no reservations. `reserve_for(group)` is
        the reservation a resumed group takes again (default `reserve_bytes`)."""
        if self._ready or self._resume or self._reserved:
            raise RuntimeError("restore() needs an empty buffer with no reservations")
        if len(ready) + len(resume) > self.max_groups:
            raise ValueError(
                f"the checkpoint holds {len(ready) + len(resume)} groups, more than "
                f"max_groups={self.max_groups}: raise max_groups to load it"
            )
        stores: tuple[dict[int, _Entry], dict[int, _Entry]] = ({}, {})
        for store, blobs in zip(stores, (ready, resume), strict=True):
            for data in blobs:  # decode everything before changing anything
                group = decode(data)
                reserved = self.reserve_bytes if reserve_for is None else reserve_for(group)
                entry = _Entry(data, group, next(self._seq), max(reserved, len(data)))
                if entry.uid in stores[0] or entry.uid in stores[1]:
                    raise ValueError(f"the checkpoint holds group {entry.uid} twice")
                store[entry.uid] = entry
        self._version = version
        self._ready, self._resume = stores
        self._ready_bytes = sum(len(e.data) for e in self._ready.values())
        self._resume_bytes = sum(len(e.data) for e in self._resume.values())
        self.changed.notify()


def _check_label(group: RolloutGroup) -> None:
    """Refuse a COMPLETED group with a sample that is not COMPLETED, and an ABORTED group with
    a sample that is neither COMPLETED nor ABORTED (or with none ABORTED)."""
    statuses = {sample.status for sample in group.samples}
    if group.status is Status.COMPLETED:
        allowed = {Status.COMPLETED}
    else:
        allowed = {Status.COMPLETED, Status.ABORTED}
    if not statuses <= allowed or (
        group.status is Status.ABORTED and Status.ABORTED not in statuses
    ):
        found = ", ".join(sorted(s.value for s in statuses))
        raise ValueError(
            f"group {group.uid} is labelled {group.status.value} but its samples are {found}"
        )
