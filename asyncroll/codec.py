"""Encode a `RolloutGroup` to bytes and back, with zero-copy decoding.

The message is msgspec msgpack in which every array is an extension value (code 1) holding
only its dtype, shape and offset; the raw array bytes follow the msgpack header in one data
region, each array starting on a 64-byte boundary::

    "ARGR" | format u16 | reserved u16 | header_len u32 | data_len u64 | header | pad | data

Keeping the bytes out of band is what makes decoding zero-copy *and* aligned: `decode` returns
read-only numpy views into the message (an in-band extension payload could sit at any offset,
which numpy tolerates but kernels and `torch.from_numpy` pay for). Encoding copies each array
exactly once, into the final `bytes` object. Torch tensors are accepted and moved to the CPU.

Corrupt or truncated input raises `CodecError` after checking the frame, every extension's
bounds and the typed schema; array *contents* are not checksummed (checkpoints add a checksum
of their own, in-memory buffer entries are immutable `bytes`).
"""

from __future__ import annotations

import math
import struct
import sys
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from asyncroll.types import RolloutGroup

__all__ = ["CodecError", "decode", "encode"]

MAGIC = b"ARGR"
FORMAT_VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<4sHHIQ")
_EXT_ARRAY = 1
_EXT_HEAD = struct.Struct("<BBQ")  # dtype code, ndim, offset into the data region; then the shape
_ZEROS = memoryview(bytes(ALIGN))
_MAX_NDIM = 32
# One precompiled extension layout per ndim: the per-array cost is what bounds groups/s.
_EXT_LAYOUT = [struct.Struct(f"<BBQ{n}q") for n in range(_MAX_NDIM + 1)]

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


def _to_numpy(obj: Any) -> npt.NDArray[Any]:
    """A C-contiguous little-endian numpy view or copy of an array or torch tensor."""
    if not isinstance(obj, np.ndarray):
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.Tensor):
            raise TypeError(f"cannot encode object of type {type(obj).__name__}")
        if obj.dtype == torch.bfloat16:
            raise TypeError("cannot encode a bfloat16 tensor: numpy has no bfloat16; cast it first")
        obj = obj.detach().cpu().numpy()
    arr: npt.NDArray[Any] = np.asarray(obj)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


def encode(group: RolloutGroup) -> bytes:
    """Encode a group to one immutable `bytes` message (one copy of each array's data)."""
    parts: list[Any] = []
    offset = 0

    def hook(obj: Any) -> msgspec.msgpack.Ext:
        nonlocal offset
        arr = obj if type(obj) is np.ndarray and obj.flags.c_contiguous else _to_numpy(obj)
        code = _DTYPE_CODE.get(arr.dtype)
        if code is None:  # big-endian, or a dtype the format does not carry
            arr = _to_numpy(arr)
            code = _DTYPE_CODE.get(arr.dtype)
            if code is None:
                raise TypeError(f"cannot encode arrays of dtype {arr.dtype}")
        pad = -offset % ALIGN
        if pad:
            parts.append(_ZEROS[:pad])
            offset += pad
        ndim = arr.ndim
        head = _EXT_LAYOUT[ndim].pack(code, ndim, offset, *arr.shape)
        if arr.nbytes:
            parts.append(arr.data.cast("B") if ndim else arr.tobytes())
            offset += arr.nbytes
        return msgspec.msgpack.Ext(_EXT_ARRAY, head)

    header = msgspec.msgpack.Encoder(enc_hook=hook).encode(group)
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
        if code != _EXT_ARRAY or len(payload) < _EXT_HEAD.size:
            raise CodecError(f"unknown extension value (code {code}, {len(payload)} bytes)")
        ndim = payload[1]
        if ndim > _MAX_NDIM or len(payload) != _EXT_LAYOUT[ndim].size:
            raise CodecError(f"bad array header (ndim {ndim}, {len(payload)} bytes)")
        dtype_code, _, offset, *shape = _EXT_LAYOUT[ndim].unpack(payload)
        if dtype_code >= len(_DTYPES):
            raise CodecError(f"bad array header (dtype code {dtype_code})")
        dtype = _DTYPES[dtype_code]
        count = shape[0] if ndim == 1 else math.prod(shape)
        if min(shape, default=0) < 0 or offset + count * dtype.itemsize > data_len:
            raise CodecError(f"array of shape {shape} at {offset} lies outside the data region")
        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=data_start + offset)
        return arr if ndim == 1 else arr.reshape(shape)

    decoder = msgspec.msgpack.Decoder(RolloutGroup, ext_hook=ext_hook)
    try:
        return decoder.decode(memoryview(data)[_PREFIX.size : header_end])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CodecError(f"corrupt group header: {exc}") from None
