"""Counters of the producer (docs/design.md, invariants 4 and 5).

Every counter is cumulative and lives on the producer; "since the last batch" is the difference
of two cumulative snapshots, so there is no second set of counters to keep in step and nothing to
forget to reset. Units are in the names: `_groups`, `_samples`, `_tokens`, `_s` (seconds).
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from asyncroll._core.causes import Causes, FailureCause
from asyncroll.buffer import PutOutcome
from asyncroll.outcomes import FailureReason
from asyncroll.types import RolloutGroup, Status


class ProgressCounters(msgspec.Struct, kw_only=True):
    """Cumulative counts. The ledger identity over them is checked by `Producer.check_ledger`:
    started == in_flight + ready + resume + consumed + filtered + failed + expired."""

    started_groups: int = 0
    started_samples: int = 0
    resumed_groups: int = 0  # an aborted group started again (not a new start)
    aborted_groups: int = 0  # times a group came back partial from a pause (an event, not a state)
    aborted_samples: int = 0
    completed_groups: int = 0  # entered the buffer as ready
    completed_samples: int = 0
    consumed_groups: int = 0  # handed to the trainer
    consumed_samples: int = 0
    consumed_tokens: int = 0
    failed_groups: int = 0
    failed_samples: int = 0
    filtered_groups: int = 0
    filtered_samples: int = 0
    expired_groups: int = 0
    expired_samples: int = 0
    generated_tokens: int = 0
    wasted_tokens_failed: int = 0
    wasted_tokens_filtered: int = 0
    wasted_tokens_expired: int = 0
    reward_sum: float = 0.0  # over every scored sample, before filtering
    reward_count: int = 0
    wait_s: float = 0.0  # time the trainer spent waiting inside produce_batch
    idle_s: float = 0.0  # time the producer ran with no group in flight (generation idle)
    failed_groups_by_reason: dict[str, int] = {}  # `FailureReason` value -> groups
    # Per task (`Prompt.task`): a mix whose tasks fail, get filtered or score differently
    # shows it here, where the totals above would average it away.
    completed_groups_by_task: dict[str, int] = {}
    consumed_groups_by_task: dict[str, int] = {}
    failed_groups_by_task: dict[str, int] = {}
    filtered_groups_by_task: dict[str, int] = {}
    expired_groups_by_task: dict[str, int] = {}
    reward_sum_by_task: dict[str, float] = {}
    reward_count_by_task: dict[str, int] = {}
    # Tokens by who wrote them (policy_tokens + environment_tokens == generated_tokens), and
    # the turns of multi-turn episodes (a rollout function), counted when their group lands.
    policy_tokens: int = 0
    environment_tokens: int = 0
    episodes: int = 0  # episodes (samples of multi-turn groups) that landed
    policy_turns: int = 0
    environment_turns: int = 0
    restarted_groups: int = 0  # episodes cut off by a stop: the group restarts from its prompt
    wasted_tokens_restarted: int = 0
    # Partial tokens past the budget of the run a checkpoint was resumed into (a smaller
    # max_new_tokens or max_model_len): their samples finish as "length" at the new budget.
    wasted_tokens_truncated: int = 0

    def minus(self, earlier: ProgressCounters) -> ProgressCounters:
        """The counts accumulated since `earlier` (a snapshot of the same counters)."""
        out: dict[str, Any] = {}
        for f in self.__struct_fields__:
            now, then = getattr(self, f), getattr(earlier, f)
            if isinstance(now, dict):
                out[f] = {k: v - then.get(k, 0) for k, v in now.items() if v != then.get(k, 0)}
            else:
                out[f] = now - then
        return ProgressCounters(**out)

    def count_restart(self, policy: int, environment: int) -> None:
        """A group whose episodes were cut off restarts from its prompt: what they had
        generated is wasted."""
        self.restarted_groups += 1
        self.generated_tokens += policy + environment
        self.policy_tokens += policy
        self.environment_tokens += environment
        self.wasted_tokens_restarted += policy + environment

    def copy(self) -> ProgressCounters:
        dicts = {
            f: dict(v) for f in self.__struct_fields__ if isinstance(v := getattr(self, f), dict)
        }
        return msgspec.structs.replace(self, **dicts)


class LatencyHistogram:
    """Group latencies in log-spaced buckets (2% wide, 0.1 ms to 1 day): fixed memory however
    long the run, quantiles within one bucket's width."""

    LOW_S = 1e-4
    RATIO = 1.02
    BUCKETS = math.ceil(math.log(86400 / LOW_S) / math.log(RATIO)) + 1

    def __init__(self) -> None:
        self.counts: npt.NDArray[np.int64] = np.zeros(self.BUCKETS, dtype=np.int64)

    def record(self, seconds: float) -> None:
        idx = 0 if seconds <= self.LOW_S else int(math.log(seconds / self.LOW_S, self.RATIO)) + 1
        self.counts[min(idx, self.BUCKETS - 1)] += 1

    def snapshot(self) -> npt.NDArray[np.int64]:
        return self.counts.copy()

    @classmethod
    def quantile(cls, counts: npt.NDArray[np.int64], q: float) -> float:
        """The q-quantile (0..1) of the latencies counted in `counts` (upper bucket edge);
        NaN when nothing was counted."""
        total = int(counts.sum())
        if total == 0:
            return math.nan
        idx = int(np.searchsorted(np.cumsum(counts), max(1, math.ceil(q * total))))
        return cls.LOW_S * cls.RATIO**idx


class ProduceBatchResult(msgspec.Struct, kw_only=True):
    """What `Producer.produce_batch` hands the trainer: the groups, the policy version at hand-out,
    the counters since the previous batch (`delta`) and since the start (`totals`)."""

    groups: list[RolloutGroup]
    version: int
    delta: ProgressCounters
    totals: ProgressCounters
    window_s: float  # wall time since the previous batch
    latency_p50_s: float
    latency_p99_s: float
    # The groups that failed in the window by `FailureReason`, each with its most frequent
    # error message: what to log beside `metrics()` (whose values are numbers only).
    failure_causes: dict[str, FailureCause] = {}

    def staleness_tokens(self) -> dict[int, int]:
        """Policy tokens of the batch counted by staleness (`version` - the token's version);
        environment tokens of multi-turn samples were not sampled and are not counted."""
        versions = [
            s.versions if s.loss_mask is None else s.versions[s.loss_mask.view(np.bool_)]
            for g in self.groups
            for s in g.samples
        ]
        flat = np.concatenate(versions) if versions else np.zeros(0, dtype=np.int32)
        if not flat.size:
            return {}
        staleness = self.version - flat.astype(np.int64)
        low = int(staleness.min())
        counts = np.bincount(staleness - low)
        return {low + i: int(c) for i, c in enumerate(counts.tolist()) if c}

    def metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        """A flat `{name: number}` dict for wandb/tensorboard: the deltas, a few ratios, totals.

        Breakdowns are `name/key` entries: `failed_groups_by_reason/<reason>` for every
        `FailureReason` (0 included, so a dashboard's series exist before the first failure),
        `<outcome>_groups_by_task/<task>` and `reward_mean_by_task/<task>` for the tasks seen,
        and `staleness_tokens/<k>`: the batch's tokens sampled k versions ago (its histogram).
        """
        d = self.delta
        out: dict[str, float] = {}
        for counters, where in ((d, prefix), (self.totals, f"{prefix}total/")):
            out |= {f"{where}failed_groups_by_reason/{r.value}": 0 for r in FailureReason}
            for f in counters.__struct_fields__:
                value = getattr(counters, f)
                if isinstance(value, dict):  # one number per key: failed_groups_by_reason/...
                    out |= {f"{where}{f}/{k}": v for k, v in value.items()}
                else:
                    out[f"{where}{f}"] = value
            out |= {
                f"{where}reward_mean_by_task/{task}": counters.reward_sum_by_task.get(task, 0.0) / n
                for task, n in counters.reward_count_by_task.items()
                if n
            }
        staleness = self.staleness_tokens()
        out |= {f"{prefix}staleness_tokens/{k}": v for k, v in staleness.items()}
        finished = d.completed_groups + d.failed_groups + d.filtered_groups
        out |= {
            f"{prefix}version": self.version,
            f"{prefix}batch_groups": len(self.groups),
            f"{prefix}reward_mean": d.reward_sum / d.reward_count if d.reward_count else math.nan,
            f"{prefix}failed_ratio": d.failed_groups / finished if finished else 0.0,
            f"{prefix}turns_per_episode": (
                (d.policy_turns + d.environment_turns) / d.episodes if d.episodes else 0.0
            ),
            f"{prefix}filtered_ratio": d.filtered_groups / finished if finished else 0.0,
            f"{prefix}tokens_per_s": d.generated_tokens / self.window_s if self.window_s else 0.0,
            f"{prefix}wait_ratio": d.wait_s / self.window_s if self.window_s else 0.0,
            f"{prefix}latency_p50_s": self.latency_p50_s,
            f"{prefix}latency_p99_s": self.latency_p99_s,
            f"{prefix}staleness_mean": _mean_staleness(staleness),
            f"{prefix}staleness_max": max(staleness, default=0),
        }
        return out


def _add(counts: dict[str, Any], key: str, value: float) -> None:
    counts[key] = counts.get(key, 0) + value


def _mean_staleness(hist: dict[int, int]) -> float:
    n = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / n if n else 0.0


class ProduceProgress:
    """The producer's counters and latency histogram, with a read-and-reset window.

    `consume()` returns what accumulated since the previous call (the delta of two cumulative
    snapshots) plus the cumulative totals, and moves the window's start to now.
    """

    def __init__(self) -> None:
        self.counters = ProgressCounters()
        self.latency = LatencyHistogram()
        self._mark_counters = ProgressCounters()
        self._mark_latency = self.latency.snapshot()
        self._mark_time = time.monotonic()
        self._causes = Causes()  # failed groups of the window, with their messages

    def count_start(self, group: RolloutGroup, *, resumed: bool) -> None:
        c = self.counters
        if resumed:
            c.resumed_groups += 1
        else:
            c.started_groups += 1
            c.started_samples += group.num_samples

    def count_landing(
        self,
        group: RolloutGroup,
        outcome: PutOutcome,
        reason: FailureReason | None,
        tokens_before: int,
        rewards: list[float] | None = None,
    ) -> None:
        """Count one finished attempt by where it went: the only place landings are counted.
        `tokens_before` is what the group held when the attempt started; `rewards` are the
        rewards it was scored with (counted whether it was kept or not)."""
        c = self.counters
        task = group.task
        if rewards:
            total = math.fsum(rewards)
            c.reward_sum += total
            c.reward_count += len(rewards)
            _add(c.reward_sum_by_task, task, total)
            _add(c.reward_count_by_task, task, len(rewards))
        tokens = group.num_tokens
        c.generated_tokens += tokens - tokens_before
        environment = self._count_turns(group)
        c.policy_tokens += tokens - tokens_before - environment
        c.environment_tokens += environment
        match outcome:
            case PutOutcome.STORED_READY:
                c.completed_groups += 1
                c.completed_samples += group.num_samples
                _add(c.completed_groups_by_task, task, 1)
                self.latency.record(group.latency_s)
            case PutOutcome.STORED_RESUME:
                c.aborted_groups += 1
                c.aborted_samples += sum(s.status is Status.ABORTED for s in group.samples)
            case PutOutcome.DROPPED_FAILED:
                c.failed_groups += 1
                c.failed_samples += group.num_samples
                c.wasted_tokens_failed += tokens
                _add(c.failed_groups_by_reason, (reason or FailureReason.INTERNAL).value, 1)
                self._causes.add((reason or FailureReason.INTERNAL).value, group.error)
                _add(c.failed_groups_by_task, task, 1)
                self.latency.record(group.latency_s)
            case PutOutcome.DROPPED_FILTERED:
                c.filtered_groups += 1
                c.filtered_samples += group.num_samples
                c.wasted_tokens_filtered += tokens
                _add(c.filtered_groups_by_task, task, 1)
                self.latency.record(group.latency_s)
            case PutOutcome.DROPPED_EXPIRED:
                self.count_expired(group)

    def _count_turns(self, group: RolloutGroup) -> int:
        """Count the episodes and turns of a multi-turn group; its environment tokens."""
        c, environment = self.counters, 0
        for s in group.samples:
            mask, ends = s.loss_mask, s.turn_ends
            if mask is None or ends is None:
                continue  # single turn: every token is the policy's
            environment += len(mask) - int(np.count_nonzero(mask))
            c.episodes += 1
            starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
            nonempty = starts < ends
            env_turns = int(np.count_nonzero(mask[starts[nonempty]] == 0))
            c.environment_turns += env_turns
            c.policy_turns += len(ends) - env_turns  # an empty turn is a policy turn
        return environment

    def count_restart(self, policy: int, environment: int) -> None:
        self.counters.count_restart(policy, environment)

    def count_expired(self, group: RolloutGroup) -> None:
        c = self.counters
        c.expired_groups += 1
        c.expired_samples += group.num_samples
        c.wasted_tokens_expired += group.num_tokens
        _add(c.expired_groups_by_task, group.task, 1)

    def count_consumed(self, groups: list[RolloutGroup]) -> None:
        c = self.counters
        c.consumed_groups += len(groups)
        for g in groups:
            c.consumed_samples += g.num_samples
            c.consumed_tokens += g.num_tokens
            _add(c.consumed_groups_by_task, g.task, 1)

    def consume(self) -> tuple[ProgressCounters, ProgressCounters, npt.NDArray[np.int64], float]:
        """(delta, totals, latency counts of the window, window seconds); starts a new window."""
        now = time.monotonic()
        totals = self.counters.copy()
        latency = self.latency.snapshot()
        out = (totals.minus(self._mark_counters), totals, latency - self._mark_latency,
               now - self._mark_time)  # fmt: skip
        self._mark_counters, self._mark_latency, self._mark_time = totals, latency, now
        return out

    def take_causes(self) -> dict[str, FailureCause]:
        """The failure causes since the previous call (`ProduceBatchResult.failure_causes`)."""
        causes = self._causes.causes()
        self._causes.clear()
        return causes

    def restore(self, counters: ProgressCounters, latency_counts: list[int]) -> None:
        """Continue from a checkpoint's totals (whose histogram layout the caller checked);
        the next window starts here."""
        self.counters = counters = counters.copy()
        if counters.policy_tokens + counters.environment_tokens == 0:
            counters.policy_tokens = counters.generated_tokens  # a single-turn-only checkpoint
        self.latency.counts = np.asarray(latency_counts, dtype=np.int64)
        self._mark_counters = counters.copy()
        self._mark_latency = self.latency.snapshot()
        self._mark_time = time.monotonic()
