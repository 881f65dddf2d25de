"""A rank's share of a batch as bytes, for the control group's scatter: the share's msgspec
struct with every tensor as an array (`asyncroll.codec.encode_value`, no pickle), rebuilt on the
receiving rank as the same struct of CPU tensors. The trainer moves it to its device."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import numpy as np
import torch

from asyncroll.codec import decode_value, encode_value

S = TypeVar("S")


def encode(share: Any) -> bytes:
    """`share` (a msgspec struct of tensors, numbers and lists of such structs) as bytes."""
    return encode_value(_plain(share))


def decode(data: bytes, kind: type[S]) -> S:
    """The `kind` struct that `encode` was given, its tensors on the CPU."""
    return msgspec.convert(decode_value(data), kind, dec_hook=_tensor)


def _plain(obj: Any) -> Any:
    """Structs as dicts and lists as lists, all the way down; tensors as numpy arrays."""
    if isinstance(obj, msgspec.Struct):
        return {f: _plain(getattr(obj, f)) for f in obj.__struct_fields__}
    if isinstance(obj, list | tuple):
        return [_plain(x) for x in obj]
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    return obj


def _tensor(kind: type, obj: Any) -> Any:
    if kind is torch.Tensor and isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)  # decode_value's arrays are writable copies
    raise NotImplementedError(f"cannot rebuild a {kind.__name__} from {type(obj).__name__}")
