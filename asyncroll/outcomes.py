"""Why a group failed, as a closed set of reasons, and the one exception that carries it.

The readable `error` string says what happened to one group; the reason says which *kind* of
problem it was, because they call for different fixes (a reward deadline is not a broken engine,
and neither is a bad prompt). Counters, `on_drop` records, the failure-streak error and metrics
are keyed by it.
"""

from __future__ import annotations

import asyncio
import enum


class FailureReason(enum.StrEnum):
    BAD_PROMPT = "bad_prompt"  # invalid token ids, no room to generate, unencodable metadata
    ENGINE_ERROR = "engine_error"  # the engine raised (its own timeouts included)
    ENGINE_DEADLINE = "engine_deadline"  # no answer within generate_timeout_s
    ENGINE_DEAD = "engine_dead"
    MALFORMED_OUTPUT = "malformed_output"
    REWARD_ERROR = "reward_error"  # raised, or returned something that is not n finite numbers
    REWARD_DEADLINE = "reward_deadline"
    FILTER_ERROR = "filter_error"
    ENVIRONMENT_ERROR = "environment_error"  # a rollout function raised or broke a limit
    EPISODE_DEADLINE = "episode_deadline"  # an episode ran past episode_timeout_s
    INTERRUPTED = "interrupted"  # the run was cancelled while the group was being scored
    UNSTORABLE = "unstorable"  # the finished group could not be encoded
    INTERNAL = "internal"  # a bug in asyncroll (the producer stops too)


NOT_ABSORBED = (KeyboardInterrupt, SystemExit, asyncio.CancelledError)
"""What user or engine code may raise that no group absorbs as its own failure."""


def cancelling() -> bool:
    """Whether the current task is being cancelled. A `CancelledError` raised while it is not
    came from the code it called (a client session torn down under a tool or a judge), not
    from a cancellation: it is that code's failure, which a task group would swallow."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class GroupFailure(Exception):
    """A group fails: why (`reason`), a readable `message`, and `fatal` when the producer
    cannot go on either (a dead engine, a `BaseException` from user or engine code)."""

    def __init__(self, reason: FailureReason, message: str, fatal: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.fatal = fatal
