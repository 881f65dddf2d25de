"""Encode a `RolloutGroup` to bytes and back, with zero-copy decoding.

The message is a msgspec msgpack header followed by one data region that holds the raw bytes of
every array, each starting on a 64-byte boundary::

    "ARGR" | format u16 | reserved u16 | header_len u32 | data_len u64 | header | pad | data

Keeping the bytes out of band is what makes decoding zero-copy *and* aligned: `decode` returns
read-only numpy views into the message (an in-band extension payload could sit at any offset,
which numpy tolerates but kernels and `torch.from_numpy` pay for). Encoding copies each array
exactly once, into the final `bytes` object (`encode`) or into memory the caller recycles
(`encode_into`). Torch tensors are accepted and moved to the CPU.

The work is per group, not per sample (format 5). The prompt's tokens and the samples' token
ids, logprobs and versions are written back to back as four packed arrays at the start of the
data region, and the samples' routed experts as one more when every sample's rows line up
(same dtype and row shape, one row per token). Where the packed arrays lie follows from the
lengths in the header (and the rows' dtype and row shape), so they need no extension value:
`decode` makes each with one numpy call and slices it into per-sample views. Any other array
(in metadata or `extra`, a loss mask, turn boundaries, rows that do not line up) is an
extension value (code 1) holding its dtype, shape and offset, and costs a Python callback on
each side (about 2 µs on decode). The samples' other fields travel as columns, one msgpack
array per field rather than one struct per sample: `encode` gets them with one `zip`, msgspec
decodes and checks them as one object, and `decode` builds every sample with one `map` of
`RolloutState` over them. For groups of 8 samples such fixed costs, not the copy, dominate up
to about 1 MiB; what is left per sample is numpy making views (four per sample) and
`RolloutState.__post_init__` on decode, and the check that the rows line up on encode. Both
sides reuse one encoder and one typed decoder per thread.

Corrupt or truncated input raises `CodecError` after checking the frame, the packed arrays'
extent, every extension's bounds and alignment and the typed schema (which also bounds the
lengths and the rows' dtype code and shape); array *contents* are not checksummed (checkpoints
add a checksum of their own, in-memory buffer entries are read-only).

Metadata and `extra` take what msgpack does plus numpy arrays, torch tensors and numpy scalars
(which pandas and HF datasets hand out; they are stored as the Python scalar). Anything else,
containers nested deeper than `MAX_DEPTH`, and metadata or an `extra` that is not a dict with
str keys (what `decode` reads back) raise `CodecError` on encode.

`encode_value` / `decode_value` carry one such value on its own (a prompt's metadata in a
checkpoint). Their arrays travel inside the msgpack as extension values (code 2) and decode to
writable copies: that data is small and long-lived, so it must not pin the buffer it came in.
"""

from __future__ import annotations

import itertools
import math
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt

from asyncroll.types import RolloutGroup, RolloutState

__all__ = [
    "MAX_DEPTH",
    "CodecError",
    "decode",
    "decode_value",
    "encode",
    "encode_into",
    "encode_value",
]

MAGIC = b"ARGR"
FORMAT_VERSION = 5  # 5: the prompt packed too, the samples as columns
ALIGN = 64
_PREFIX = struct.Struct("<4sHHIQ")
_EXT_ARRAY = 1  # in a group: the array's bytes lie in the data region
_EXT_INLINE_ARRAY = 2  # in a value: the array's bytes follow its header in the payload
_MAX_NDIM = 32
# Extension payload per ndim: dtype code, ndim, offset into the data region, then the shape.
_EXT_LAYOUT = [struct.Struct(f"<BBQ{n}q") for n in range(_MAX_NDIM + 1)]
# Inline payload per ndim: dtype code, ndim, the shape; then the array's bytes.
_INLINE_LAYOUT = [struct.Struct(f"<BB{n}q") for n in range(_MAX_NDIM + 1)]
MAX_DEPTH = 100
"""How deep containers may nest in metadata, `extra` and `encode_value`. A fixed limit rather
than msgspec's, which is Python's recursion limit minus the caller's stack depth: what encodes
in one place must decode in every other (a checkpoint written at the top of a stack is loaded
deep inside another)."""
_SUPPORTED = (
    "None, bool, int, float, str, bytes, lists, tuples, dicts, numpy arrays and scalars "
    "and torch tensors"
)
_ZEROS = memoryview(bytes(ALIGN))
_HEAD = (b"", b"", b"")  # where a message's parts leave room for its head
_JOIN_LIMIT = 256 * 1024  # `encode_into` copies packed arrays up to this size twice (see there)

_DTYPES: tuple[np.dtype[Any], ...] = tuple(
    np.dtype(t) if np.dtype(t).byteorder in "=|" and sys.byteorder == "little"
    else np.dtype(t).newbyteorder("<")
    for t in (
        np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
        np.int64, np.uint64, np.float16, np.float32, np.float64,
    )
)  # fmt: skip
# (numpy's own dtype instances where they are little-endian: decoded arrays then pass the
# identity checks of `RolloutState.__post_init__`)
_DTYPE_CODE = {dt: code for code, dt in enumerate(_DTYPES)}


class CodecError(ValueError):
    """The bytes are not a valid encoded group or value (corrupt, truncated or of another
    format), or a value cannot be encoded (its type, or its nesting depth)."""


# -- wire structs --------------------------------------------------------------------------------
# Built from the public structs' own field lists, so a field added there is carried here.

_PACKED = ("tokens", "logprobs", "versions")  # RolloutState's first three fields
_PACKED_DTYPES = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.int32))
_INT32 = _PACKED_DTYPES[0]
_ROWS = "routed_experts"  # one row per token: packed as well when every sample's rows line up


def _field_specs(cls: Any) -> list[tuple[Any, ...]]:
    specs: list[tuple[Any, ...]] = []
    for f in msgspec.structs.fields(cls):
        if f.default is not msgspec.NODEFAULT:
            specs.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            specs.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            specs.append((f.name, f.type))
    return specs


_STATE_FIELDS = [f.name for f in msgspec.structs.fields(RolloutState)]
_GROUP_FIELDS = [f.name for f in msgspec.structs.fields(RolloutGroup)]
if (
    _STATE_FIELDS[:3] != list(_PACKED)
    or _ROWS not in _STATE_FIELDS
    or not {"prompt_tokens", "samples"} <= set(_GROUP_FIELDS)
):
    raise ImportError(
        "asyncroll.codec expects tokens, logprobs, versions first in RolloutState, "
        f"{_ROWS} in it, and prompt_tokens and samples in RolloutGroup"
    )
_SAMPLE_REST = len(_PACKED)  # RolloutState fields from here on go on the wire as columns
_ROWS_AT = _STATE_FIELDS.index(_ROWS)
_ROWS_COLUMN = _ROWS_AT - _SAMPLE_REST + 1  # the rows' place among `_WireSamples`' columns
_EXTRA_AT = _STATE_FIELDS.index("extra")
_Length = Annotated[int, msgspec.Meta(ge=0)]


def _column(tp: Any) -> Any:
    """The wire type of one column of samples: a tuple of `tp`, one per sample."""
    return tuple[tp, ...]


# The samples as columns, one tuple per field: msgspec builds and checks one object per group
# instead of one per sample. The rows' column is True when every sample's rows are packed,
# None when no sample has any, otherwise one entry per sample (True, None or its own array).
_WireSamples: Any = msgspec.defstruct(
    "_WireSamples",
    [("length", _column(_Length))]
    + [
        (f.name, bool | tuple[Any, ...] | None if f.name == _ROWS else _column(f.type))
        for f in msgspec.structs.fields(RolloutState)[_SAMPLE_REST:]
    ],
    array_like=True,
    frozen=True,
)
# The packed rows' dtype code and row shape, checked by msgspec as it decodes them.
_RowsLayout = tuple[
    Annotated[int, msgspec.Meta(ge=0, lt=len(_DTYPES))],
    Annotated[tuple[_Length, ...], msgspec.Meta(max_length=_MAX_NDIM - 1)],
]
_PROMPT_AT = _GROUP_FIELDS.index("prompt_tokens")
_SAMPLES_AT = _GROUP_FIELDS.index("samples")
_WireGroup: Any = msgspec.defstruct(
    "_WireGroup",
    [(_ROWS, _RowsLayout | None)]
    + [
        (spec[0], _WireSamples)
        if spec[0] == "samples"
        else (spec[0], _Length)  # the prompt's length: its tokens are packed too
        if spec[0] == "prompt_tokens"
        else spec
        for spec in _field_specs(RolloutGroup)
    ],
    array_like=True,
    frozen=True,
)


def _to_numpy(obj: Any) -> npt.NDArray[Any]:
    """A C-contiguous little-endian numpy array (view or copy) of an array or torch tensor,
    of a dtype and rank the format carries."""
    if (
        type(obj) is np.ndarray
        and obj.flags.c_contiguous
        and obj.dtype in _DTYPE_CODE
        and obj.ndim <= _MAX_NDIM
    ):
        return obj
    if not isinstance(obj, np.ndarray):
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.Tensor):
            raise CodecError(
                f"cannot encode a value of type {type(obj).__name__}: use {_SUPPORTED}"
            )
        if obj.dtype == torch.bfloat16:
            raise CodecError(
                "cannot encode a bfloat16 tensor: numpy has no bfloat16; cast it first"
            )
        obj = obj.detach().cpu().numpy()
    arr: npt.NDArray[Any] = np.asarray(obj, order="C")  # keeps 0-d arrays 0-d
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if arr.dtype not in _DTYPE_CODE:
        raise CodecError(
            f"cannot encode arrays of dtype {arr.dtype}: use a bool, int or float dtype"
        )
    if arr.ndim > _MAX_NDIM:
        raise CodecError(f"cannot encode an array of {arr.ndim} dimensions (at most {_MAX_NDIM})")
    return arr


def _check_depth(value: Any, what: str) -> None:
    """`CodecError` if containers in `value` nest more than `MAX_DEPTH` deep. Walks level by
    level rather than recursing: the check must not hit the recursion limit it guards against.
    (Dict keys are not walked: a key is a scalar or a tuple, and a deep tuple key is still
    caught by msgspec's own recursion check.)"""
    level = [value]
    for _ in range(MAX_DEPTH + 1):
        inner: list[Any] = []
        for obj in level:
            if isinstance(obj, dict):
                inner.extend(obj.values())
            elif isinstance(obj, (list, tuple, set, frozenset)):
                inner.extend(obj)
        if not inner:
            return
        level = inner
    raise CodecError(f"{what} is nested more than MAX_DEPTH={MAX_DEPTH} containers deep")


def _check_mapping(value: Any, what: str) -> None:
    """`CodecError` unless `value` is a dict with str keys nested at most `MAX_DEPTH` deep:
    `decode` reads metadata and `extra` back only as such, so a group written with an int key
    or a list would fail only when handed out, its batch already taken from the buffer."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise CodecError(f"{what} must be a dict with str keys, got {_shape_of(value)}")
    _check_depth(value, what)


def _shape_of(value: Any) -> str:
    if isinstance(value, dict):
        keys = sorted({type(k).__name__ for k in value})
        return f"a dict with keys of type {', '.join(keys)}"
    return type(value).__name__


def _encode_failed(exc: TypeError | OverflowError | RecursionError, what: str) -> CodecError:
    """msgspec's own refusals, as `CodecError`."""
    if isinstance(exc, RecursionError):
        return CodecError(f"cannot encode {what}: it is nested too deep")
    return CodecError(f"cannot encode {what}: {exc}")


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


def _value_hook(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()  # a numpy scalar, stored as the Python scalar
    arr = _to_numpy(obj)
    head = _INLINE_LAYOUT[arr.ndim].pack(_DTYPE_CODE[arr.dtype], arr.ndim, *arr.shape)
    return msgspec.msgpack.Ext(_EXT_INLINE_ARRAY, head + arr.tobytes())


def _value_ext_hook(code: int, payload: memoryview) -> npt.NDArray[Any]:
    if code != _EXT_INLINE_ARRAY or len(payload) < _INLINE_LAYOUT[0].size:
        raise CodecError(f"unknown extension value (code {code}, {len(payload)} bytes)")
    dtype_code, ndim = payload[0], payload[1]
    if ndim > _MAX_NDIM or len(payload) < _INLINE_LAYOUT[ndim].size:
        raise CodecError(f"bad array header (ndim {ndim}, {len(payload)} bytes)")
    if dtype_code >= len(_DTYPES):
        raise CodecError(f"bad array header (dtype code {dtype_code})")
    layout = _INLINE_LAYOUT[ndim]
    shape = layout.unpack_from(payload)[2:]
    if min(shape, default=0) < 0:
        raise CodecError(f"bad array header (shape {shape})")
    dtype, count = _DTYPES[dtype_code], math.prod(shape)
    if len(payload) - layout.size != count * dtype.itemsize:
        raise CodecError(
            f"array of shape {shape} and dtype {dtype} needs {count * dtype.itemsize} bytes, "
            f"the value holds {len(payload) - layout.size}"
        )
    arr = np.frombuffer(payload, dtype=dtype, count=count, offset=layout.size)
    return arr.reshape(shape).copy()  # owns its memory: does not pin `payload`'s buffer


_VALUE_ENCODER = msgspec.msgpack.Encoder(enc_hook=_value_hook)
_VALUE_DECODER = msgspec.msgpack.Decoder(ext_hook=_value_ext_hook)
_EMPTY_MAP = _VALUE_ENCODER.encode({})


def encode_value(obj: Any) -> bytes:
    """Encode one metadata-like value: msgpack types, numpy arrays and torch tensors (as
    arrays), numpy scalars (as Python scalars). What comes back is msgpack's plain form, as for
    a group's metadata: tuples and sets as lists, and the other types msgspec encodes on its
    own (dataclasses, enums, ...) as what they encode to.

    Raises `CodecError` naming what it cannot carry; cheap enough to call on every prompt's
    metadata to refuse it before any work is spent on the prompt.
    """
    if type(obj) is dict and not obj:
        return _EMPTY_MAP  # most prompts' metadata, checked twice per group by the producer
    _check_depth(obj, "the value")
    try:
        return _VALUE_ENCODER.encode(obj)
    except (TypeError, OverflowError, RecursionError) as exc:
        raise _encode_failed(exc, "the value") from None


def decode_value(data: bytes | bytearray | memoryview) -> Any:
    """Decode bytes from `encode_value`; arrays are writable copies that own their memory."""
    try:
        value = _VALUE_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise CodecError(f"corrupt value: {exc}") from None
    except RecursionError:
        raise CodecError("corrupt value: nested too deep") from None
    except TypeError as exc:  # e.g. an array decoded as a dict key
        raise CodecError(f"corrupt value: {exc}") from None
    _check_depth(value, "the decoded value")
    return value
