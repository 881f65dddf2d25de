import pickle
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from asyncroll.codec import ALIGN, CodecError, decode, encode
from asyncroll.types import RolloutGroup, RolloutState, Status
from tests.factories import make_group

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


def test_unsupported_values_are_refused_clearly() -> None:
    with pytest.raises(TypeError, match="bfloat16"):
        encode(make_group(metadata={"x": torch.zeros(2, dtype=torch.bfloat16)}))
    with pytest.raises(TypeError, match="complex128"):
        encode(make_group(metadata={"x": np.zeros(2, dtype=np.complex128)}))
    with pytest.raises(TypeError, match="object"):
        encode(make_group(metadata={"x": object()}))


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


@settings(max_examples=150, deadline=None)
@given(groups())
def test_property_round_trip(group: RolloutGroup) -> None:
    assert_groups_equal(group, decode(encode(group)))


@settings(max_examples=300, deadline=None)
@given(groups(), st.data())
def test_property_truncation_always_raises(group: RolloutGroup, data: st.DataObject) -> None:
    blob = encode(group)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(CodecError):
        decode(blob[:cut])


@settings(max_examples=300, deadline=None)
@given(groups(), st.data())
def test_property_corruption_raises_codec_error_or_decodes(
    group: RolloutGroup, data: st.DataObject
) -> None:
    """Flipped bytes anywhere give CodecError or a whole, valid group; never another error,
    never a crash, never a half-built object."""
    blob = bytearray(encode(group))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] ^= data.draw(st.integers(1, 255))
    try:
        out = decode(bytes(blob))
    except CodecError:
        return
    assert isinstance(out, RolloutGroup)
    for s in out.samples:
        assert len(s.tokens) == len(s.logprobs) == len(s.versions)
