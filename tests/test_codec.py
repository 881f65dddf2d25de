import pickle
import struct
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from asyncroll.codec import (
    ALIGN,
    MAGIC,
    MAX_DEPTH,
    CodecError,
    decode,
    decode_value,
    encode,
    encode_into,
    encode_value,
)
from asyncroll.types import RolloutGroup, RolloutState, Status
from tests.factories import make_group, make_sample

DTYPES = [
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
    np.int64, np.uint64, np.float16, np.float32, np.float64,
]  # fmt: skip


def assert_groups_equal(a: RolloutGroup, b: RolloutGroup) -> None:
    """Field-by-field equality, arrays compared by dtype, shape and bits (NaN-safe)."""
    assert type(a) is type(b)
    for name in a.__struct_fields__:
        assert_values_equal(getattr(a, name), getattr(b, name), name)


def assert_values_equal(x: Any, y: Any, where: str) -> None:
    if isinstance(x, torch.Tensor):
        x = x.numpy()
    if isinstance(x, np.ndarray):
        assert isinstance(y, np.ndarray), where
        assert x.dtype == y.dtype and x.shape == y.shape, where
        assert x.tobytes() == y.tobytes(), where
    elif isinstance(x, (RolloutState, RolloutGroup)):
        for name in x.__struct_fields__:
            assert_values_equal(getattr(x, name), getattr(y, name), f"{where}.{name}")
    elif isinstance(x, (tuple, list)):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            assert_values_equal(u, v, f"{where}[{i}]")
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            assert_values_equal(x[k], y[k], f"{where}[{k!r}]")
    else:
        assert x == y, where


def test_round_trip_is_exact(group: RolloutGroup) -> None:
    assert_groups_equal(group, decode(encode(group)))


def test_decode_is_zero_copy_read_only_and_aligned() -> None:
    group = make_group(samples=3, tokens=1001, payload=7)
    data = encode(group)
    out = decode(data)
    base = np.frombuffer(data, dtype=np.uint8)
    for s in out.samples:
        for arr in (s.tokens, s.logprobs, s.versions, s.routed_experts):
            assert arr is not None
            assert np.shares_memory(arr, base)  # a view into the message, not a copy
            assert not arr.flags.writeable
            assert arr.flags.aligned
    first = out.samples[0]  # each packed field and each other array starts on ALIGN bytes
    for arr in (first.tokens, first.logprobs, first.versions, first.routed_experts):
        assert arr is not None
        assert (arr.ctypes.data - base.ctypes.data) % ALIGN == 0
    with pytest.raises(ValueError, match="read-only"):
        out.samples[0].tokens[0] = 1


def test_decoded_arrays_have_numpy_own_dtypes() -> None:
    """`RolloutState.__post_init__` takes its fast path (identity checks) for decoded samples
    only if their dtypes are numpy's own instances, not equal copies."""
    out = decode(encode(make_group(samples=2, tokens=5)))
    for s in out.samples:
        assert s.tokens.dtype is np.dtype(np.int32)
        assert s.logprobs.dtype is np.dtype(np.float32)
        assert s.versions.dtype is np.dtype(np.int32)
    assert out.prompt_tokens.dtype is np.dtype(np.int32)


def test_decoding_a_mutable_buffer_still_gives_read_only_views(group: RolloutGroup) -> None:
    data = bytearray(encode(group))
    out = decode(data)
    assert not out.samples[0].tokens.flags.writeable


def test_encode_copies_so_later_mutation_does_not_leak_in() -> None:
    group = make_group(tokens=8)
    data = encode(group)
    original = group.samples[0].tokens.copy()
    group.samples[0].tokens[:] = 99  # the caller mutates its own array after encoding
    assert (decode(data).samples[0].tokens == original).all()


def test_views_keep_the_message_alive_and_nothing_else() -> None:
    group = make_group(tokens=64)
    data = encode(group)
    message_id = id(data)
    ref = weakref.ref(out := decode(data))
    tokens = out.samples[0].tokens
    del out, data
    assert ref() is None  # the struct is gone...
    owner: Any = tokens
    while isinstance(owner, np.ndarray):
        owner = owner.base
    assert type(owner) is bytes and id(owner) == message_id  # ...the view holds the message
    assert tokens.tolist() == group.samples[0].tokens.tolist()  # and reads its tokens


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips_in_extra(dtype: type) -> None:
    arr = (np.arange(24) % 2).astype(dtype).reshape(2, 3, 4)
    group = make_group(metadata={"label": 3, "arr": arr})
    out = decode(encode(group))
    assert out.metadata["arr"].dtype == arr.dtype
    assert (out.metadata["arr"] == arr).all()


def test_big_endian_and_non_contiguous_arrays_are_normalized() -> None:
    big = np.arange(10, dtype=">i8")
    strided = np.arange(20, dtype=np.float32)[::2]
    out = decode(encode(make_group(metadata={"big": big, "strided": strided})))
    assert (out.metadata["big"] == big).all() and out.metadata["big"].dtype == np.int64
    assert (out.metadata["strided"] == strided).all()


def test_torch_tensors_are_accepted_on_encode() -> None:
    sample = RolloutState(
        tokens=np.arange(4, dtype=np.int32),
        logprobs=np.zeros(4, np.float32),
        versions=np.zeros(4, np.int32),
        routed_experts=torch.arange(8, dtype=torch.int16).reshape(4, 2),  # type: ignore[arg-type]
        extra={"hidden": torch.ones(2, 3)},
    )
    group = make_group()
    group = RolloutGroup(
        uid=1, prompt_id="p", task="t", prompt_tokens=group.prompt_tokens, samples=(sample,)
    )
    out = decode(encode(group)).samples[0]
    assert out.routed_experts is not None
    assert out.routed_experts.dtype == np.int16
    assert out.routed_experts.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert out.extra["hidden"].dtype == np.float32 and out.extra["hidden"].shape == (2, 3)


def test_numpy_scalars_in_metadata_and_extra_become_python_scalars() -> None:
    """What pandas and HF datasets hand out: numpy scalars, at any depth; arrays stay arrays."""
    metadata = {
        "label": np.int64(7),
        "score": np.float32(0.5),
        "ok": np.bool_(True),
        "name": np.str_("x"),
        "nested": [{"k": np.uint8(3)}, (np.float64(1.5),)],
        "arr": np.arange(3),
    }
    sample = make_sample()
    sample = RolloutState(
        sample.tokens, sample.logprobs, sample.versions, extra={"len": np.int32(4)}
    )
    group = make_group(metadata=metadata)
    group = RolloutGroup(
        uid=0, prompt_id="p", task="t", prompt_tokens=group.prompt_tokens, samples=(sample,),
        metadata=metadata,
    )  # fmt: skip
    out = decode(encode(group))
    assert out.metadata["label"] == 7 and type(out.metadata["label"]) is int
    assert out.metadata["score"] == 0.5 and type(out.metadata["score"]) is float
    assert out.metadata["ok"] is True and out.metadata["name"] == "x"
    assert out.metadata["nested"] == [{"k": 3}, [1.5]]
    assert out.metadata["arr"].tolist() == [0, 1, 2]
    assert out.samples[0].extra == {"len": 4}


def test_zero_d_arrays_keep_their_shape_when_normalized() -> None:
    big = np.array(5, dtype=">i8")  # not native-endian: goes through the copying path
    out = decode(encode(make_group(metadata={"x": big}))).metadata["x"]
    assert out.shape == () and out.dtype == np.int64 and int(out) == 5


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.zeros(2, dtype=torch.bfloat16), "bfloat16"),
        (np.zeros(2, dtype=np.complex128), "complex128"),
        (object(), "type object"),
        (1j, "type complex"),
        (np.complex64(1j), "type complex"),
        (2**70, "ints"),
    ],
)
def test_unsupported_values_are_refused_with_codec_error(value: Any, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        encode(make_group(metadata={"x": value}))
    with pytest.raises(CodecError, match=message):
        encode_value({"x": [value]})


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("metadata", {1: "x"}),
        ("metadata", ["x"]),
        ("metadata", []),
        ("sample extra", {1: "x"}),
        ("sample extra", None),
    ],
)
def test_a_group_that_could_not_be_decoded_is_refused_on_encode(where: str, value: Any) -> None:
    """The schema reads metadata and `extra` back only as dicts with str keys: a group written
    with anything else would fail only when handed out, its batch already out of the buffer."""
    group = make_group(metadata=value) if where == "metadata" else make_group()
    if where == "sample extra":
        odd = msgspec.structs.replace(group.samples[1], extra=value)
        group = msgspec.structs.replace(group, samples=(group.samples[0], odd))
    with pytest.raises(CodecError, match=f"{where} must be a dict with str keys"):
        encode(group)


def deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5000])
def test_absurdly_deep_metadata_is_refused_on_encode(depth: int) -> None:
    with pytest.raises(CodecError, match="nested"):
        encode(make_group(metadata={"x": deep(depth)}))
    with pytest.raises(CodecError, match="nested"):
        encode_value({"x": deep(depth)})


def test_metadata_at_the_depth_limit_round_trips() -> None:
    value = {"x": deep(MAX_DEPTH - 1)}  # the dict is one level
    assert decode(encode(make_group(metadata=value))).metadata == value
    assert decode_value(encode_value(value)) == value


def test_encoded_size_is_close_to_the_array_bytes() -> None:
    group = make_group(samples=8, tokens=1024)
    raw = sum(s.tokens.nbytes * 3 for s in group.samples) + group.prompt_tokens.nbytes
    data = encode(group)
    assert raw < len(data) < raw + 8 * 512  # headers and padding stay small
    assert len(data) < len(pickle.dumps(group, protocol=5)) + 4096


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:10], "truncated"),
        (lambda b: b[:-1], "truncated"),
        (lambda b: b + b"\0", "truncated or padded"),
        (lambda b: b"XXXX" + b[4:], "magic"),
        (lambda b: b[:4] + b"\x09\x00" + b[6:], "format 9"),
    ],
)
def test_corrupt_frames_raise_codec_error(mutate: Any, message: str, group: RolloutGroup) -> None:
    with pytest.raises(CodecError, match=message):
        decode(mutate(encode(group)))


def test_codec_error_is_a_value_error() -> None:
    assert issubclass(CodecError, ValueError)


# -- hostile messages: a valid frame around a crafted header -------------------------------------

_FRAME = struct.Struct("<4sHHIQ")  # the documented frame prefix


def reframe(data: bytes, rewrite: Callable[[bytes], bytes]) -> bytes:
    """`data` with its msgpack header replaced by `rewrite(header)`, the frame made consistent."""
    _, fmt, _, header_len, data_len = _FRAME.unpack_from(data)
    header_end = _FRAME.size + header_len
    header = rewrite(data[_FRAME.size : header_end])
    start = _FRAME.size + len(header)
    body = data[header_end + (-header_end % ALIGN) :]
    return _FRAME.pack(MAGIC, fmt, 0, len(header), data_len) + header + bytes(-start % ALIGN) + body


def test_reframe_without_changes_decodes() -> None:
    group = make_group(tokens=10)
    assert_groups_equal(group, decode(reframe(encode(group), lambda h: h)))


@pytest.mark.parametrize("depth", [5000, 100_000])
def test_deeply_nested_metadata_in_a_message_is_a_codec_error(depth: int) -> None:
    marker = msgspec.msgpack.encode("MARKER")
    data = encode(make_group(metadata={"x": "MARKER"}))
    hostile = reframe(data, lambda h: h.replace(marker, b"\x91" * depth + b"\xc0"))
    with pytest.raises(CodecError, match="nested"):
        decode(hostile)


def test_misaligned_array_offset_is_a_codec_error() -> None:
    def shift_metadata_array(header: bytes) -> bytes:
        wire = msgspec.msgpack.decode(header)  # extension values stay raw `Ext` objects
        metadata = wire[8]  # rows, uid, prompt_id, task, prompt, samples, status, error, metadata
        ext = metadata["arr"]  # dtype code, ndim, offset, length
        code, ndim, offset, count = struct.unpack("<BBQq", ext.data)
        shifted = struct.pack("<BBQq", code, ndim, offset - 1, count)  # it is the last array
        metadata["arr"] = msgspec.msgpack.Ext(ext.code, shifted)
        return msgspec.msgpack.encode(wire)

    group = make_group(samples=2, tokens=40, metadata={"arr": np.arange(5)})
    hostile = reframe(encode(group), shift_metadata_array)
    with pytest.raises(CodecError, match="aligned"):
        decode(hostile)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([99, [2]], r"header: Expected `int` <= 11 - at `\$\[0\]\[0\]`"),  # dtype code
        ([-1, [2]], r"header: Expected `int` >= 0 - at `\$\[0\]\[0\]`"),
        ([2, [-2]], r"header: Expected `int` >= 0 - at `\$\[0\]\[1\]\[0\]`"),  # row shape
        ([2, [1] * 40], r"header: Expected `array` of length <= 31"),
        ([2, [1 << 40]], "overrun"),
    ],
)
def test_hostile_packed_rows_header_is_a_codec_error(rows: list[Any], message: str) -> None:
    group = make_group(samples=2, tokens=4, payload=2)

    def rewrite(header: bytes) -> bytes:
        wire = msgspec.msgpack.decode(header)
        assert wire[0] is not None  # the packed rows' dtype code and row shape
        wire[0] = rows
        return msgspec.msgpack.encode(wire)

    with pytest.raises(CodecError, match=message):
        decode(reframe(encode(group), rewrite))


def test_sample_lengths_that_overrun_the_packed_arrays_are_a_codec_error() -> None:
    def longer(header: bytes) -> bytes:
        wire = msgspec.msgpack.decode(header)
        wire[5][0][0] += 1 << 20  # rows, uid, prompt_id, task, prompt, then the samples
        return msgspec.msgpack.encode(wire)

    with pytest.raises(CodecError, match="overrun"):
        decode(reframe(encode(make_group(samples=2, tokens=8)), longer))


def rewrite_wire(change: Callable[[list[Any]], None]) -> Callable[[bytes], bytes]:
    """A header rewrite for `reframe`: `change` edits the decoded wire list in place. Its
    fields: packed rows, uid, prompt_id, task, prompt length, the samples' columns (length,
    status, finish_reason, reward, error, routed experts, extra, loss_mask, turn_ends), then
    the group's other fields."""

    def rewrite(header: bytes) -> bytes:
        wire = msgspec.msgpack.decode(header)
        change(wire)
        return msgspec.msgpack.encode(wire)

    return rewrite


def _set(path: tuple[int, ...], value: Any) -> Callable[[list[Any]], None]:
    def change(wire: list[Any]) -> None:
        target = wire
        for i in path[:-1]:
            target = target[i]
        target[path[-1]] = value

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set((4,), -1), "header"),  # a negative prompt length
        (_set((4,), 1 << 40), "overrun"),
        (_set((5, 0, 1), -3), "header"),  # a negative sample length
        (_set((5, 0), [4]), "columns"),  # one length for two samples
        (_set((5, 1), ["completed"]), "columns"),  # one status for two samples
        (_set((5, 5), True), "packed rows"),  # packed rows the header does not lay out
        (_set((5, 5), False), "routed experts"),
        (_set((5, 5), [None, "x"]), "routed experts"),
        (_set((5, 0), []), "corrupt group"),  # no samples at all
    ],
)
def test_hostile_sample_columns_are_a_codec_error(
    change: Callable[[list[Any]], None], message: str
) -> None:
    hostile = reframe(encode(make_group(samples=2, tokens=4)), rewrite_wire(change))
    with pytest.raises(CodecError, match=message):
        decode(hostile)


def test_hostile_mixed_rows_column_is_a_codec_error() -> None:
    group = make_group(samples=2, tokens=4, payload=2)
    packed = reframe(encode(group), rewrite_wire(_set((5, 5), [True, "x"])))
    with pytest.raises(CodecError, match="routed experts"):
        decode(packed)


def test_mixed_routed_experts_round_trip() -> None:
    """Rows packed for some samples, absent for others, a sample's own (other row shape)."""
    group = make_group(samples=3, tokens=5, payload=2)
    odd = msgspec.structs.replace(group.samples[1], routed_experts=None)
    mixed = msgspec.structs.replace(group, samples=(group.samples[0], odd, group.samples[2]))
    assert_groups_equal(mixed, decode(encode(mixed)))
    own = msgspec.structs.replace(group.samples[2], routed_experts=np.ones((5, 4), np.uint8))
    unaligned = msgspec.structs.replace(group, samples=(group.samples[0], odd, own))
    assert_groups_equal(unaligned, decode(encode(unaligned)))


# -- encode_value / decode_value -----------------------------------------------------------------


def test_value_round_trip_with_arrays_and_scalars() -> None:
    value = {
        "label": np.int64(7),
        "arr": np.arange(3),
        "grid": np.ones((2, 3), dtype=np.float16),
        "scalar_array": np.array(2.5),
        "empty": np.zeros((0, 4), dtype=np.uint8),
        "tensor": torch.arange(4, dtype=torch.int32),
        "plain": [1, "a", None, 2.5, True, b"raw", {"k": [np.float32(0.25)]}],
    }
    out = decode_value(encode_value(value))
    assert out["label"] == 7 and type(out["label"]) is int
    for key, expected in [
        ("arr", np.arange(3)),
        ("grid", value["grid"]),
        ("scalar_array", value["scalar_array"]),
        ("empty", value["empty"]),
        ("tensor", np.arange(4, dtype=np.int32)),
    ]:
        assert_values_equal(expected, out[key], key)
    assert out["plain"] == [1, "a", None, 2.5, True, b"raw", {"k": [0.25]}]


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_every_dtype_round_trips(dtype: type) -> None:
    arr = (np.arange(24) % 2).astype(dtype).reshape(2, 3, 4)
    assert_values_equal(arr, decode_value(encode_value({"a": arr}))["a"], "a")


def test_decoded_value_arrays_are_writable_copies() -> None:
    data = bytearray(encode_value({"a": np.arange(1000)}))
    arr = decode_value(data)["a"]
    assert arr.flags.writeable and arr.flags.owndata  # owns its memory: pins no buffer
    arr[0] = 42
    data[:] = bytes(len(data))  # neither side sees the other's writes
    assert arr[0] == 42 and arr[1] == 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "truncated|corrupt"),
        (b"\x91", "truncated|corrupt"),
        (b"\xc1", "corrupt"),
        (msgspec.msgpack.encode(msgspec.msgpack.Ext(9, b"xx")), "extension"),
        (msgspec.msgpack.encode(msgspec.msgpack.Ext(1, bytes(18))), "extension"),
        (b"\x91" * 5000 + b"\xc0", "nested"),
        (b"\x91" * (MAX_DEPTH + 1) + b"\xc0", "nested"),
    ],
)
def test_value_corrupt_bytes_raise_codec_error(data: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode_value(data)


def test_value_bad_array_headers_raise_codec_error() -> None:
    good = encode_value(np.arange(4, dtype=np.int32))
    ext = msgspec.msgpack.decode(good)
    assert isinstance(ext, msgspec.msgpack.Ext)

    def with_payload(payload: bytes) -> bytes:
        return msgspec.msgpack.encode(msgspec.msgpack.Ext(ext.code, payload))

    head, body = ext.data[:10], ext.data[10:]  # dtype code, ndim, one dimension; the bytes
    cases = [
        (with_payload(head + body[:-1]), "bytes"),  # one byte short of its shape
        (with_payload(head + body + b"\0"), "bytes"),  # one byte too many
        (with_payload(bytes([99]) + head[1:] + body), "dtype"),
        (with_payload(head[:1] + bytes([40]) + head[2:] + body), "ndim"),
        (with_payload(head[:2] + struct.pack("<q", -1) + body), "shape"),
    ]
    for data, message in cases:
        with pytest.raises(CodecError, match=message):
            decode_value(data)


# -- property tests ------------------------------------------------------------------------------

array_in_extra = st.one_of(
    [
        hnp.arrays(
            dtype=np.dtype(dt),
            shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
        )
        for dt in DTYPES
    ]
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)


@st.composite
def samples(draw: st.DrawFn) -> RolloutState:
    n = draw(st.integers(0, 40))
    return RolloutState(
        tokens=draw(hnp.arrays(np.int32, n)),
        logprobs=draw(hnp.arrays(np.float32, n)),
        versions=draw(hnp.arrays(np.int32, n)),
        status=draw(st.sampled_from(Status)),
        finish_reason=draw(st.one_of(st.none(), st.sampled_from(["stop", "length", "abort"]))),
        reward=draw(st.one_of(st.none(), st.floats(allow_nan=False))),
        error=draw(st.one_of(st.none(), st.text(max_size=20))),
        routed_experts=draw(st.one_of(st.none(), hnp.arrays(np.uint8, (n, 3)))),
        extra=draw(
            st.dictionaries(st.text(max_size=5), st.one_of(scalars, array_in_extra), max_size=3)
        ),
        loss_mask=draw(st.one_of(st.none(), hnp.arrays(np.uint8, n))),
        turn_ends=draw(st.sampled_from([None, np.array([n], np.int32)])),
    )


@st.composite
def groups(draw: st.DrawFn) -> RolloutGroup:
    return RolloutGroup(
        uid=draw(st.integers(0, 2**62)),
        prompt_id=draw(st.text(max_size=10)),
        task=draw(st.text(max_size=10)),
        prompt_tokens=draw(hnp.arrays(np.int32, st.integers(0, 30))),
        samples=tuple(draw(st.lists(samples(), min_size=1, max_size=4))),
        status=draw(st.sampled_from(Status)),
        error=draw(st.one_of(st.none(), st.text(max_size=20))),
        metadata=draw(st.dictionaries(st.text(max_size=5), scalars, max_size=3)),
        start_version=draw(st.integers(0, 1000)),
        attempts=draw(st.integers(0, 10)),
        latency_s=draw(st.floats(0, 1e6)),
    )


# Drawing a group costs far more than encoding or decoding it (~30 ms against well under one),
# so each example of the truncation and corruption properties tries several cuts or
# corruptions of its group: as many tries as 300 groups of one try each, on a fifth of the
# groups.
TRIES_PER_GROUP = 5


@settings(max_examples=150, deadline=None)
@given(groups())
def test_property_round_trip_and_encode_into_match_encode(group: RolloutGroup) -> None:
    """The group decodes to itself; `encode_into` writes exactly `encode`'s bytes into
    storage that held other bytes."""
    expected = encode(group)
    assert_groups_equal(group, decode(expected))
    storage = np.full(len(expected), 0x5A, np.uint8)
    assert bytes(encode_into(group, lambda size: storage)) == expected


@settings(max_examples=300 // TRIES_PER_GROUP, deadline=None)
@given(groups(), st.data())
def test_property_truncation_always_raises(group: RolloutGroup, data: st.DataObject) -> None:
    blob = encode(group)
    for _ in range(TRIES_PER_GROUP):
        cut = data.draw(st.integers(0, len(blob) - 1))
        with pytest.raises(CodecError):
            decode(blob[:cut])


@settings(max_examples=300 // TRIES_PER_GROUP, deadline=None)
@given(groups(), st.data())
def test_property_corruption_raises_codec_error_or_decodes(
    group: RolloutGroup, data: st.DataObject
) -> None:
    """Flipped bytes anywhere give CodecError or a whole, valid group; never another error,
    never a crash, never a half-built object."""
    encoded = encode(group)
    for _ in range(TRIES_PER_GROUP):
        blob = bytearray(encoded)
        for _ in range(data.draw(st.integers(1, 4))):
            pos = data.draw(st.integers(0, len(blob) - 1))
            blob[pos] ^= data.draw(st.integers(1, 255))
        try:
            out = decode(bytes(blob))
        except CodecError:
            continue
        assert isinstance(out, RolloutGroup)
        for s in out.samples:
            assert len(s.tokens) == len(s.logprobs) == len(s.versions)


# -- encode_into: the same message, written into recycled memory ---------------------------------


def test_encode_into_dirty_storage_writes_the_same_bytes_as_encode() -> None:
    """Storage that held another group before: every byte of the message is rewritten
    (padding included), so recycled memory gives exactly `encode`'s bytes."""
    group = make_group(samples=3, tokens=37, payload=5, metadata={"arr": np.arange(3)})
    expected = encode(group)
    storage = np.full(len(expected) + 100, 0xAB, np.uint8)
    asked: list[int] = []

    def give(size: int) -> np.ndarray:
        asked.append(size)
        return storage

    view = encode_into(group, give)
    assert asked == [len(expected)]
    assert bytes(view) == expected
    assert view.readonly
    assert_groups_equal(group, decode(view))


@pytest.mark.parametrize("tokens", [5, 20_000])  # packed arrays under / over _JOIN_LIMIT
def test_encode_into_writes_the_same_bytes_as_encode_for_short_and_long_samples(
    tokens: int,
) -> None:
    group = make_group(samples=2, tokens=tokens, payload=3, metadata={"arr": np.arange(3)})
    expected = encode(group)
    storage = np.full(len(expected), 0xCD, np.uint8)
    assert bytes(encode_into(group, lambda size: storage)) == expected
