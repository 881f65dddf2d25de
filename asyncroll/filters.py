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
    equal rewards has zero advantage under GRPO and teaches nothing)."""
    rewards = group.rewards()
    return bool(rewards.max() > rewards.min())


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
