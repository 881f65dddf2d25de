"""Encode a `RolloutGroup` to bytes and back, with zero-copy decoding.

The message is msgspec msgpack in which every array is an extension value (code 1) holding
only its dtype, shape and offset; the raw array bytes follow the msgpack header in one data
region, each array starting on a 64-byte boundary::

    "ARGR" | format u16 | reserved u16 | header_len u32 | data_len u64 | header | pad | data

Keeping the bytes out of band is what makes decoding zero-copy *and* aligned: `decode` returns
read-only numpy views into the message (an in-band extension payload could sit at any offset,
which numpy tolerates but kernels and `torch.from_numpy` pay for). Encoding copies each array
exactly once, into the final `bytes` object. Torch tensors are accepted and moved to the CPU.

The samples' token ids, logprobs and versions are written back to back as three arrays per
group rather than three per sample: every extension value costs a Python callback on each side,
and for groups of 8 samples that per-array cost, not the copy, dominated. Decoding slices them
back into per-sample views.

Corrupt or truncated input raises `CodecError` after checking the frame, every extension's
bounds and the typed schema; array *contents* are not checksummed (checkpoints add a checksum
of their own, in-memory buffer entries are immutable `bytes`).
"""

from __future__ import annotations

import itertools
import math
import struct
import sys
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from asyncroll.types import RolloutGroup, RolloutState

__all__ = ["CodecError", "decode", "encode"]

MAGIC = b"ARGR"
FORMAT_VERSION = 2
ALIGN = 64
_PREFIX = struct.Struct("<4sHHIQ")
_EXT_ARRAY = 1
_MAX_NDIM = 32
# Extension payload per ndim: dtype code, ndim, offset into the data region, then the shape.
_EXT_LAYOUT = [struct.Struct(f"<BBQ{n}q") for n in range(_MAX_NDIM + 1)]
_ZEROS = memoryview(bytes(ALIGN))

_DTYPES: tuple[np.dtype[Any], ...] = tuple(
    np.dtype(t).newbyteorder("<")
    for t in (
        np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
        np.int64, np.uint64, np.float16, np.float32, np.float64,
    )
)  # fmt: skip
_DTYPE_CODE = {dt: code for code, dt in enumerate(_DTYPES)}


class CodecError(ValueError):
    """The bytes are not a valid encoded group (corrupt, truncated or of another format)."""


# -- wire structs --------------------------------------------------------------------------------
# Built from the public structs' own field lists, so a field added there is carried here.

_PACKED = ("tokens", "logprobs", "versions")  # RolloutState's first three fields


def _field_specs(cls: Any, skip: tuple[str, ...] = ()) -> list[tuple[Any, ...]]:
    specs: list[tuple[Any, ...]] = []
    for f in msgspec.structs.fields(cls):
        if f.name in skip:
            continue
        if f.default is not msgspec.NODEFAULT:
            specs.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            specs.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            specs.append((f.name, f.type))
    return specs


if [f.name for f in msgspec.structs.fields(RolloutState)][:3] != list(_PACKED):
    raise ImportError("asyncroll.codec expects tokens, logprobs, versions first in RolloutState")
_SAMPLE_REST = len(_PACKED)  # RolloutState fields after the packed ones go on the wire as is
_WireSample: Any = msgspec.defstruct(
    "_WireSample",
    [("length", int), *_field_specs(RolloutState, _PACKED)],
    array_like=True,
    frozen=True,
)
_GROUP_FIELDS = [f.name for f in msgspec.structs.fields(RolloutGroup)]
_SAMPLES_AT = _GROUP_FIELDS.index("samples")
_WireGroup: Any = msgspec.defstruct(
    "_WireGroup",
    [(name, npt.NDArray[Any]) for name in _PACKED]
    + [
        (spec[0], tuple[_WireSample, ...]) if spec[0] == "samples" else spec
        for spec in _field_specs(RolloutGroup)
    ],
    array_like=True,
    frozen=True,
)


class _Packed:
    """One per-sample array field of every sample, written back to back as one array."""

    __slots__ = ("arrays",)

    def __init__(self, arrays: list[Any]) -> None:
        self.arrays = arrays


def _to_numpy(obj: Any) -> npt.NDArray[Any]:
    """A C-contiguous little-endian numpy array (view or copy) of an array or torch tensor,
    of a dtype the format carries."""
    if type(obj) is np.ndarray and obj.flags.c_contiguous and obj.dtype in _DTYPE_CODE:
        return obj
    if not isinstance(obj, np.ndarray):
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.Tensor):
            raise TypeError(f"cannot encode object of type {type(obj).__name__}")
        if obj.dtype == torch.bfloat16:
            raise TypeError("cannot encode a bfloat16 tensor: numpy has no bfloat16; cast it first")
        obj = obj.detach().cpu().numpy()
    arr: npt.NDArray[Any] = np.ascontiguousarray(obj)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if arr.dtype not in _DTYPE_CODE:
        raise TypeError(f"cannot encode arrays of dtype {arr.dtype}")
    return arr


def encode(group: RolloutGroup) -> bytes:
    """Encode a group to one immutable `bytes` message (one copy of each array's data)."""
    parts: list[Any] = []
    offset = 0

    def place(arrays: list[npt.NDArray[Any]]) -> int:
        """Queue arrays back to back at the next aligned offset; return that offset.
        (`bytes.join` reads contiguous numpy arrays through the buffer protocol.)"""
        nonlocal offset
        pad = -offset % ALIGN
        if pad:
            parts.append(_ZEROS[:pad])
        start = offset + pad
        parts.extend(arrays)
        offset = start + sum(a.nbytes for a in arrays)
        return start

    def hook(obj: Any) -> msgspec.msgpack.Ext:
        if type(obj) is _Packed:
            arrays = [_to_numpy(a) for a in obj.arrays]
            dtype = arrays[0].dtype
            if any(a.dtype != dtype for a in arrays):
                raise TypeError(f"samples hold {dtype} and other dtypes in one field")
            count = sum(len(a) for a in arrays)
            head = _EXT_LAYOUT[1].pack(_DTYPE_CODE[dtype], 1, place(arrays), count)
        else:
            arr = _to_numpy(obj)
            head = _EXT_LAYOUT[arr.ndim].pack(
                _DTYPE_CODE[arr.dtype], arr.ndim, place([arr]), *arr.shape
            )
        return msgspec.msgpack.Ext(_EXT_ARRAY, head)

    fields = list(msgspec.structs.astuple(group))
    samples = fields[_SAMPLES_AT]
    fields[_SAMPLES_AT] = tuple(
        _WireSample(len(s.tokens), *msgspec.structs.astuple(s)[_SAMPLE_REST:]) for s in samples
    )
    packed = (_Packed([getattr(s, name) for s in samples]) for name in _PACKED)
    header = msgspec.msgpack.Encoder(enc_hook=hook).encode(_WireGroup(*packed, *fields))
    start = _PREFIX.size + len(header)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header), offset)
    return b"".join([prefix, header, _ZEROS[: -start % ALIGN], *parts])


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
    # Views of a mutable buffer would be writable: read through a read-only view instead.
    buf = data if isinstance(data, bytes) else memoryview(data).toreadonly()

    def ext_hook(code: int, payload: memoryview) -> npt.NDArray[Any]:
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
        if min(shape, default=0) < 0 or offset + count * dtype.itemsize > data_len:
            raise CodecError(f"array of shape {shape} at {offset} lies outside the data region")
        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=data_start + offset)
        return arr if ndim == 1 else arr.reshape(shape)

    decoder = msgspec.msgpack.Decoder(_WireGroup, ext_hook=ext_hook)
    try:
        wire = decoder.decode(memoryview(data)[_PREFIX.size : header_end])
        return _unpack(msgspec.structs.astuple(wire))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CodecError(f"corrupt group header: {exc}") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CodecError):
            raise
        raise CodecError(f"corrupt group: {exc}") from None


def _unpack(wire: tuple[Any, ...]) -> RolloutGroup:
    """Rebuild the group: slice the packed arrays back into each sample's views."""
    tokens, logprobs, versions = wire[: len(_PACKED)]
    fields = list(wire[len(_PACKED) :])
    wire_samples = fields[_SAMPLES_AT]
    lengths = [ws.length for ws in wire_samples]
    total = sum(lengths)
    if min(lengths, default=0) < 0 or not total == len(tokens) == len(logprobs) == len(versions):
        raise CodecError(
            f"sample lengths {lengths} do not match the packed arrays "
            f"({len(tokens)}, {len(logprobs)}, {len(versions)})"
        )
    ends = list(itertools.accumulate(lengths))
    fields[_SAMPLES_AT] = tuple(
        RolloutState(
            tokens[end - n : end],
            logprobs[end - n : end],
            versions[end - n : end],
            *msgspec.structs.astuple(ws)[1:],
        )
        for ws, n, end in zip(wire_samples, lengths, ends, strict=True)
    )
    return RolloutGroup(*fields)
