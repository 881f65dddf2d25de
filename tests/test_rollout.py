"""The pure steps of an attempt: merging engine output (versions) and checking rewards."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from asyncroll.engines.base import SampleOutput, SampleRequest
from asyncroll.rollout import RolloutError, _extend, check_rewards
from asyncroll.types import RolloutGroup, RolloutState, Status


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
    return _extend(sample, SampleRequest(sample.tokens, 100), out, vocab_size=10, version=version)


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
    ],
)
def test_bad_rewards_are_refused_clearly(values: Any, message: str) -> None:
    with pytest.raises(RolloutError, match=message):
        check_rewards(values, 3)
