"""One metadata-like value on its own (a prompt's metadata in a checkpoint): msgpack with its
arrays inline as extension values (code 2), decoded to writable copies that own their memory,
since such data is small and long-lived and must not pin the buffer it came in.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from asyncroll.codec._arrays import (
    _DTYPE_CODE,
    _DTYPES,
    _MAX_NDIM,
    CodecError,
    _check_depth,
    _encode_failed,
    _to_numpy,
)
from asyncroll.codec._wire import _EXT_INLINE_ARRAY, _INLINE_LAYOUT


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
