"""What the codec carries, and the checks on it: the dtypes it encodes (each with its code on
the wire), arrays and torch tensors as C-contiguous little-endian numpy arrays, and the limits
on metadata-like values (their type, mapping shape and nesting depth). Shared by groups
(`_encode`) and single values (`_value`), so both refuse the same things the same way.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import numpy.typing as npt

_MAX_NDIM = 32
MAX_DEPTH = 100
"""How deep containers may nest in metadata, `extra` and `encode_value`. A fixed limit rather
than msgspec's, which is Python's recursion limit minus the caller's stack depth: what encodes
in one place must decode in every other (a checkpoint written at the top of a stack is loaded
deep inside another)."""
_SUPPORTED = (
    "None, bool, int, float, str, bytes, lists, tuples, dicts, numpy arrays and scalars "
    "and torch tensors"
)

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
