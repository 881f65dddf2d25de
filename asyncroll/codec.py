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
bounds and alignment and the typed schema; array *contents* are not checksummed (checkpoints add
a checksum of their own, in-memory buffer entries are immutable `bytes`).

Metadata and `extra` take what msgpack does plus numpy arrays, torch tensors and numpy scalars
(which pandas and HF datasets hand out; they are stored as the Python scalar). Anything else,
and containers nested deeper than `MAX_DEPTH`, raise `CodecError` on encode.

`encode_value` / `decode_value` carry one such value on its own (a prompt's metadata in a
checkpoint). Their arrays travel inside the msgpack as extension values (code 2) and decode to
writable copies: that data is small and long-lived, so it must not pin the buffer it came in.
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

__all__ = ["MAX_DEPTH", "CodecError", "decode", "decode_value", "encode", "encode_value"]

MAGIC = b"ARGR"
FORMAT_VERSION = 2
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

_DTYPES: tuple[np.dtype[Any], ...] = tuple(
    np.dtype(t).newbyteorder("<")
    for t in (
        np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
        np.int64, np.uint64, np.float16, np.float32, np.float64,
    )
)  # fmt: skip
_DTYPE_CODE = {dt: code for code, dt in enumerate(_DTYPES)}


class CodecError(ValueError):
    """The bytes are not a valid encoded group or value (corrupt, truncated or of another
    format), or a value cannot be encoded (its type, or its nesting depth)."""


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


def _encode_failed(exc: TypeError | OverflowError | RecursionError, what: str) -> CodecError:
    """msgspec's own refusals, as `CodecError`."""
    if isinstance(exc, RecursionError):
        return CodecError(f"cannot encode {what}: it is nested too deep")
    return CodecError(f"cannot encode {what}: {exc}")


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

    def hook(obj: Any) -> Any:
        if type(obj) is _Packed:
            arrays = [_to_numpy(a) for a in obj.arrays]
            dtype = arrays[0].dtype
            if any(a.dtype != dtype for a in arrays):
                raise CodecError(f"samples hold {dtype} and other dtypes in one field")
            count = sum(len(a) for a in arrays)
            head = _EXT_LAYOUT[1].pack(_DTYPE_CODE[dtype], 1, place(arrays), count)
        elif isinstance(obj, np.generic):
            return obj.item()  # a numpy scalar, stored as the Python scalar
        else:
            arr = _to_numpy(obj)
            head = _EXT_LAYOUT[arr.ndim].pack(
                _DTYPE_CODE[arr.dtype], arr.ndim, place([arr]), *arr.shape
            )
        return msgspec.msgpack.Ext(_EXT_ARRAY, head)

    _check_depth(group.metadata, f"group {group.uid}'s metadata")
    for s in group.samples:
        if s.extra:
            _check_depth(s.extra, f"group {group.uid}'s sample extra")
    fields = list(msgspec.structs.astuple(group))
    samples = fields[_SAMPLES_AT]
    fields[_SAMPLES_AT] = tuple(
        _WireSample(len(s.tokens), *msgspec.structs.astuple(s)[_SAMPLE_REST:]) for s in samples
    )
    packed = (_Packed([getattr(s, name) for s in samples]) for name in _PACKED)
    try:
        header = msgspec.msgpack.Encoder(enc_hook=hook).encode(_WireGroup(*packed, *fields))
    except (TypeError, OverflowError, RecursionError) as exc:
        raise _encode_failed(exc, f"group {group.uid}") from None
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
        if offset % ALIGN:
            raise CodecError(f"array at offset {offset} is not aligned to {ALIGN} bytes")
        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=data_start + offset)
        return arr if ndim == 1 else arr.reshape(shape)

    decoder = msgspec.msgpack.Decoder(_WireGroup, ext_hook=ext_hook)
    try:
        wire = decoder.decode(memoryview(data)[_PREFIX.size : header_end])
        return _unpack(msgspec.structs.astuple(wire))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CodecError(f"corrupt group header: {exc}") from None
    except RecursionError:
        raise CodecError("corrupt group header: nested too deep") from None
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


def encode_value(obj: Any) -> bytes:
    """Encode one metadata-like value: msgpack types, numpy arrays and torch tensors (as
    arrays), numpy scalars (as Python scalars). What comes back is msgpack's plain form, as for
    a group's metadata: tuples and sets as lists, and the other types msgspec encodes on its
    own (dataclasses, enums, ...) as what they encode to.

    Raises `CodecError` naming what it cannot carry; cheap enough to call on every prompt's
    metadata to refuse it before any work is spent on the prompt.
    """
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
