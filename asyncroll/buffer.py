"""`RolloutBuffer`: a bounded store of encoded groups that drops failures on arrival.

What it holds is encoded bytes (see `asyncroll.codec`): the byte bound is exact, buffered data
cannot be changed by anyone after `put`, and a checkpoint is a plain copy.

Admission, not `put`, is where backpressure happens (DESIGN.md invariant 3). Before a group is
started its producer reserves a slot; the slot stays with the group while it is in flight, ready
or waiting to resume, and is given back when the group is handed out or dropped. A reservation
also counts `reserve_bytes` against `max_bytes` until the group arrives, so what the buffer holds
plus what is in flight stays within `max_bytes` as long as no group encodes larger than
`reserve_bytes` (a larger group raises the reservation size for every later one). Because every
group that can arrive already holds its slot, `put` never waits and a drain never deadlocks.

The buffer knows only what it holds. Counting what was dropped, and why, is the producer's job:
`put` returns an explicit outcome and `set_version` returns the groups it expired.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from typing import Literal

import msgspec

from asyncroll._signal import Signal
from asyncroll.codec import decode, encode
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
    """One stored group: its bytes plus what the buffer must know without decoding it."""

    __slots__ = ("data", "min_version", "samples", "seq", "tokens", "uid")

    def __init__(self, data: bytes, group: RolloutGroup, seq: int) -> None:
        self.data = data
        self.uid = group.uid
        self.min_version = group.min_version
        self.samples = group.num_samples
        self.tokens = group.num_tokens
        self.seq = seq


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
        self._seq = itertools.count()

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

    def can_reserve(self) -> bool:
        """Whether one more group may start now (a slot free and its bytes within bound).

        With nothing held and nothing in flight a reservation is always granted, so a single
        group larger than the estimate can never stall the buffer forever.
        """
        if self._reserved + len(self._ready) + len(self._resume) >= self.max_groups:
            return False
        held = self.held_bytes
        if held == 0 and self._reserved == 0:
            return True
        return held + (self._reserved + 1) * self.reserve_bytes <= self.max_bytes

    def try_reserve(self) -> bool:
        """Reserve a slot for a group about to start; False (nothing reserved) if full."""
        if not self.can_reserve():
            return False
        self._reserved += 1
        return True

    async def reserve(self, timeout: float | None = None) -> None:
        """Wait until a slot can be reserved and reserve it; `TimeoutError` after `timeout`."""
        await self.changed.wait_until(self.can_reserve, timeout)
        self._reserved += 1

    def release(self) -> None:
        """Give back a reservation whose group will never be put (it was never started)."""
        if self._reserved <= 0:
            raise RuntimeError("release() without a reservation")
        self._reserved -= 1
        self.changed.notify()

    # -- arrival ---------------------------------------------------------------------------------

    def is_stale(self, group: RolloutGroup) -> bool:
        return self.max_staleness is not None and (
            self._version - group.min_version > self.max_staleness
        )

    def put(self, group: RolloutGroup) -> PutOutcome:
        """Store or drop a finished attempt of a group; never blocks, never changes its status.

        Uses up the reservation the group started with. Dropped groups are not referenced after
        this returns (nothing is stored, logged or kept in an exception).
        """
        if self._reserved <= 0:
            raise RuntimeError(f"put() of group {group.uid} without a reservation")
        outcome = self._outcome(group)
        self._reserved -= 1
        if outcome is PutOutcome.STORED_READY:
            entry = self._store(group)
            self._ready[entry.uid] = entry
            self._ready_bytes += len(entry.data)
        elif outcome is PutOutcome.STORED_RESUME:
            entry = self._store(group)
            self._resume[entry.uid] = entry
            self._resume_bytes += len(entry.data)
        self.changed.notify()
        return outcome

    def _outcome(self, group: RolloutGroup) -> PutOutcome:
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

    def _store(self, group: RolloutGroup) -> _Entry:
        if group.uid in self._ready or group.uid in self._resume:
            raise ValueError(f"group {group.uid} is already in the buffer")
        entry = _Entry(encode(group), group, next(self._seq))
        self.reserve_bytes = max(self.reserve_bytes, len(entry.data))
        return entry

    # -- hand-out --------------------------------------------------------------------------------

    def take(self, n: int) -> list[RolloutGroup]:
        """Remove and decode `n` ready groups (FIFO, or oldest `min_version` first)."""
        if n < 0 or n > len(self._ready):
            raise ValueError(f"take({n}) with {len(self._ready)} ready groups")
        if self.order == "fifo":
            chosen = list(itertools.islice(self._ready.values(), n))
        else:
            chosen = heapq.nsmallest(n, self._ready.values(), key=lambda e: (e.min_version, e.seq))
        for entry in chosen:
            del self._ready[entry.uid]
            self._ready_bytes -= len(entry.data)
        if chosen:
            self.changed.notify()
        return [decode(entry.data) for entry in chosen]

    async def get_batch(self, n: int, timeout: float | None = None) -> list[RolloutGroup]:
        """Wait until `n` groups are ready and hand them out; `TimeoutError` (nothing taken)
        after `timeout` seconds. Raises `ValueError` if `n` can never be ready at once."""
        if n > self.max_groups:
            raise ValueError(f"get_batch({n}) can never be served: max_groups={self.max_groups}")
        await self.changed.wait_until(lambda: len(self._ready) >= n, timeout)
        return self.take(n)

    def take_resume(self) -> RolloutGroup | None:
        """Take the oldest group waiting to resume; its slot becomes an in-flight reservation."""
        if not self._resume:
            return None
        entry = self._resume.pop(next(iter(self._resume)))
        self._resume_bytes -= len(entry.data)
        self._reserved += 1
        self.changed.notify()
        return decode(entry.data)

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
        return [decode(e.data) for e in expired]

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
            reserved_bytes=self._reserved * self.reserve_bytes,
        )

    def snapshot(self) -> tuple[list[bytes], list[bytes]]:
        """The encoded ready and resume groups, in hand-out order of arrival (for checkpoints)."""
        return [e.data for e in self._ready.values()], [e.data for e in self._resume.values()]

    def restore(self, version: int, ready: list[bytes], resume: list[bytes]) -> None:
        """Load a `snapshot` into an empty buffer with no reservations."""
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
                entry = _Entry(data, decode(data), next(self._seq))
                if entry.uid in stores[0] or entry.uid in stores[1]:
                    raise ValueError(f"the checkpoint holds group {entry.uid} twice")
                store[entry.uid] = entry
        self._version = version
        self._ready, self._resume = stores
        self._ready_bytes = sum(len(e.data) for e in self._ready.values())
        self._resume_bytes = sum(len(e.data) for e in self._resume.values())
        self.changed.notify()
