"""`ProducerConfig`: every knob of the producer, validated when it is built.

A mistake here would otherwise surface minutes into a run (or never, as a silent stall), so each
check names the field and what to change.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from asyncroll.engines.base import SamplingConfig

# Encoded bytes per generated token: token id, logprob and version, 4 bytes each.
BYTES_PER_TOKEN = 12
# Encoded bytes per token of a multi-turn sample, at worst: the above, its loss-mask byte and
# one turn boundary (4 bytes) per token (an environment turn holds one token at least; empty
# policy turns, at most `max_turns`, are added on their own).
BYTES_PER_EPISODE_TOKEN = BYTES_PER_TOKEN + 1 + 4
# The loss mask and turn boundaries of a sample are two more arrays: headers and alignment.
EPISODE_SAMPLE_OVERHEAD_BYTES = 256
# Per-sample msgpack header and alignment padding in the codec (measured: ~150-250 bytes).
SAMPLE_OVERHEAD_BYTES = 512
# The `extra` a sample may carry by default, a response token (`ProducerConfig.extra_bytes`).
EXTRA_BYTES_PER_TOKEN = 8
# The group's own header (ids, task, versions...) and the prompt's alignment padding.
GROUP_OVERHEAD_BYTES = 1024


class ProducerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of a `Producer`. Sizes are in groups unless the name says otherwise."""

    group_size: int = 8
    sampling: SamplingConfig = SamplingConfig()
    batch_size: int | None = None  # groups per produce_batch; required with max_staleness
    max_staleness: int | None = None  # versions a token may lag at hand-out; None: no limit
    oversample: float = 1.0  # run up to this many batches' worth beyond the staleness capacity
    max_inflight_groups: int = 64
    max_buffer_groups: int = 1024  # in flight + ready + waiting to resume
    max_buffer_bytes: int = 1 << 30  # encoded bytes held + reserved for in-flight groups
    # Encoded bytes of `extra` (what a reward function, filter or episode writes on a sample)
    # each sample may carry: reserved with its group, so they stay inside max_buffer_bytes; a
    # group whose samples carry more fails (`unstorable`). None: EXTRA_BYTES_PER_TOKEN a
    # response token (`extra_bytes`).
    max_extra_bytes: int | None = None
    order: Literal["fifo", "stalest"] = "fifo"
    pause_mode: Literal["abort", "keep"] = "abort"
    generate_timeout_s: float = 600.0
    reward_timeout_s: float = 60.0
    abort_timeout_s: float = 30.0
    update_timeout_s: float = 600.0
    prompt_timeout_s: float = 300.0
    reward_workers: int = 4  # threads (or processes) for synchronous reward functions
    reward_in_thread: bool = True  # False: call sync reward functions on the event loop
    # Where sync reward functions run: "thread" (a hung call keeps its thread) or "process"
    # (worker processes, killed and replaced at reward_timeout_s or when they crash; recycled
    # after reward_worker_max_calls calls or past reward_worker_max_mib of resident memory).
    reward_executor: Literal["thread", "process"] = "thread"
    reward_worker_max_calls: int | None = 1000
    reward_worker_max_mib: float | None = None
    # Groups in a row that may fail or be filtered before the run stops with an error that
    # counts them by reason (a reward that always raises, a filter that rejects everything).
    # None: never stop.
    max_dropped_in_a_row: int | None = 1024
    # Groups in a row whose reward function (or filter) may fail for one same reason before the
    # run's first group is scored, before the run stops: a verifier broken from the start is
    # said after 16 groups, not 1024. Failures of generation (which land before the slower
    # successes) keep the bound above. None: only the bound above.
    max_reward_failures_at_start: int | None = 16
    # Deadline of one call of an async `on_drop` callback (`asyncroll._core.drops` says what a late
    # one does), and the least time between two WARNING summaries of failed groups
    # (`asyncroll._core.logs`).
    on_drop_timeout_s: float = 10.0
    failure_log_interval_s: float = 60.0
    # Multi-turn episodes (a `rollout_fn`): policy turns per episode, response tokens per
    # episode (policy and environment together; None: 2 x max_turns x max_new_tokens, as many
    # for the environment as the policy may take), and the deadline of one episode (time
    # parked by a pause or a weight update not counted).
    max_turns: int = 16
    max_episode_tokens: int | None = None
    episode_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        _at_least("group_size", self.group_size, 1, "generate at least one sample per prompt")
        _at_least("max_inflight_groups", self.max_inflight_groups, 1, "allow one group at least")
        _at_least("max_buffer_groups", self.max_buffer_groups, 1, "hold one group at least")
        _at_least("reward_workers", self.reward_workers, 1, "use one worker at least")
        if self.max_dropped_in_a_row is not None:
            _at_least("max_dropped_in_a_row", self.max_dropped_in_a_row, 1, "or None for no limit")
        if self.max_reward_failures_at_start is not None:
            early = self.max_reward_failures_at_start
            _at_least("max_reward_failures_at_start", early, 1, "or None for no limit")
        if self.batch_size is not None:
            _at_least("batch_size", self.batch_size, 1, "or None")
            if self.batch_size > self.max_buffer_groups:
                raise ValueError(
                    f"batch_size={self.batch_size} exceeds max_buffer_groups="
                    f"{self.max_buffer_groups}: a batch could never be ready at once; raise "
                    "max_buffer_groups"
                )
        if self.max_staleness is not None:
            _at_least("max_staleness", self.max_staleness, 0, "use None for no limit")
            if self.batch_size is None:
                raise ValueError(
                    "max_staleness needs batch_size (groups per produce_batch): admission keeps "
                    "accepted + running <= (max_staleness + version + 1) x batch_size"
                )
        _at_least("max_turns", self.max_turns, 1, "an episode needs one policy turn at least")
        if self.max_extra_bytes is not None:
            _at_least("max_extra_bytes", self.max_extra_bytes, 0, "0: no extra; None: by tokens")
        if self.max_episode_tokens is not None:
            _at_least("max_episode_tokens", self.max_episode_tokens, 1, "or None")
        if not (math.isfinite(self.oversample) and self.oversample >= 1.0):
            raise ValueError(f"oversample={self.oversample}: must be >= 1.0 (1.0: no extra)")
        for name in (
            "generate_timeout_s", "reward_timeout_s", "abort_timeout_s", "update_timeout_s",
            "prompt_timeout_s", "on_drop_timeout_s", "episode_timeout_s",
        ):  # fmt: skip
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value}: every deadline must be a positive number")
        if not (self.failure_log_interval_s >= 0 and math.isfinite(self.failure_log_interval_s)):
            raise ValueError(
                f"failure_log_interval_s={self.failure_log_interval_s}: must be a number >= 0 "
                "(0 logs every failed group)"
            )
        if self.reward_executor not in ("thread", "process"):
            raise ValueError(f"reward_executor={self.reward_executor!r}: use 'thread' or 'process'")
        if self.reward_executor == "process" and not self.reward_in_thread:
            raise ValueError(
                "reward_executor='process' with reward_in_thread=False: a reward runs either in "
                "a worker process or on the event loop; drop one of them"
            )
        if self.reward_worker_max_calls is not None:
            _at_least("reward_worker_max_calls", self.reward_worker_max_calls, 1, "or None")
        mib = self.reward_worker_max_mib
        if mib is not None and not (math.isfinite(mib) and mib > 0):
            raise ValueError(f"reward_worker_max_mib={mib}: must be a positive number, or None")
        if self.order not in ("fifo", "stalest"):
            raise ValueError(f"order={self.order!r}: use 'fifo' or 'stalest'")
        if self.pause_mode not in ("abort", "keep"):
            raise ValueError(f"pause_mode={self.pause_mode!r}: use 'abort' or 'keep'")

    @property
    def episode_tokens(self) -> int:
        """Response tokens one multi-turn episode may hold (policy and environment)."""
        if self.max_episode_tokens is not None:
            return self.max_episode_tokens
        # Policy turns in full and as much again for tool answers: max_turns x max_new_tokens
        # alone left the environment's tokens to eat the last turns' budget.
        return 2 * self.max_turns * self.sampling.max_new_tokens

    def extra_bytes(self, *, episodes: bool = False) -> int:
        """The `extra` a sample may carry (`max_extra_bytes`); by default room for the decoded
        text of every response token it may have, twice over (UTF-8 text is ~4 B a token), so
        a reward that keeps the reply's text on its sample fits."""
        if self.max_extra_bytes is not None:
            return self.max_extra_bytes
        tokens = self.episode_tokens if episodes else self.sampling.max_new_tokens
        return EXTRA_BYTES_PER_TOKEN * tokens

    def group_bytes(
        self,
        payload_bytes_per_sample: int,
        prompt_tokens: int = 0,
        metadata_bytes: int = 0,
        *,
        episodes: bool = False,
    ) -> int:
        """Largest encoded size a group can reach: its samples at full length with
        `max_extra_bytes` of extra each, its prompt (4 bytes a token) and its metadata (its
        encoded size). Reserved before it starts.
        With `episodes` (a rollout function), a sample is an episode of up to
        `episode_tokens` tokens with its loss mask and turn boundaries (no payload)."""
        if episodes:
            per_sample = (
                self.episode_tokens * BYTES_PER_EPISODE_TOKEN
                + 4 * self.max_turns
                + SAMPLE_OVERHEAD_BYTES
                + EPISODE_SAMPLE_OVERHEAD_BYTES
                + self.extra_bytes(episodes=True)
            )
        else:
            per_sample = (
                self.sampling.max_new_tokens * BYTES_PER_TOKEN
                + payload_bytes_per_sample
                + SAMPLE_OVERHEAD_BYTES
                + self.extra_bytes()
            )
        prompt = 4 * prompt_tokens + metadata_bytes + GROUP_OVERHEAD_BYTES
        return self.group_size * per_sample + prompt

    def check_fits(self, payload_bytes_per_sample: int, *, episodes: bool = False) -> None:
        """Refuse a buffer smaller than one group can be, or than one batch of them: a
        `produce_batch` that could never fill is a configuration error, said at construction."""
        need = self.group_bytes(payload_bytes_per_sample, episodes=episodes)
        if self.batch_size is not None and need <= self.max_buffer_bytes < self.batch_size * need:
            raise ValueError(
                f"max_buffer_bytes={self.max_buffer_bytes} cannot hold one batch: batch_size="
                f"{self.batch_size} groups x {need} B (what a group can take before its prompt) "
                f"= {self.batch_size * need} B; raise max_buffer_bytes or lower batch_size / "
                "group_size / " + ("max_episode_tokens" if episodes else "max_new_tokens")
            )
        if episodes and self.max_buffer_bytes < need:
            raise ValueError(
                f"max_buffer_bytes={self.max_buffer_bytes} is smaller than one group of episodes "
                f"can be ({self.group_size} samples x {self.episode_tokens} tokens x "
                f"{BYTES_PER_EPISODE_TOKEN} B + overheads and {self.extra_bytes(episodes=True)} B "
                f"of extra = {need} B): raise max_buffer_bytes or lower group_size "
                "/ max_episode_tokens / max_turns / max_extra_bytes"
            )
        if self.max_buffer_bytes < need:
            raise ValueError(
                f"max_buffer_bytes={self.max_buffer_bytes} is smaller than one group can be "
                f"({self.group_size} samples x ({self.sampling.max_new_tokens} tokens x "
                f"{BYTES_PER_TOKEN} B + {payload_bytes_per_sample} B payload + "
                f"{SAMPLE_OVERHEAD_BYTES} B + {self.extra_bytes()} B of extra) + "
                f"{GROUP_OVERHEAD_BYTES} B = {need} B, before its prompt): raise "
                "max_buffer_bytes or lower group_size / max_new_tokens / max_extra_bytes"
            )


def make_config(config: ProducerConfig | None, overrides: dict[str, Any]) -> ProducerConfig:
    """`config` with keyword overrides, naming any unknown keyword."""
    base = config or ProducerConfig()
    unknown = sorted(set(overrides) - set(ProducerConfig.__struct_fields__))
    if unknown:
        raise ValueError(
            f"unknown producer option(s) {unknown}: valid are "
            f"{sorted(ProducerConfig.__struct_fields__)}"
        )
    if isinstance(overrides.get("sampling"), dict):
        overrides = {**overrides, "sampling": SamplingConfig(**overrides["sampling"])}
    return msgspec.structs.replace(base, **overrides) if overrides else base


def _at_least(name: str, value: int, low: int, fix: str) -> None:
    # A bool is an int: max_staleness=False (meant as "off") would be a limit of 0.
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}={value!r}: must be an integer >= {low} ({fix})")
