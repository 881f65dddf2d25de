"""Bytes to a group, zero-copy: every array is a read-only view into the message, after the
frame, the packed arrays' extent, every extension's bounds and alignment and the typed header
are checked (see `asyncroll.codec`).
"""

from __future__ import annotations

import itertools
import math
import threading
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from asyncroll.codec._arrays import _DTYPES, _MAX_NDIM, CodecError
from asyncroll.codec._wire import (
    _EXT_ARRAY,
    _EXT_LAYOUT,
    _INT32,
    _PACKED_DTYPES,
    _PREFIX,
    _PROMPT_AT,
    _ROWS_COLUMN,
    _SAMPLES_AT,
    ALIGN,
    FORMAT_VERSION,
    MAGIC,
    _WireGroup,
)
from asyncroll.types import RolloutGroup, RolloutState


def decode(data: bytes | bytearray | memoryview) -> RolloutGroup:
    """Decode a message from `encode`; arrays are read-only views into `data` (no copy).

    The views keep `data` alive; hold on to a decoded group only as long as you need it.
    """
    if len(data) < _PREFIX.size:
        raise CodecError(f"truncated message: {len(data)} bytes is shorter than the frame header")
    magic, fmt, _, header_len, data_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CodecError(f"not an encoded RolloutGroup (magic {magic!r})")
    if fmt != FORMAT_VERSION:
        raise CodecError(f"encoded with format {fmt}, this asyncroll reads format {FORMAT_VERSION}")
    header_end = _PREFIX.size + header_len
    data_start = header_end + (-header_end % ALIGN)
    if data_start + data_len != len(data):
        raise CodecError(
            f"truncated or padded message: {len(data)} bytes, the frame says "
            f"{data_start + data_len}"
        )
    reader = _READER
    # Views of a mutable buffer would be writable: read through a read-only view instead.
    buf = data if isinstance(data, bytes) else memoryview(data).toreadonly()
    reader.region = (buf, data_start, data_len)
    try:
        wire = reader.decoder.decode(data[_PREFIX.size : header_end])
        return _unpack(wire, buf, data_start, data_len)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CodecError(f"corrupt group header: {exc}") from None
    except RecursionError:
        raise CodecError("corrupt group header: nested too deep") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CodecError):
            raise
        raise CodecError(f"corrupt group: {exc}") from None
    finally:
        reader.region = None  # the reader must not keep the message alive


class _Reader(threading.local):
    """One per thread: a typed decoder made once (making one costs about as much as decoding
    a small header) and the message its extension hook reads arrays from, set only while one
    `decode` runs (a decode never starts another in the same thread)."""

    def __init__(self) -> None:
        # The message, where its data region starts in it and the region's length; one
        # attribute, set and cleared once per decode (a thread-local's attributes are slow).
        self.region: tuple[Any, int, int] | None = None
        self.decoder = msgspec.msgpack.Decoder(_WireGroup, ext_hook=self.array)

    def array(self, code: int, payload: memoryview) -> npt.NDArray[Any]:
        """An array of the data region from its extension value, after checking its bounds."""
        if code != _EXT_ARRAY or len(payload) < _EXT_LAYOUT[0].size:
            raise CodecError(f"unknown extension value (code {code}, {len(payload)} bytes)")
        ndim = payload[1]
        if ndim > _MAX_NDIM or len(payload) != _EXT_LAYOUT[ndim].size:
            raise CodecError(f"bad array header (ndim {ndim}, {len(payload)} bytes)")
        dtype_code, _, offset, *shape = _EXT_LAYOUT[ndim].unpack(payload)
        if dtype_code >= len(_DTYPES):
            raise CodecError(f"bad array header (dtype code {dtype_code})")
        dtype = _DTYPES[dtype_code]
        count = math.prod(shape)
        assert self.region is not None
        buf, start, size = self.region
        if min(shape, default=0) < 0 or offset + count * dtype.itemsize > size:
            raise CodecError(f"array of shape {shape} at {offset} lies outside the data region")
        if offset % ALIGN:
            raise CodecError(f"array at offset {offset} is not aligned to {ALIGN} bytes")
        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=start + offset)
        return arr if ndim == 1 else arr.reshape(shape)


_READER = _Reader()


def _packed(
    buf: Any,
    start: int,
    size: int,
    prompt: int,
    total: int,
    row_count: int,
    rows: tuple[int, tuple[int, ...]] | None,
) -> tuple[Any, Any, Any, Any, Any]:
    """The packed prompt (`prompt` tokens), token ids, logprobs, versions (`total` entries
    each) and routed experts (None, or `row_count` rows of `rows`: dtype code and row shape)
    in the data region (`size` bytes from `start` in `buf`), where `_Data` placed them: back
    to back, each on the next aligned offset. Straight-line code: this runs once per decoded
    group."""
    nbytes = total * 4  # every packed dtype (int32, float32, int32) has 4-byte items
    step = nbytes + (-nbytes % ALIGN)
    first = prompt * 4 + (-prompt * 4 % ALIGN)
    end = first + 2 * step + nbytes
    if end > size:
        raise CodecError(f"packed arrays of {prompt} + {total} entries overrun the data region")
    prompt_tokens = np.frombuffer(buf, _INT32, prompt, start)
    at = start + first
    tokens = np.frombuffer(buf, _PACKED_DTYPES[0], total, at)
    logprobs = np.frombuffer(buf, _PACKED_DTYPES[1], total, at + step)
    versions = np.frombuffer(buf, _PACKED_DTYPES[2], total, at + 2 * step)
    if rows is None:
        return prompt_tokens, tokens, logprobs, versions, None
    code, row = rows
    dtype, offset = _DTYPES[code], end + (-end % ALIGN)
    if offset + row_count * math.prod(row) * dtype.itemsize > size:
        raise CodecError(f"packed arrays of {total} entries overrun the data region")
    experts = np.ndarray((row_count, *row), dtype, buf, start + offset)
    return prompt_tokens, tokens, logprobs, versions, experts


def _unpack(wire: Any, buf: Any, start: int, size: int) -> RolloutGroup:
    """Rebuild the group: slice the packed arrays back into each sample's views, and build the
    samples with one `map` of `RolloutState` over the columns. Per sample that leaves the views
    and `RolloutState.__post_init__`, whose fast path decoded arrays take (their dtypes are
    numpy's own instances)."""
    layout, *fields = msgspec.structs.astuple(wire)
    columns = list(msgspec.structs.astuple(fields[_SAMPLES_AT]))
    lengths = columns[0]
    count = len(lengths)
    mine = columns[_ROWS_COLUMN]
    sized = columns if type(mine) is tuple else columns[:_ROWS_COLUMN]
    if list(map(len, sized)) != [count] * len(sized):
        raise CodecError(f"corrupt group header: sample columns of lengths {list(map(len, sized))}")
    ends = list(itertools.accumulate(lengths))
    total = ends[-1] if ends else 0  # (no samples: `RolloutGroup` refuses it below)
    slices = list(map(slice, [0, *ends], ends))
    if mine is True:
        packed_rows = total
    elif type(mine) is tuple:
        # The packed rows are those of the samples that carry True in their place, in order,
        # so the samples use exactly all of them.
        packed_rows = sum([n for n, r in zip(lengths, mine, strict=True) if r is True])
    else:
        packed_rows = 0
    prompt, tokens, logprobs, versions, rows = _packed(
        buf, start, size, fields[_PROMPT_AT], total, packed_rows, layout
    )
    if mine is True:
        if rows is None:
            raise CodecError("corrupt group header: packed rows without their layout")
        mine = [rows[at] for at in slices]
    elif mine is None:
        mine = itertools.repeat(None)
    elif mine is False:
        raise CodecError("corrupt group header: routed experts False")
    else:
        mine = _own_rows(mine, lengths, rows)
    columns[_ROWS_COLUMN] = mine
    fields[_PROMPT_AT] = prompt
    fields[_SAMPLES_AT] = tuple(
        map(
            RolloutState,
            [tokens[at] for at in slices],  # (cheaper than a map of `__getitem__`)
            [logprobs[at] for at in slices],
            [versions[at] for at in slices],
            *columns[1:],
        )
    )
    return RolloutGroup(*fields)


def _own_rows(column: tuple[Any, ...], lengths: tuple[int, ...], rows: Any) -> list[Any]:
    """The samples' routed experts where not every sample's are packed: the next rows of the
    packed array for True, a sample's own array, or None."""
    out: list[Any] = []
    end = 0
    for r, n in zip(column, lengths, strict=True):
        if r is True and rows is not None:
            out.append(rows[end : end + n])
            end += n
        elif r is None or type(r) is np.ndarray:
            out.append(r)
        else:
            raise CodecError(f"bad routed experts of a sample: {type(r).__name__}")
    return out


# -- single values -------------------------------------------------------------------------------
