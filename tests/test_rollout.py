"""The pure steps of an attempt: merging engine output (versions) and checking rewards."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from asyncroll._core.rollout import (
    RolloutError,
    check_rewards,
    fresh_samples,
    interrupted,
    merge_outputs,
)
from asyncroll.engines.base import GenerateRequest, SampleOutput, SampleRequest, SamplingConfig
from asyncroll.filters import nonzero_std
from asyncroll.types import RolloutGroup, RolloutState, Status
from tests.factories import make_group


def sample_with_versions(versions: list[int]) -> RolloutState:
    n = len(versions)
    return RolloutState(
        tokens=np.arange(n, dtype=np.int32),
        logprobs=np.zeros(n, np.float32),
        versions=np.array(versions, dtype=np.int32),
        status=Status.ABORTED if n else Status.PENDING,
        finish_reason="abort" if n else None,
    )


def extend(prefix: list[int], new: list[int], version: int) -> RolloutState:
    sample = sample_with_versions(prefix)
    out = SampleOutput(
        tokens=np.full(len(new), 5, np.int32),
        logprobs=np.full(len(new), -0.5, np.float32),
        versions=np.array(new, dtype=np.int32),
        finish_reason="stop",
    )
    return extend_one(sample, out, vocab_size=10, version=version)


def extend_one(
    sample: RolloutState, out: SampleOutput, *, vocab_size: int, version: int, budget: int = 100
) -> RolloutState:
    """`sample` merged with one engine output, through the group-level `merge_outputs`."""
    request = GenerateRequest(
        request_id="r",
        prompt_tokens=np.zeros(1, np.int32),
        samples=(SampleRequest(sample.tokens, budget),),
        sampling=SamplingConfig(),
    )
    (merged,) = merge_outputs(
        group_of(sample), request, [out], vocab_size=vocab_size, version=version
    )
    return merged


# -- versions ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "new", "version"),
    [
        ([], [0, 0, 1], 1),
        ([1, 1], [1, 2, 2, 3], 3),
        ([2], [3], 3),
        ([], [], 0),
    ],
)
def test_non_decreasing_versions_within_bounds_are_merged(
    prefix: list[int], new: list[int], version: int
) -> None:
    merged = extend(prefix, new, version)
    assert merged.versions.tolist() == prefix + new


@pytest.mark.parametrize(
    ("prefix", "new", "version", "message"),
    [
        ([1, 1], [1, 3, 2], 3, "decrease"),  # ends in bounds, goes back in the middle
        ([1], [1, 0, 1], 1, "decrease"),  # dips below the prefix in the middle
        ([], [0, 9, 0], 1, "decrease"),  # runs ahead in the middle
        ([2], [1, 2], 3, r"outside \[2, 3\]"),  # starts before the prefix ends
        ([], [0, 4], 3, r"outside \[0, 3\]"),  # ends after the current version
    ],
)
def test_versions_that_go_back_or_run_ahead_are_malformed(
    prefix: list[int], new: list[int], version: int, message: str
) -> None:
    with pytest.raises(RolloutError, match=message):
        extend(prefix, new, version)


@pytest.mark.parametrize(
    ("field", "values"),
    [
        ("tokens", [2**32 + 5, 7]),  # int64 ids that int32 would wrap to 5 and 7: in the vocab
        ("tokens", np.array([-(2**32) + 5, 7], dtype=np.int64)),
        ("tokens", np.array([2**63 + 5, 7], dtype=np.uint64)),
        ("versions", [2**32, 2**32]),  # would wrap to version 0
    ],
)
def test_ids_or_versions_that_do_not_fit_int32_are_malformed(field: str, values: Any) -> None:
    arrays: dict[str, Any] = {
        "tokens": np.array([5, 7], np.int32),
        "logprobs": np.full(2, -0.5, np.float32),
        "versions": np.zeros(2, np.int32),
    }
    arrays[field] = values
    out = SampleOutput(**arrays, finish_reason="stop")
    with pytest.raises(RolloutError, match="int32"):
        extend_one(sample_with_versions([]), out, vocab_size=10, version=0)


@pytest.mark.parametrize("output", [None, {"tokens": [5], "logprobs": [-0.5], "versions": [0]}])
def test_outputs_that_are_not_sample_outputs_are_malformed(output: Any) -> None:
    """A RolloutError fails the group as malformed output; an AttributeError escaped every
    handler and stopped the producer as an internal error."""
    group = group_of(sample_with_versions([]))
    request = GenerateRequest(
        request_id="r",
        prompt_tokens=np.zeros(1, np.int32),
        samples=(SampleRequest(np.zeros(0, np.int32), 4),),
        sampling=SamplingConfig(),
    )
    with pytest.raises(RolloutError, match=f"{type(output).__name__}, not a SampleOutput"):
        merge_outputs(group, request, [output], vocab_size=10, version=0)


def group_of(*samples: RolloutState, start_version: int = 0) -> RolloutGroup:
    return RolloutGroup(
        uid=0,
        prompt_id="p",
        task="t",
        prompt_tokens=np.zeros(1, np.int32),
        samples=samples,
        start_version=start_version,
    )


def test_min_version_is_the_oldest_token_even_out_of_order() -> None:
    """A hand-built (or decoded) sample need not be monotone: the first entry is not trusted."""
    group = group_of(sample_with_versions([5, 6]), sample_with_versions([4, 2, 3]))
    assert group.min_version == 2
    assert group_of(sample_with_versions([]), start_version=7).min_version == 7


# -- rewards -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        [1.0, 0.0, -2.5],
        [1, 0, -2],
        (1.0, 0, -2.5),
        [np.float32(1.0), np.int64(0), np.float64(-2.5)],
        [torch.tensor(1.0), torch.tensor(0), np.array(-2.5)],
        np.array([1.0, 0.0, -2.5]),
        np.array([1, 0, -2], dtype=np.int8),
        torch.tensor([1.0, 0.0, -2.5]),
        torch.tensor([1.0, 0.0, -2.5], requires_grad=True),
    ],
)
def test_rewards_as_numbers_scalars_arrays_and_tensors(values: Any) -> None:
    out = check_rewards(values, 3)
    assert out == [1.0, 0.0, -2.5] or out == [1.0, 0.0, -2.0]
    assert all(type(r) is float for r in out)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1.0, True, 0.0], "bool"),
        ([1.0, np.bool_(False), 0.0], "bool"),
        ([1.0, torch.tensor(True), 0.0], "bool"),
        (np.array([True, False, True]), "bool"),
        (torch.tensor([True, False, True]), "bool"),
        ([1.0, "1.0", 0.0], "'1.0' .*str.* not a number"),
        ([1.0, None, 0.0], "None .*not a number"),
        ([1.0, 1j, 0.0], "not a number"),
        (np.array([1.0, 2.0, 3.0], dtype=np.complex64), "complex"),
        ([1.0, math.nan, 0.0], "not finite"),
        ([1.0, np.float32(np.inf), 0.0], "not finite"),
        ([1.0, torch.tensor(math.nan), 0.0], "not finite"),
        (np.array([1.0, math.nan, 0.0]), "not finite"),
        ([1.0, torch.ones(2), 0.0], "not a number"),
        ([1.0, 0.0], "2 rewards for 3 samples"),
        (np.zeros((3, 1)), "2-d"),
        (torch.tensor(1.0), "0-d"),
        ("abc", "str"),
        (1.0, "float"),
        ({0: 1.0, 1: 0.0, 2: -2.5}, "dict"),  # iterating it gives its keys, not the rewards
        ({1.0, 0.0, -2.5}, "set"),  # no order: the rewards would land on the wrong samples
    ],
)
def test_bad_rewards_are_refused_clearly(values: Any, message: str) -> None:
    with pytest.raises(RolloutError, match=message):
        check_rewards(values, 3)


# -- one group, several samples: the vectorised checks keep each sample's own bounds ------------


def merge_group(
    prefixes: list[list[int]], news: list[list[int]], version: int
) -> tuple[RolloutState, ...]:
    samples = tuple(sample_with_versions(p) for p in prefixes)
    request = GenerateRequest(
        request_id="r",
        prompt_tokens=np.zeros(1, np.int32),
        samples=tuple(SampleRequest(s.tokens, 100) for s in samples),
        sampling=SamplingConfig(),
    )
    outputs = [
        SampleOutput(
            tokens=np.full(len(new), 5, np.int32),
            logprobs=np.full(len(new), -0.5, np.float32),
            versions=np.array(new, dtype=np.int32),
            finish_reason="stop",
        )
        for new in news
    ]
    return merge_outputs(group_of(*samples), request, outputs, vocab_size=10, version=version)


@pytest.mark.parametrize(
    ("prefixes", "news", "version"),
    [
        ([[], []], [[0, 1, 1], [0, 0]], 1),  # the step 1 -> 0 between two samples is no decrease
        ([[], [], []], [[2, 2], [], [1, 2]], 2),  # an empty sample between them
        ([[3], []], [[3, 4], [0, 4]], 4),  # a resumed sample next to a fresh one
    ],
)
def test_group_versions_are_checked_per_sample(
    prefixes: list[list[int]], news: list[list[int]], version: int
) -> None:
    merged = merge_group(prefixes, news, version)
    assert [s.versions.tolist() for s in merged] == [
        p + n for p, n in zip(prefixes, news, strict=True)
    ]
    assert [s.status for s in merged] == [Status.COMPLETED] * len(news)


@pytest.mark.parametrize(
    ("prefixes", "news", "version", "message"),
    [
        ([[], []], [[0, 0], [1, 0, 1]], 1, "decrease"),  # only the second sample dips
        ([[], [], []], [[1], [], [1, 0]], 1, "decrease"),  # after an empty sample
        ([[], [2]], [[0, 0], [1, 2]], 2, r"outside \[2, 2\]"),  # the resumed one starts early
        ([[], []], [[0, 0], [0, 3]], 2, r"outside \[0, 2\]"),  # runs ahead in the last sample
        ([[], []], [[0, 0], [-1, -1]], 2, r"outside \[0, 2\]"),  # a negative version
    ],
)
def test_group_versions_that_break_one_sample_are_malformed(
    prefixes: list[list[int]], news: list[list[int]], version: int, message: str
) -> None:
    with pytest.raises(RolloutError, match=message):
        merge_group(prefixes, news, version)


def test_merged_samples_hold_none_of_the_engine_arrays() -> None:
    """The group's new tokens are copied once into arrays of its own: an engine that reuses
    its output buffers cannot change a merged sample afterwards."""
    tokens = np.full(3, 5, np.int32)
    out = SampleOutput(
        tokens=tokens,
        logprobs=np.full(3, -0.5, np.float32),
        versions=np.zeros(3, np.int32),
        finish_reason="stop",
    )
    merged = extend_one(sample_with_versions([]), out, vocab_size=10, version=0)
    tokens[:] = 7
    assert merged.tokens.tolist() == [5, 5, 5]
    assert not np.shares_memory(merged.tokens, tokens)


@pytest.mark.parametrize(
    ("rewards", "keep"),
    [
        ([0.0, 1.0, 0.5], True),
        ([1.0, 1.0, 1.0], False),
        ([1.0, None, 0.0], False),  # a sample without a reward: no advantage to compute
        ([1.0, math.nan, 0.0], False),  # NaN anywhere: numpy's max/min would say False too
        ([math.nan, 1.0, 0.0], False),
        ([1.0, 0.0, math.nan], False),
        ([-math.inf, 0.0, 0.0], True),  # hand-built: infinities still differ
    ],
)
def test_nonzero_std_keeps_groups_whose_rewards_differ(
    rewards: list[float | None], keep: bool
) -> None:
    group = make_group(samples=len(rewards))
    samples = tuple(
        msgspec.structs.replace(s, reward=r) for s, r in zip(group.samples, rewards, strict=True)
    )
    assert nonzero_std(msgspec.structs.replace(group, samples=samples)) is keep


def test_every_sample_built_from_a_fresh_group_owns_its_extra_dict() -> None:
    """A frozen sample's `extra` dict is still writable (a reward function may annotate it), and
    a state built from a sample shares its dict: a write into one sample's `extra` must not
    reach another sample, of this group or of any later one."""

    def fresh_group() -> RolloutGroup:
        return RolloutGroup(
            uid=0, prompt_id="p", task="t", prompt_tokens=np.arange(3, dtype=np.int32),
            samples=fresh_samples(2),
        )  # fmt: skip

    group = fresh_group()
    request = GenerateRequest(
        request_id="r",
        prompt_tokens=group.prompt_tokens,
        samples=(SampleRequest(np.zeros(0, np.int32), 4),) * 2,
        sampling=SamplingConfig(max_new_tokens=4),
    )
    out = SampleOutput(
        tokens=np.arange(2, dtype=np.int32),
        logprobs=np.zeros(2, np.float32),
        versions=np.zeros(2, np.int32),
        finish_reason="stop",
    )
    merged = merge_outputs(group, request, [out, out], vocab_size=10, version=0)
    built = [*merged, *interrupted(fresh_group().samples), *fresh_samples(2)]
    for s in built:
        s.extra["mine"] = id(s)
    assert [s.extra for s in built] == [{"mine": id(s)} for s in built]
    assert fresh_group().samples[0].extra == {}
