import asyncio
import gc
import weakref

import msgspec
import numpy as np
import pytest

from asyncroll.buffer import RECYCLE_MIN_BYTES, PutOutcome, RolloutBuffer
from asyncroll.codec import CodecError, encode
from asyncroll.types import RolloutGroup, Status
from tests.factories import make_group

S = Status


def buffer(**kw: object) -> RolloutBuffer:
    args: dict[str, object] = {"max_groups": 16, "max_bytes": 1 << 20, "reserve_bytes": 1024}
    args.update(kw)
    return RolloutBuffer(**args)  # type: ignore[arg-type]


def put(buf: RolloutBuffer, group: RolloutGroup) -> PutOutcome:
    assert buf.try_reserve()
    return buf.put(group)


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (S.COMPLETED, PutOutcome.STORED_READY),
        (S.ABORTED, PutOutcome.STORED_RESUME),
        (S.FAILED, PutOutcome.DROPPED_FAILED),
        (S.FILTERED, PutOutcome.DROPPED_FILTERED),
        (S.EXPIRED, PutOutcome.DROPPED_EXPIRED),
    ],
)
def test_put_outcomes_and_status_untouched(status: Status, outcome: PutOutcome) -> None:
    buf = buffer()
    group = make_group(status=status)
    assert put(buf, group) is outcome
    assert group.status is status  # put never rewrites a status
    stored = outcome in (PutOutcome.STORED_READY, PutOutcome.STORED_RESUME)
    assert buf.held_bytes == (len(encode(group)) if stored else 0)
    assert buf.num_ready + buf.num_resume == int(stored)
    assert buf.num_reserved == 0


def test_pending_group_cannot_be_put() -> None:
    buf = buffer()
    with pytest.raises(ValueError, match="never generated"):
        put(buf, make_group(status=S.PENDING))


def test_put_needs_a_reservation() -> None:
    with pytest.raises(RuntimeError, match="without a reservation"):
        buffer().put(make_group())
    with pytest.raises(RuntimeError, match="without a reservation"):
        buffer().release()


@pytest.mark.parametrize("status", [S.FAILED, S.FILTERED, S.EXPIRED])
def test_dropped_payload_is_released_once_the_caller_lets_go(status: Status) -> None:
    buf = buffer()
    group = make_group(status=status, tokens=1000, payload=256)
    refs = [weakref.ref(group)]
    for s in group.samples:
        refs += [weakref.ref(s), weakref.ref(s.tokens), weakref.ref(s.logprobs)]
        assert s.routed_experts is not None
        refs.append(weakref.ref(s.routed_experts))
    gc.disable()  # prove it is freed by reference counting, not by a later collection
    try:
        put(buf, group)
        del group, s
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_stored_group_is_a_copy_not_a_reference() -> None:
    buf = buffer()
    group = make_group()
    ref = weakref.ref(group.samples[0].tokens)
    put(buf, group)
    del group
    assert ref() is None  # the buffer holds bytes, not the caller's arrays
    assert buf.num_ready == 1


def test_slots_bound_in_flight_plus_held() -> None:
    buf = buffer(max_groups=3)
    assert buf.try_reserve() and buf.try_reserve() and buf.try_reserve()
    assert not buf.try_reserve()  # 3 in flight
    buf.put(make_group(0))
    buf.put(make_group(1, status=S.ABORTED))
    assert not buf.try_reserve()  # 1 in flight + 1 ready + 1 resume
    buf.put(make_group(2, status=S.FAILED))  # dropped: its slot comes back
    assert buf.try_reserve()


def test_byte_bound_stops_reservations() -> None:
    size = len(encode(make_group()))
    buf = buffer(max_groups=100, max_bytes=3 * size, reserve_bytes=size)
    for uid in range(3):
        put(buf, make_group(uid))
    assert buf.held_bytes == 3 * size
    assert not buf.can_reserve()
    buf.take(1)
    assert buf.can_reserve()


def test_reservation_estimate_grows_to_the_largest_group_seen() -> None:
    buf = buffer(reserve_bytes=10)
    big = make_group(tokens=500)
    put(buf, big)
    assert buf.reserve_bytes == len(encode(big))


def test_empty_buffer_always_admits_one_group() -> None:
    """A group larger than the estimate must not be able to stall the buffer forever."""
    buf = buffer(max_bytes=100, reserve_bytes=100)
    put(buf, make_group(tokens=1000))  # far larger than max_bytes
    assert not buf.can_reserve()
    buf.take(1)
    assert buf.can_reserve()


async def test_reserve_waits_for_space_and_times_out() -> None:
    buf = buffer(max_groups=1)
    await buf.reserve()
    with pytest.raises(TimeoutError):
        await buf.reserve(timeout=0.01)
    waiter = asyncio.ensure_future(buf.reserve(timeout=5))
    # One turn of the loop runs the waiter (scheduled first) up to its wait: asyncio runs
    # ready tasks in order, so this is the order of events, not a timing window.
    await asyncio.sleep(0)
    assert not waiter.done()
    buf.put(make_group(status=S.FAILED))  # frees the slot
    await asyncio.wait_for(waiter, 5)
    assert buf.num_reserved == 1


async def test_get_batch_waits_for_n_and_times_out_without_taking() -> None:
    buf = buffer()
    put(buf, make_group(0))
    with pytest.raises(TimeoutError):
        await buf.get_batch(2, timeout=0.01)
    assert buf.num_ready == 1  # nothing was taken
    task = asyncio.ensure_future(buf.get_batch(2, timeout=5))
    put(buf, make_group(1))
    got = await asyncio.wait_for(task, 5)
    assert [g.uid for g in got] == [0, 1]
    with pytest.raises(ValueError, match="never be served"):
        await buf.get_batch(17)


def test_fifo_and_stalest_first_orders() -> None:
    versions = [3, 1, 2, 1]
    fifo, stalest = buffer(), buffer(order="stalest")
    for b in (fifo, stalest):
        b.set_version(3)
        for uid, v in enumerate(versions):
            put(b, make_group(uid, version=v))
    assert [g.uid for g in fifo.take(4)] == [0, 1, 2, 3]
    assert [g.uid for g in stalest.take(4)] == [1, 3, 2, 0]


def test_stale_groups_expire_on_arrival_and_on_version_change() -> None:
    buf = buffer(max_staleness=1)
    buf.set_version(2)
    assert put(buf, make_group(0, version=0)) is PutOutcome.DROPPED_EXPIRED
    assert put(buf, make_group(1, version=0, status=S.ABORTED)) is PutOutcome.DROPPED_EXPIRED
    assert put(buf, make_group(2, version=1)) is PutOutcome.STORED_READY
    assert put(buf, make_group(3, version=2, status=S.ABORTED)) is PutOutcome.STORED_RESUME
    assert put(buf, make_group(4, version=2)) is PutOutcome.STORED_READY
    expired = buf.set_version(3)
    assert [g.uid for g in expired] == [2]
    assert buf.num_ready == 1 and buf.num_resume == 1
    assert buf.held_bytes == sum(len(d) for part in buf.snapshot() for d in part)
    with pytest.raises(ValueError, match="only grow"):
        buf.set_version(2)


def test_take_resume_turns_a_partial_back_into_a_reservation() -> None:
    buf = buffer()
    put(buf, make_group(5, status=S.ABORTED))
    assert buf.num_reserved == 0
    taken = buf.take_resume()
    assert taken is not None
    group, reserved = taken
    assert group.uid == 5 and group.status is S.ABORTED and reserved == 1024
    assert buf.num_resume == 0 and buf.num_reserved == 1 and buf.held_bytes == 0
    assert buf.stats().reserved_bytes == 1024  # its reservation again, not its stored size
    assert buf.take_resume() is None


def test_a_partial_resumes_only_when_its_reservation_fits() -> None:
    """A resumed group grows back to its full size: its stored bytes must become its whole
    reservation again, or the byte bound breaks while it finishes."""
    size = len(encode(make_group(0)))
    buf = buffer(max_bytes=3 * size, reserve_bytes=size)
    assert buf.try_reserve(2 * size)
    buf.put(make_group(1, status=S.ABORTED), 2 * size)
    assert buf.try_reserve(size) and buf.try_reserve(size // 2)  # 2.5 x size in flight
    assert not buf.can_resume() and buf.take_resume() is None
    buf.put(make_group(2, status=S.FAILED), size)
    assert buf.can_resume()
    taken = buf.take_resume()
    assert taken is not None and taken[1] == 2 * size


def test_reservations_count_their_own_bytes() -> None:
    """A long prompt reserves more: the bound covers prompt + samples, not a fixed estimate."""
    buf = buffer(max_bytes=10_000, reserve_bytes=1_000)
    assert buf.try_reserve(6_000)
    assert not buf.can_reserve(5_000) and buf.can_reserve(4_000)
    assert buf.stats().reserved_bytes == 6_000
    buf.release(6_000)
    assert buf.stats().reserved_bytes == 0 and buf.can_reserve(10_000)


@pytest.mark.parametrize(
    ("status", "samples"),
    [
        (S.COMPLETED, (S.COMPLETED, S.PENDING)),
        (S.COMPLETED, (S.COMPLETED, S.FAILED)),
        (S.COMPLETED, (S.COMPLETED, S.ABORTED)),
        (S.ABORTED, (S.COMPLETED, S.FAILED)),
        (S.ABORTED, (S.COMPLETED, S.COMPLETED)),
    ],
)
def test_put_does_not_trust_the_label(status: Status, samples: tuple[Status, ...]) -> None:
    """A group labelled COMPLETED would be handed out as trainable: its samples must agree."""
    group = make_group(0, status=status)
    mixed = tuple(
        msgspec.structs.replace(s, status=st) for s, st in zip(group.samples, samples, strict=True)
    )
    buf = buffer()
    assert buf.try_reserve()
    with pytest.raises(ValueError, match="labelled"):
        buf.put(msgspec.structs.replace(group, samples=mixed))
    assert buf.num_reserved == 1 and buf.num_ready == buf.num_resume == 0  # nothing changed


def test_a_group_that_cannot_be_encoded_changes_nothing() -> None:
    """put is all or nothing: the reservation survives, so the caller can fail the group."""
    group = make_group(0, metadata={"x": object()})
    buf = buffer()
    assert buf.try_reserve()
    with pytest.raises(CodecError):
        buf.put(group)
    assert buf.num_reserved == 1 and buf.num_ready == 0 and buf.held_bytes == 0
    assert buf.put(msgspec.structs.replace(group, status=S.FAILED)) is PutOutcome.DROPPED_FAILED
    assert buf.num_reserved == 0


def test_duplicate_uid_is_refused() -> None:
    buf = buffer()
    put(buf, make_group(1))
    with pytest.raises(ValueError, match="already in the buffer"):
        put(buf, make_group(1))


def test_stats_count_what_is_held() -> None:
    buf = buffer()
    put(buf, make_group(0, samples=2, tokens=4))
    put(buf, make_group(1, samples=3, tokens=5, status=S.ABORTED))
    assert buf.try_reserve()
    st = buf.stats()
    assert (st.ready_groups, st.ready_samples, st.ready_tokens) == (1, 2, 8)
    assert (st.resume_groups, st.resume_samples, st.resume_tokens) == (1, 3, 15)
    assert st.reserved_groups == 1 and st.reserved_bytes == buf.reserve_bytes
    assert st.held_bytes == buf.held_bytes


def test_snapshot_restore_round_trip() -> None:
    a = buffer()
    put(a, make_group(0))
    put(a, make_group(1, status=S.ABORTED))
    ready, resume = a.snapshot()
    b = buffer()
    b.restore(4, ready, resume)
    assert b.version == 4 and b.num_ready == 1 and b.num_resume == 1
    assert b.held_bytes == a.held_bytes
    with pytest.raises(RuntimeError, match="empty buffer"):
        b.restore(4, ready, resume)
    with pytest.raises(ValueError, match="max_groups"):
        buffer(max_groups=1).restore(0, ready, resume)


def test_restore_is_all_or_nothing() -> None:
    ready, _ = buffer_with_one_ready().snapshot()
    b = buffer()
    with pytest.raises(CodecError, match="truncated"):
        b.restore(0, [*ready, b"garbage"], [])
    assert b.num_ready == 0 and b.held_bytes == 0


def buffer_with_one_ready() -> RolloutBuffer:
    b = buffer()
    put(b, make_group(0))
    return b


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_groups": 0}, "max_groups"),
        ({"max_bytes": 0}, "max_bytes"),
        ({"reserve_bytes": 1 << 21}, "reserve_bytes"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"order": "lifo"}, "order"),
    ],
)
def test_bad_config_is_refused_with_the_field_named(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        buffer(**kwargs)


def test_take_more_than_ready_is_an_error() -> None:
    with pytest.raises(ValueError, match="ready"):
        buffer().take(1)


# -- recycled storage: reuse mapped memory, never under a view someone still holds ---------------


def big_group(uid: int, seed: int = 0) -> RolloutGroup:
    """A group above `RECYCLE_MIN_BYTES`, whose token ids depend on `seed`."""
    group = make_group(uid, samples=2, tokens=4096, payload=16)
    samples = tuple(
        msgspec.structs.replace(s, tokens=np.full(4096, seed, np.int32)) for s in group.samples
    )
    return msgspec.structs.replace(group, samples=samples)


def test_a_taken_group_is_never_overwritten_by_later_groups() -> None:
    """The trainer keeps a batch while the buffer stores and hands out more: the storage under
    its views is not reused, whatever comes after."""
    buf = buffer(max_bytes=1 << 30)
    put(buf, big_group(0, seed=1))
    (kept,) = buf.take(1)
    assert len(encode(kept)) >= RECYCLE_MIN_BYTES
    for uid in range(1, 6):
        put(buf, big_group(uid, seed=100 + uid))
        (other,) = buf.take(1)
        assert not np.shares_memory(other.samples[0].tokens, kept.samples[0].tokens)
        del other
    assert all((s.tokens == 1).all() for s in kept.samples)


def test_storage_is_reused_once_every_view_is_gone() -> None:
    buf = buffer(max_bytes=1 << 30)
    put(buf, big_group(0, seed=1))
    (first,) = buf.take(1)
    address = first.samples[0].tokens.ctypes.data
    del first  # the trainer lets go: its storage becomes free
    put(buf, big_group(1, seed=2))
    (second,) = buf.take(1)
    assert second.samples[0].tokens.ctypes.data == address  # the same memory, written again
    assert (second.samples[0].tokens == 2).all()


def test_spares_stay_within_the_byte_bound() -> None:
    size = len(encode(big_group(0)))
    buf = buffer(max_groups=16, max_bytes=4 * size + size // 2, reserve_bytes=size)
    for round_ in range(3):
        for uid in range(4):
            put(buf, big_group(10 * round_ + uid))
            assert buf._spares.nbytes + buf.held_bytes <= buf.max_bytes
        held = buf.take(2)  # half the batch stays referenced, half is let go at once
        buf.take(2)
        assert buf._spares.nbytes + buf.held_bytes <= buf.max_bytes
        del held


def test_snapshot_of_recycled_storage_is_plain_bytes() -> None:
    buf = buffer(max_bytes=1 << 30)
    group = big_group(0, seed=3)
    put(buf, group)
    ready, resume = buf.snapshot()
    assert [type(b) for b in ready] == [bytes] and resume == []
    assert ready[0] == encode(group)


def test_spares_follow_what_a_cycle_stores_not_the_bound() -> None:
    """A burst leaves many spares; once the cycles store one group each, the spares shrink
    to two groups' worth (the batch the trainer still holds, and the next one)."""
    buf = buffer(max_groups=16, max_bytes=1 << 30)
    for uid in range(8):
        put(buf, big_group(uid))
    buf.take(8)
    size = len(encode(big_group(0)))
    assert buf._spares.nbytes >= 8 * size
    for uid in range(8, 14):
        put(buf, big_group(uid))
        buf.take(1)
    assert buf._spares.nbytes <= 2 * (size + size // 8)
