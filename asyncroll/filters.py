"""Group filters: decide, after scoring, whether a completed group is worth training on.

A filter takes a scored group and returns True to keep it. Groups it rejects are FILTERED:
counted on the producer (with their tokens as waste) and dropped on arrival.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from asyncroll.types import RolloutGroup

GroupFilter = Callable[[RolloutGroup], bool]


class BadVerdict(TypeError):
    """A filter returned something that is not a verdict (None, an awaitable)."""


def verdict(result: object) -> bool:
    """A filter's result as keep (True) or not. None and awaitables are refused with
    `BadVerdict`: None is a filter that lost its `return` and would reject every group, and
    an awaitable's `bool()` is True, so a filter returning a coroutine, awaited by nobody,
    would keep every group."""
    if result is None:
        raise BadVerdict("filter returned None, not a bool: a missing return?")
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()  # never to be awaited: no "never awaited" warning
        raise BadVerdict(
            f"filter returned a {type(result).__name__}, not a bool: a filter is a plain "
            "function (`def`, not `async def`)"
        )
    return bool(result)


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
    if spec is None:
        return spec
    if callable(spec):
        if inspect.iscoroutinefunction(spec) or inspect.iscoroutinefunction(
            getattr(spec, "__call__", None)  # noqa: B004
        ):
            raise ValueError(
                f"filter must be a plain function returning a bool, got the async "
                f"{getattr(spec, '__qualname__', type(spec).__qualname__)!r}: its coroutine "
                "would never be awaited"
            )
        return spec
    try:
        return FILTERS[spec]
    except KeyError:
        raise ValueError(
            f"filter={spec!r} is unknown: use one of {sorted(FILTERS)}, a callable, or None"
        ) from None
