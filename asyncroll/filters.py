"""Group filters: decide, after scoring, whether a completed group is worth training on.

A filter takes a scored group and returns True to keep it. Groups it rejects are FILTERED:
counted on the producer (with their tokens as waste) and dropped on arrival.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncroll.types import RolloutGroup

GroupFilter = Callable[[RolloutGroup], bool]


def nonzero_std(group: RolloutGroup) -> bool:
    """DAPO's dynamic sampling: keep a group only if its rewards are not all equal (a group of
    equal rewards has zero advantage under GRPO and teaches nothing). A sample without a
    reward, or a NaN reward, leaves no advantage to compute: the group is not kept.

    Python's own min/max over the few rewards of a group: building a numpy array and reducing
    it twice cost four times as much, on every group the producer scores."""
    samples = group.samples
    rewards = [r for s in samples if (r := s.reward) is not None and r == r]  # r == r: not NaN
    return len(rewards) == len(samples) and max(rewards) > min(rewards)


FILTERS: dict[str, GroupFilter] = {"nonzero_std": nonzero_std}


def resolve(spec: str | GroupFilter | None) -> GroupFilter | None:
    """A filter from its name, a callable, or None (keep everything)."""
    if spec is None or callable(spec):
        return spec
    try:
        return FILTERS[spec]
    except KeyError:
        raise ValueError(
            f"filter={spec!r} is unknown: use one of {sorted(FILTERS)}, a callable, or None"
        ) from None
