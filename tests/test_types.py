import numpy as np
import pytest

from asyncroll.types import (
    RolloutGroup,
    RolloutState,
    Status,
    extended_state,
    group_status,
    sample_status,
    scored_state,
)
from tests.factories import make_group, make_sample

S = Status


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        ([S.COMPLETED], S.COMPLETED),
        ([S.COMPLETED, S.COMPLETED], S.COMPLETED),
        ([S.PENDING, S.PENDING], S.PENDING),
        ([S.COMPLETED, S.FAILED], S.FAILED),
        ([S.ABORTED, S.FAILED, S.FILTERED], S.FAILED),
        ([S.ABORTED, S.COMPLETED], S.ABORTED),
        ([S.EXPIRED, S.ABORTED], S.ABORTED),
        ([S.EXPIRED, S.FILTERED], S.EXPIRED),
        ([S.FILTERED, S.COMPLETED], S.FILTERED),
    ],
)
def test_group_status_precedence(statuses: list[Status], expected: Status) -> None:
    assert group_status([make_sample(status=s) for s in statuses]) is expected


@pytest.mark.parametrize("other", [S.COMPLETED, S.ABORTED, S.FAILED, S.FILTERED, S.EXPIRED])
def test_group_status_refuses_pending_mixed_with_anything(other: Status) -> None:
    with pytest.raises(ValueError, match="unknown mix"):
        group_status([make_sample(status=S.PENDING), make_sample(status=other)])


def test_group_status_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        group_status([])


def test_group_status_is_total_over_all_pairs() -> None:
    """Every pair of statuses either classifies or raises ValueError; nothing falls through."""
    for a in Status:
        for b in Status:
            try:
                result = group_status([make_sample(status=a), make_sample(status=b)])
            except ValueError:
                assert S.PENDING in (a, b) and a is not b
            else:
                assert result in Status


@pytest.mark.parametrize(
    ("reason", "status"), [("stop", S.COMPLETED), ("length", S.COMPLETED), ("abort", S.ABORTED)]
)
def test_sample_status_from_finish_reason(reason: str, status: Status) -> None:
    assert sample_status(reason) is status


def test_unknown_finish_reason_is_malformed() -> None:
    with pytest.raises(ValueError, match="unknown finish_reason"):
        sample_status("exploded")


def test_sample_rejects_mismatched_lengths_and_dtypes() -> None:
    with pytest.raises(ValueError, match="one length"):
        RolloutState(
            tokens=np.zeros(3, np.int32),
            logprobs=np.zeros(2, np.float32),
            versions=np.zeros(3, np.int32),
        )
    with pytest.raises(TypeError, match="int32"):
        RolloutState(
            tokens=np.zeros(3, np.int64),
            logprobs=np.zeros(3, np.float32),
            versions=np.zeros(3, np.int32),
        )
    with pytest.raises(ValueError, match="1-D"):  # one version per token, not a row of them
        RolloutState(
            tokens=np.zeros(3, np.int32),
            logprobs=np.zeros(3, np.float32),
            versions=np.zeros((3, 2), np.int32),
        )


def test_group_needs_samples_and_int32_prompt() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        RolloutGroup(
            uid=0, prompt_id="p", task="t", prompt_tokens=np.zeros(1, np.int32), samples=()
        )
    with pytest.raises(TypeError, match="prompt_tokens"):
        RolloutGroup(
            uid=0,
            prompt_id="p",
            task="t",
            prompt_tokens=np.zeros(1, np.float32),
            samples=(make_sample(),),
        )


def test_structs_are_frozen() -> None:
    group = make_group()
    with pytest.raises(AttributeError):
        group.status = S.FAILED  # type: ignore[misc]


def test_min_version_and_counts() -> None:
    group = make_group(samples=3, tokens=5, version=4)
    assert group.min_version == 4
    assert group.num_tokens == 15
    assert group.num_samples == 3
    empty = RolloutGroup(
        uid=1,
        prompt_id="p",
        task="t",
        prompt_tokens=np.zeros(1, np.int32),
        samples=(RolloutState(),),
        start_version=7,
    )
    assert empty.min_version == 7  # no token yet: the version it started under


def test_rewards_array_has_nan_for_unscored() -> None:
    group = make_group(samples=2)
    unscored = RolloutGroup(
        uid=2,
        prompt_id="p",
        task="t",
        prompt_tokens=group.prompt_tokens,
        samples=(make_sample(reward=None), make_sample(reward=0.5)),
    )
    assert np.isnan(unscored.rewards()[0]) and unscored.rewards()[1] == 0.5


def test_extended_state_skips_only_checked_arrays_and_still_checks_turns() -> None:
    base = RolloutState(extra={"k": 1})
    tokens, logprobs = np.arange(3, dtype=np.int32), np.zeros(3, np.float32)
    new = extended_state(base, tokens, logprobs, tokens, S.COMPLETED, "stop", None)
    assert new.status is S.COMPLETED and new.extra == {"k": 1} and new.num_tokens == 3
    assert base.num_tokens == 0 and base.status is S.PENDING  # the original is untouched
    assert scored_state(new, 0.5).reward == 0.5 and new.reward is None
    # A loss mask is user input: it must still fit the new length.
    masked = RolloutState(loss_mask=np.zeros(0, np.uint8), turn_ends=np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="loss_mask"):
        extended_state(masked, tokens, logprobs, tokens, S.COMPLETED, "stop", None)
