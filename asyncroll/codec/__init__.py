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

The work is split by job: `_arrays` (what the format carries: dtypes, array conversion, the
checks on values), `_wire` (the frame and the typed msgpack header), `_encode` and `_decode`
(a group to bytes and back), `_value` (one metadata-like value on its own).
"""

from asyncroll.codec._arrays import MAX_DEPTH, CodecError
from asyncroll.codec._decode import decode
from asyncroll.codec._encode import encode, encode_into
from asyncroll.codec._value import decode_value, encode_value
from asyncroll.codec._wire import ALIGN as ALIGN
from asyncroll.codec._wire import FORMAT_VERSION as FORMAT_VERSION
from asyncroll.codec._wire import MAGIC as MAGIC

__all__ = [
    "MAX_DEPTH",
    "CodecError",
    "decode",
    "decode_value",
    "encode",
    "encode_into",
    "encode_value",
]
