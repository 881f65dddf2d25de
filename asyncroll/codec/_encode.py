"""A group to bytes: the head (frame prefix, msgpack header) and one data region holding every
array's bytes, each on a 64-byte boundary (see `asyncroll.codec`). `encode` joins the parts
into one `bytes`; `encode_into` writes them into memory the caller recycles.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from asyncroll.codec._arrays import (
    _DTYPE_CODE,
    _check_mapping,
    _encode_failed,
    _to_numpy,
)
from asyncroll.codec._wire import (
    _EXT_ARRAY,
    _EXT_LAYOUT,
    _EXTRA_AT,
    _INT32,
    _PACKED,
    _PACKED_DTYPES,
    _PREFIX,
    _PROMPT_AT,
    _ROWS_AT,
    _SAMPLE_REST,
    _SAMPLES_AT,
    ALIGN,
    FORMAT_VERSION,
    MAGIC,
)
from asyncroll.types import RolloutGroup

_ZEROS = memoryview(bytes(ALIGN))
_HEAD = (b"", b"", b"")  # where a message's parts leave room for its head
_JOIN_LIMIT = 256 * 1024  # `encode_into` copies packed arrays up to this size twice (see there)


class _Data:
    """The message being laid out: its parts (the head, which `_layout` fills in last: frame
    prefix, msgpack header, padding; then the data region's arrays and padding), the data
    region's length so far, and its segments (offset, arrays, dtype, shape: one per packed
    field or extension value) for `encode_into`. The data region starts with the packed
    prompt, token ids, logprobs and versions, where `_packed` will find them."""

    __slots__ = ("offset", "packed_end", "packed_parts", "parts", "segments")

    def __init__(self, prompt: npt.NDArray[np.int32], columns: list[Any], total: int) -> None:
        # Straight-line code (this runs once per encoded group): every packed dtype has
        # 4-byte items, so the offsets follow from the two lengths alone.
        tokens, logprobs, versions = columns[:3]
        size, first = total * 4, len(prompt) * 4
        pad, lead = _ZEROS[: -size % ALIGN], _ZEROS[: -first % ALIGN]
        start = first + len(lead)
        step = size + len(pad)
        self.parts: list[Any] = [
            *_HEAD, prompt, lead, *tokens, pad, *logprobs, pad, *versions
        ]  # fmt: skip
        self.segments: list[tuple[int, Sequence[Any], np.dtype[Any], tuple[int, ...]]] = [
            (0, (prompt,), _INT32, (len(prompt),)),
            (start, tokens, _PACKED_DTYPES[0], (total,)),
            (start + step, logprobs, _PACKED_DTYPES[1], (total,)),
            (start + 2 * step, versions, _PACKED_DTYPES[2], (total,)),
        ]
        self.offset = self.packed_end = start + 2 * step + size
        self.packed_parts = len(self.parts)  # the head's and the packed arrays' parts

    def place(self, arrays: Sequence[Any], dtype: np.dtype[Any], shape: tuple[int, ...]) -> int:
        """Lay `arrays` (of one dtype) out back to back as one array of `shape` at the next
        aligned offset, and return that offset. (`bytes.join` reads contiguous numpy arrays
        through the buffer protocol.)"""
        pad = -self.offset % ALIGN
        if pad:
            self.parts.append(_ZEROS[:pad])
        start = self.offset + pad
        self.parts.extend(arrays)
        self.segments.append((start, arrays, dtype, shape))
        self.offset = start + math.prod(shape) * dtype.itemsize
        return start

    def ext(self, arr: npt.NDArray[Any]) -> Any:
        """The extension value of one array of metadata, `extra` or a sample's own rows."""
        start = self.place([arr], arr.dtype, arr.shape)
        head = _EXT_LAYOUT[arr.ndim].pack(_DTYPE_CODE[arr.dtype], arr.ndim, start, *arr.shape)
        return msgspec.msgpack.Ext(_EXT_ARRAY, head)


class _Writer(threading.local):
    """One per thread: an encoder made once, and the data region its hook lays arrays out in,
    set only while one `_layout` runs (and cleared after, so no array stays referenced)."""

    def __init__(self) -> None:
        self.data: _Data | None = None
        self.encoder = msgspec.msgpack.Encoder(enc_hook=self.hook)

    def hook(self, obj: Any) -> Any:
        if isinstance(obj, np.generic):
            return obj.item()  # a numpy scalar, stored as the Python scalar
        assert self.data is not None
        return self.data.ext(_to_numpy(obj))


_WRITER = _Writer()


def encode(group: RolloutGroup) -> bytes:
    """Encode a group to one immutable `bytes` message (one copy of each array's data)."""
    return _joined(_layout(group).parts)


def _joined(parts: list[Any]) -> bytes:
    try:
        return b"".join(parts)
    except TypeError:  # a strided view (a sample built by hand): copy it to contiguous first
        return b"".join([_contiguous(p) for p in parts])


def encode_into(
    group: RolloutGroup, storage: Callable[[int], npt.NDArray[np.uint8] | None]
) -> bytes | memoryview:
    """Encode a group into memory of the caller's: `storage(size)` returns a writable uint8
    array of at least `size` bytes, and the message is the read-only view of its first `size`
    bytes (the same bytes `encode` returns); or it returns None, and the message is a new
    `bytes` as from `encode`. A buffer that recycles its storage this way writes into pages
    that are already mapped instead of faulting in fresh ones for every group.
    """
    data = _layout(group)
    parts = data.parts
    head = len(parts[0]) + len(parts[1]) + len(parts[2])
    size = head + data.offset
    out = storage(size)
    if out is None:
        return _joined(parts)
    # The head and the packed prompt, token ids, logprobs and versions go in as one `bytes`
    # when they are small: a second copy of up to `_JOIN_LIMIT` bytes (a few µs at most) costs
    # less than `np.concatenate`'s fixed costs (about 0.5 µs per call and 0.2 µs per array:
    # three calls of 8 arrays for a group of 8). Then each other segment, with numpy.
    if data.packed_end <= _JOIN_LIMIT:
        first, done = _joined(parts[: data.packed_parts]), len(_PACKED) + 1
    else:
        first, done = b"".join(parts[: len(_HEAD)]), 0
    view = out.data  # bytes go in through the memoryview: cheaper than numpy's assignment
    view[: len(first)] = first
    end = len(first)
    for start, arrays, dtype, shape in data.segments[done:]:
        start += head
        if start > end:  # padding: the same bytes as `encode`, whatever was there before
            view[end:start] = _ZEROS[: start - end]
        target = np.ndarray(shape, dtype, buffer=out, offset=start)
        end = start + target.nbytes
        if len(arrays) == 1:
            target[...] = arrays[0]
        elif end > start:
            np.concatenate(arrays, out=target)
    return view[:size].toreadonly()


def _layout(group: RolloutGroup) -> _Data:
    """The message: its head (frame prefix, msgpack header, padding) and its data region.

    The per-group cost is mostly fixed and in C: the samples are turned into columns with one
    `zip`, the packed arrays are laid out whole, and no Python callback runs for them; only
    arrays elsewhere (metadata, `extra`, a loss mask, turn boundaries, routed experts that do
    not line up) go through the encoder's hook.
    """
    metadata = group.metadata
    if metadata or type(metadata) is not dict:
        _check_mapping(metadata, f"group {group.uid}'s metadata")
    columns = list(zip(*map(msgspec.structs.astuple, group.samples), strict=True))
    extras = columns[_EXTRA_AT]
    if extras.count({}) != len(extras):  # one `==` per sample, in C: not all empty dicts
        for extra in extras:
            _check_mapping(extra, f"group {group.uid}'s sample extra")
    lengths = list(map(len, columns[0]))
    total = sum(lengths)
    prompt = group.prompt_tokens
    data = _Data(prompt, columns, total)
    rows, columns[_ROWS_AT] = _pack_rows(data, columns[_ROWS_AT], lengths, total)
    fields = list(msgspec.structs.astuple(group))
    fields[_PROMPT_AT] = len(prompt)
    fields[_SAMPLES_AT] = [lengths, *columns[_SAMPLE_REST:]]
    writer = _WRITER
    writer.data = data
    try:
        header = writer.encoder.encode([rows, *fields])
    except (TypeError, OverflowError, RecursionError) as exc:
        raise _encode_failed(exc, f"group {group.uid}") from None
    finally:
        writer.data = None
    start = _PREFIX.size + len(header)
    data.parts[: len(_HEAD)] = (
        _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header), data.offset),
        header,
        _ZEROS[: -start % ALIGN],
    )
    return data


def _contiguous(part: Any) -> Any:
    return np.ascontiguousarray(part) if isinstance(part, np.ndarray) else part


def _pack_rows(
    data: _Data, rows: tuple[Any, ...], lengths: list[int], total: int
) -> tuple[tuple[int, tuple[int, ...]] | None, Any]:
    """Lay every sample's routed experts out as one array where they line up: numpy arrays of
    one dtype and row shape, one row per token. Returns that array's dtype code and row shape
    for the header (or None), and the rows' column for the header (see `_WireSamples`)."""
    first = rows[0]
    if first is None:
        first = next((r for r in rows if r is not None), None)
        if first is None:
            return None, None  # no sample has any
    if type(first) is not np.ndarray or not first.ndim or first.dtype not in _DTYPE_CODE:
        return None, rows  # each sample's own array, through the hook
    dtype, row = first.dtype, first.shape[1:]
    count, gaps = total, False  # the rows to pack; whether a sample has none
    for r, n in zip(rows, lengths, strict=True):
        if r is None:
            count, gaps = count - n, True
        elif type(r) is not np.ndarray or r.dtype != dtype or r.shape != (n, *row):
            return None, rows
    if not gaps:  # the common case
        data.place(rows, dtype, (total, *row))
        return (_DTYPE_CODE[dtype], row), True
    data.place([r for r in rows if r is not None], dtype, (count, *row))
    return (_DTYPE_CODE[dtype], row), [None if r is None else True for r in rows]
