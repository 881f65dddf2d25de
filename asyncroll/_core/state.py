"""The producer's checkpoint: a versioned msgspec struct, and its file (checksummed, atomic).

File layout: ``"ARCK" | format u32 | crc32 u32 | length u64 | msgpack(ProducerState)``. The
checksum covers the payload, so a torn or bit-flipped file is refused before anything loads;
writing goes to a temporary file in the same folder, fsynced, then renamed over the target, so
a crash leaves either the old checkpoint or the new one, never half of one.

`loads` also decodes every stored group and re-queued prompt: the checksum proves the file is
the one written, not that what was written is whole (a bug, or a file built by hand), and a
damaged group found later, half-way through `Producer.load_state_dict`, would be a `CodecError`
from deep inside the buffer instead of a `CheckpointError` before anything loads.
"""

from __future__ import annotations

import os
import struct
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

import msgspec

from asyncroll import codec
from asyncroll._core import rollout
from asyncroll._core.progress import ProgressCounters
from asyncroll.prompts import CursorState, decode_prompt
from asyncroll.types import RolloutGroup, Status

STATE_FORMAT = 2  # 2: the cursor's re-queued prompts are `encode_prompt` bytes
_MAGIC = b"ARCK"
_HEAD = struct.Struct("<4sIIQ")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (corrupt, truncated, another format or run shape)."""


class ProducerState(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a producer needs to continue a run: version, prompt cursor, counters, and the
    ready and partial groups as their encoded bytes."""

    format: int
    version: int
    next_uid: int
    group_size: int
    counters: ProgressCounters
    latency_counts: list[int]
    cursor: CursorState
    ready: list[bytes]
    resume: list[bytes]
    # The groups the staleness schedule expected taken by `version` (`Admission.scheduled`);
    # None: the run had no batch_size (or the file predates the field): a resumed run
    # anchors its schedule at the groups consumed.
    scheduled_groups: int | None = None


def dumps(state: ProducerState) -> bytes:
    payload = msgspec.msgpack.encode(state)
    return _HEAD.pack(_MAGIC, state.format, zlib.crc32(payload), len(payload)) + payload


def loads(data: bytes) -> ProducerState:
    if len(data) < _HEAD.size:
        raise CheckpointError(f"truncated checkpoint: {len(data)} bytes")
    magic, fmt, crc, length = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        raise CheckpointError(f"not an asyncroll checkpoint (magic {magic!r})")
    if fmt != STATE_FORMAT:
        raise CheckpointError(
            f"checkpoint format {fmt} cannot be read by this asyncroll (format {STATE_FORMAT})"
        )
    payload = memoryview(data)[_HEAD.size :]
    if len(payload) != length:
        raise CheckpointError(f"truncated checkpoint: {len(payload)} of {length} payload bytes")
    if zlib.crc32(payload) != crc:
        raise CheckpointError("corrupt checkpoint: checksum mismatch")
    try:
        state = msgspec.msgpack.decode(payload, type=ProducerState)
    except msgspec.MsgspecError as exc:
        raise CheckpointError(f"corrupt checkpoint: {exc}") from None
    if state.format != STATE_FORMAT:
        raise CheckpointError(f"checkpoint body says format {state.format}, header {fmt}")
    check_contents(state)
    return state


def check_contents(state: ProducerState) -> None:
    """Raise `CheckpointError` unless every group and re-queued prompt in `state` decodes.
    (`loads` calls it; call it yourself on a `ProducerState` that did not come from `loads`.)"""
    stored: list[tuple[str, Callable[[bytes], object], list[bytes]]] = [
        ("ready group", codec.decode, state.ready),
        ("resume group", codec.decode, state.resume),
        ("re-queued prompt", decode_prompt, state.cursor.requeued),
    ]
    uids: set[int] = set()
    for what, decode, blobs in stored:
        for i, data in enumerate(blobs):
            try:
                item = decode(data)
            except codec.CodecError as exc:
                raise CheckpointError(f"corrupt checkpoint: {what} {i}: {exc}") from None
            if isinstance(item, RolloutGroup):  # one uid is one group: the buffer keys on it
                if item.uid in uids:
                    raise CheckpointError(f"corrupt checkpoint: uid {item.uid} is held twice")
                uids.add(item.uid)


def fit_to_run(
    state: ProducerState, budget: Callable[[RolloutGroup], int], *, episodes: bool
) -> ProducerState:
    """`state` with its partial groups made resumable by this run, their dropped tokens counted
    as wasted so the ledger still holds:

    * with a rollout function (`episodes`) a group restarts from its prompt (episodes cannot
      continue a single-turn partial): its tokens are `wasted_tokens_restarted`;
    * otherwise a sample with `budget(group)` tokens or more (the run was resumed with a smaller
      `max_new_tokens` or `max_model_len`) finishes as "length" at that budget, the rest of its
      tokens `wasted_tokens_truncated`: an engine is never handed a budget below 1.

    Groups that need neither keep their bytes."""
    counters = state.counters.copy()
    resume = []
    for data in state.resume:
        group = codec.decode(data)
        if episodes and group.num_tokens:
            counters.restarted_groups += 1
            counters.wasted_tokens_restarted += group.num_tokens
            samples = rollout.interrupted(rollout.fresh_samples(group.num_samples))
        else:  # a prompt that no longer leaves room to generate: responses of 0 tokens
            n = max(budget(group), 0)
            samples = tuple(
                rollout.truncated(s, n)
                if s.status is not Status.COMPLETED and len(s.tokens) >= n
                else s
                for s in group.samples
            )
            counters.wasted_tokens_truncated += group.num_tokens - sum(
                len(s.tokens) for s in samples
            )
        if all(a is b for a, b in zip(samples, group.samples, strict=True)):
            resume.append(data)
        else:
            resume.append(codec.encode(msgspec.structs.replace(group, samples=samples)))
    return msgspec.structs.replace(state, counters=counters, resume=resume)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a mix."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
