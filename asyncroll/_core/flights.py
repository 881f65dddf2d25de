"""Groups in flight: starting one, running its attempt, and landing it (buffer, counters,
`on_drop`), and the expiry of groups at a version change.

Every state change of a group (start, landing, expiry) happens here, in one synchronous step
together with its counters, so the ledger identity (`Producer.check_ledger`) holds at every
await point. A landing cannot raise: a group that cannot be stored is counted as FAILED.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from asyncroll import codec
from asyncroll._core.attempt import Attempts, Flight, Landing
from asyncroll._core.causes import Causes
from asyncroll._core.core import Core
from asyncroll._core.drops import DropCallback
from asyncroll._core.logs import FailureWarnings
from asyncroll._core.tasks import Tasks
from asyncroll.buffer import PutOutcome
from asyncroll.episode import Parking
from asyncroll.outcomes import FailureReason
from asyncroll.record.writer import Record
from asyncroll.types import Prompt, RolloutGroup, Status

log = logging.getLogger("asyncroll.producer")


class DropRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Who was dropped and why, without the payload: what `on_drop` callbacks receive."""

    uid: int
    prompt_id: str
    task: str
    outcome: PutOutcome
    reason: FailureReason | None  # why it failed (None unless outcome is DROPPED_FAILED)
    error: str | None
    samples: int
    tokens: int
    version: int


class Flights:
    """Starts groups, runs each attempt in a task of its own (owned by `tasks`), lands it."""

    def __init__(
        self,
        core: Core,
        attempts: Attempts,
        drops: DropCallback[DropRecord],
        failure_log: FailureWarnings,
        *,
        reporting: bool,
        parking: Callable[[], Parking],
        run_id: str,
        record: Record,
    ) -> None:
        self.core = core
        self.attempts = attempts
        self.drops = drops
        self.failure_log = failure_log
        self.reporting = reporting  # an `on_drop` is set: build a `DropRecord` per drop
        self.parking = parking
        self.run_id = run_id  # request ids stay unique on a shared engine
        self.record = record  # the run record: it samples the dropped groups
        self.tasks = Tasks()  # one per group in flight, owned by the producer's runner
        self.idle_since: float | None = None  # when the last group in flight landed
        self.dropped_in_a_row = Causes()  # since the last group that became ready
        self.scored_once = False  # a group of this run was scored (ready, filtered, expired)

    def start(self, group: RolloutGroup, reserved: int, *, resumed: bool = False) -> None:
        """Put `group` in flight (one synchronous step with its counters) and run its attempt."""
        core = self.core
        flight = Flight(group, f"{self.run_id}-{group.uid}-{group.attempts}", reserved)
        core.inflight[group.uid] = flight
        core.progress.count_start(group, resumed=resumed)
        self.count_idle()
        if group.error is not None:  # a bad prompt: fails without reaching the engine
            self.land(
                self.attempts.failed(group, flight, FailureReason.BAD_PROMPT, group.error), flight
            )
            return
        flight.task = self.tasks.spawn(self._run(group, flight), f"asyncroll-group-{group.uid}")

    async def _run(self, group: RolloutGroup, flight: Flight) -> None:
        """Run one attempt and land it exactly once, however the attempt ends (cancelled: by a
        drain whose abort the engine ignored, or by the producer's own end)."""
        try:
            landing = await self.attempts.run(
                group, flight, self.core.current_version, self.parking
            )
        except asyncio.CancelledError:
            self.land(self.attempts.interrupted(group, flight), flight)
            raise
        except BaseException as exc:  # a bug in asyncroll, or KeyboardInterrupt / SystemExit
            message = f"internal error in group {group.uid}: {type(exc).__name__}: {exc}"
            self.land(self.attempts.failed(group, flight, FailureReason.INTERNAL, message), flight)
            self.core.fail(message)
            if not isinstance(exc, Exception):
                raise
            return
        self.land(landing, flight)

    def land(self, landing: Landing, flight: Flight) -> None:
        """Hand a finished attempt to the buffer and count it: one synchronous step that cannot
        raise (a group that cannot be stored is counted as FAILED instead)."""
        core = self.core
        group, reason = landing.group, landing.reason
        del core.inflight[group.uid]
        if group.status in (Status.COMPLETED, Status.ABORTED):  # to be stored: within bound?
            error = _extra_error(group, core.config.extra_bytes(episodes=core.episodes))
            if error is not None:
                reason = FailureReason.UNSTORABLE
                group = msgspec.structs.replace(group, status=Status.FAILED, error=error)
        try:
            outcome = core.buffer.put(group, flight.reserved)
        except Exception as exc:  # put changed nothing: fail the group instead
            if isinstance(exc, codec.CodecError):
                reason = FailureReason.UNSTORABLE
                error = f"the group could not be stored: {exc}"
            else:
                reason = FailureReason.INTERNAL
                error = f"internal error storing group {group.uid}: {type(exc).__name__}: {exc}"
                core.fail(error)
            group = msgspec.structs.replace(group, status=Status.FAILED, error=error)
            outcome = core.buffer.put(group, flight.reserved)  # dropped: nothing to encode
        core.progress.count_landing(group, outcome, reason, flight.tokens, landing.rewards)
        if landing.restart is not None:
            core.progress.count_restart(*landing.restart)
        self.count_idle()
        if outcome is PutOutcome.DROPPED_EXPIRED:
            self._requeue(group)
        if landing.fatal is not None:
            core.fail(landing.fatal)
        self._track_drops(outcome, reason, group.error)
        if outcome not in (PutOutcome.STORED_READY, PutOutcome.STORED_RESUME):
            self._report_drop(group, outcome, reason)
        core.changed.notify()

    def _track_drops(
        self, outcome: PutOutcome, reason: FailureReason | None, error: str | None
    ) -> None:
        """Stop the run when `max_dropped_in_a_row` groups in a row fail, are filtered or
        expire on arrival: an endless source would otherwise burn compute forever without a
        word. (Groups that expire at an update are the trainer's pace, not a storm: they are
        not counted. One that is already too stale when it lands never can be ready.) Before
        the run's first group is scored, `max_reward_failures_at_start` failures of the reward
        function or filter for one reason stop it sooner: they strike after generation, in the
        order groups finish, so a verifier that fails that many before it scores once is
        broken, and every further group would fail alike. (An engine's failures land before
        the slower successes of the groups beside them: they keep the larger bound.)"""
        match outcome:
            case PutOutcome.STORED_READY:
                self.dropped_in_a_row.clear()
                self.scored_once = True
                return
            case PutOutcome.DROPPED_FAILED:
                label = (reason or FailureReason.INTERNAL).value
            case PutOutcome.DROPPED_FILTERED:
                label, error = "filtered", None
            case PutOutcome.DROPPED_EXPIRED:
                label, error = "expired on arrival", None
            case _:
                return
        if outcome is not PutOutcome.DROPPED_FAILED:
            self.scored_once = True
        streak = self.dropped_in_a_row
        streak.add(label, error)
        cfg = self.core.config
        early = cfg.max_reward_failures_at_start
        if (
            not self.scored_once
            and early is not None
            and label in _VERIFIER_FAILURES
            and streak.counts[label] >= early
        ):
            self.core.fail(
                f"the run's first {streak.total()} groups failed and none was scored: most "
                f"frequent cause: {streak.summary()}. {_hints(streak, cfg.max_staleness)} "
                f"(max_reward_failures_at_start={early}; None to go on to max_dropped_in_a_row)"
            )
            return
        limit = cfg.max_dropped_in_a_row
        if limit is not None and streak.total() >= limit:
            self.core.fail(
                f"{streak.total()} groups in a row failed, were filtered or expired on arrival "
                f"and none completed: most frequent cause: {streak.summary()}. "
                f"{_hints(streak, cfg.max_staleness)} (max_dropped_in_a_row={limit}; raise "
                "it, or None, if this is expected)"
            )

    def _requeue(self, group: RolloutGroup) -> None:
        """Queue an expired group's prompt again, so no prompt is silently lost."""
        self.core.prompts.requeue(
            Prompt(
                tokens=group.prompt_tokens.tolist(),
                task=group.task,
                prompt_id=group.prompt_id,
                metadata=_detached(group.metadata),
            )
        )

    def _report_drop(
        self, group: RolloutGroup, outcome: PutOutcome, reason: FailureReason | None
    ) -> None:
        log.debug("group %s (%s) %s: %s", group.uid, group.prompt_id, outcome.value, group.error)
        if outcome is PutOutcome.DROPPED_FAILED:
            self.failure_log.record(
                (reason or FailureReason.INTERNAL).value, group.task, group.error
            )
        if self.record.enabled:
            self.record.dropped(group, _drop_label(outcome, reason), self.core.version)
        if not self.reporting:
            return
        record = DropRecord(
            uid=group.uid,
            prompt_id=group.prompt_id,
            task=group.task,
            outcome=outcome,
            reason=reason,
            error=group.error,
            samples=group.num_samples,
            tokens=group.num_tokens,
            version=self.core.version,
        )
        self.drops.deliver(record, self.core.fail)

    def set_version(self, version: int) -> None:
        """Move to `version`: count every group that expired and re-queue its prompt first,
        then report them, so `on_drop` never sees a half-updated ledger."""
        core = self.core
        log.debug("policy version %d -> %d", core.version, version)
        core.version = version
        expired = core.buffer.set_version(version)
        for group in expired:
            core.progress.count_expired(group)
            self._requeue(group)
        for group in expired:
            self._report_drop(group, PutOutcome.DROPPED_EXPIRED, None)
        core.changed.notify()

    def count_idle(self) -> None:
        """Add the idle time since the last group landed (if none is in flight) to `idle_s`."""
        now = time.monotonic()
        if self.idle_since is not None:
            self.core.progress.counters.idle_s += now - self.idle_since
        self.idle_since = None if self.core.inflight else now


def _drop_label(outcome: PutOutcome, reason: FailureReason | None) -> str:
    """A dropped group's reason as the record names it: the failure's, or the outcome's."""
    if outcome is PutOutcome.DROPPED_FAILED:
        return (reason or FailureReason.INTERNAL).value
    return "filtered" if outcome is PutOutcome.DROPPED_FILTERED else "expired"


def _extra_error(group: RolloutGroup, limit: int) -> str | None:
    """Why the group's samples carry more `extra` than each may (`max_extra_bytes`, reserved
    with the group), or None. Extra that cannot be encoded is the buffer's to refuse."""
    for i, sample in enumerate(group.samples):
        if not sample.extra:
            continue
        try:
            size = len(codec.encode_value(sample.extra))
        except codec.CodecError:
            return None
        if size > limit:
            keys = ", ".join(sorted(map(repr, sample.extra))[:5])
            return (
                f"the group could not be stored: sample {i}'s extra ({keys}) encodes to {size} "
                f"B, over the {limit} B each sample may carry (max_extra_bytes, reserved with "
                "its group within max_buffer_bytes): store less in extra, or raise "
                "max_extra_bytes"
            )
    return None


def _detached(value: Any) -> Any:
    """A copy of an array that may be a view into a decoded group's bytes (so keeping it does
    not keep the whole group alive), at any depth of the dicts and lists metadata may nest
    (what the codec decodes); anything else as is."""
    if isinstance(value, np.ndarray):
        return np.array(value)
    if type(value) is dict:
        return {k: _detached(v) for k, v in value.items()}
    if type(value) in (list, tuple):  # not a subclass: a namedtuple takes no iterable
        return type(value)(_detached(v) for v in value)
    return value


_VERIFIER_FAILURES = frozenset(
    r.value
    for r in (FailureReason.REWARD_ERROR, FailureReason.REWARD_DEADLINE, FailureReason.FILTER_ERROR)
)
_HINTS = {
    "reward": "Fix the reward function: call it on one group by hand to see the error.",
    "filter": "Check the filter: one that rejects every group (or DAPO-style filtering early "
    "in training) drops this many; raise max_dropped_in_a_row if that is expected.",
    "engine": "Check the engine: its log says why it failed or gave no answer.",
    "prompt": "Check the prompts: each failed group's error names what is wrong with it.",
    "episode": "Check the rollout function: each failed group's error names what it did.",
}
_HINT_OF = {
    FailureReason.REWARD_ERROR.value: "reward",
    FailureReason.REWARD_DEADLINE.value: "reward",
    FailureReason.FILTER_ERROR.value: "filter",
    "filtered": "filter",
    FailureReason.ENGINE_ERROR.value: "engine",
    FailureReason.ENGINE_DEADLINE.value: "engine",
    FailureReason.ENGINE_DEAD.value: "engine",
    FailureReason.MALFORMED_OUTPUT.value: "engine",
    FailureReason.BAD_PROMPT.value: "prompt",
    FailureReason.ENVIRONMENT_ERROR.value: "episode",
    FailureReason.EPISODE_DEADLINE.value: "episode",
}


def _hints(streak: Causes, max_staleness: int | None) -> str:
    """The hints that fit the labels of a streak, most frequent first, each once."""
    hints: list[str] = []
    for label, _ in streak.counts.most_common():
        if label == "expired on arrival":
            hint = (
                "A group expires on arrival when the engine stamps versions older than "
                f"version - max_staleness={max_staleness}: was its version label set back by "
                "another producer on it?"
            )
        elif label in _HINT_OF:
            hint = _HINTS[_HINT_OF[label]]
        else:
            continue
        if hint not in hints:
            hints.append(hint)
    return " ".join(hints)
