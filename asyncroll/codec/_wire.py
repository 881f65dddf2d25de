"""The wire format's frame and typed header: the frame prefix, the extension codes and their
layouts, and the msgspec structs the header decodes into. The structs are built from
`RolloutState`'s and `RolloutGroup`'s own field lists, so a field added there is carried here
without a change; the checks below refuse a reordering this format cannot follow.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any

import msgspec
import numpy as np

from asyncroll.codec._arrays import _DTYPES, _MAX_NDIM
from asyncroll.types import RolloutGroup, RolloutState

MAGIC = b"ARGR"
FORMAT_VERSION = 5  # 5: the prompt packed too, the samples as columns
ALIGN = 64
_PREFIX = struct.Struct("<4sHHIQ")
_EXT_ARRAY = 1  # in a group: the array's bytes lie in the data region
_EXT_INLINE_ARRAY = 2  # in a value: the array's bytes follow its header in the payload
# Extension payload per ndim: dtype code, ndim, offset into the data region, then the shape.
_EXT_LAYOUT = [struct.Struct(f"<BBQ{n}q") for n in range(_MAX_NDIM + 1)]
# Inline payload per ndim: dtype code, ndim, the shape; then the array's bytes.
_INLINE_LAYOUT = [struct.Struct(f"<BB{n}q") for n in range(_MAX_NDIM + 1)]

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
