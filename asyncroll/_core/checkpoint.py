"""The producer's side of a checkpoint: the state a running producer saves, and how a saved
state is checked and loaded into a new one (the file format is `state.py`).

A checkpoint needs nothing in flight, except groups of episodes: those are user code and cannot
be stored, so each is saved as a group to restart from its prompt (same uid), what its episodes
generated counted as wasted. Loading is all or nothing: every check runs before anything loads.
"""

from __future__ import annotations

import msgspec

from asyncroll import codec
from asyncroll._core import rollout
from asyncroll._core.admission import Admission
from asyncroll._core.core import Core
from asyncroll._core.progress import LatencyHistogram, ProgressCounters
from asyncroll._core.state import STATE_FORMAT, CheckpointError, ProducerState, fit_to_run
from asyncroll.types import Status


def snapshot(core: Core, admission: Admission) -> ProducerState:
    """The run's state (`Producer.state_dict`); the running producer is not changed by it."""
    if core.inflight and not core.episodes:
        raise RuntimeError(
            f"state_dict() with {len(core.inflight)} groups in flight: pause first "
            "(pause_mode='abort'), or use save()"
        )
    admission.unstage()
    ready, resume = core.buffer.snapshot()
    counters = core.progress.counters.copy()
    resume = resume + _restart_entries(core, counters)
    return ProducerState(
        format=STATE_FORMAT,
        version=core.version,
        next_uid=admission.next_uid,
        group_size=core.config.group_size,
        counters=counters,
        latency_counts=core.progress.latency.counts.tolist(),
        cursor=core.prompts.state(),
        ready=ready,
        resume=resume,
        scheduled_groups=admission.scheduled(),
    )


def _restart_entries(core: Core, counters: ProgressCounters) -> list[bytes]:
    """Groups of episodes in flight, as resume entries that restart from their prompt, with
    `counters` (a copy) counting their tokens as wasted: the checkpoint's ledger holds."""
    entries = []
    for flight in sorted(core.inflight.values(), key=lambda f: f.group.uid):
        group = flight.group
        samples = rollout.interrupted(rollout.fresh_samples(group.num_samples))
        restart = msgspec.structs.replace(group, samples=samples, status=Status.ABORTED)
        entries.append(codec.encode(restart))
        if flight.episodes is not None:  # else it never started: nothing is wasted
            counters.count_restart(*flight.episodes.tokens)
    return entries


def restore(core: Core, admission: Admission, state: ProducerState, *, weights_given: bool) -> None:
    """Check `state` against this producer and load it (`Producer.load_state_dict`), all or
    nothing; `weights_given`: the caller said which weights the engine serves (needed past
    version 0)."""
    if state.format != STATE_FORMAT:
        raise CheckpointError(f"checkpoint format {state.format}, expected {STATE_FORMAT}")
    if state.version > 0 and not weights_given:
        raise ValueError(
            f"the checkpoint is at version {state.version}: pass weights=<the trainer's "
            f"weights at version {state.version}> (e.g. model.named_parameters()) so the "
            "engine serves them, or weights=None if it already does"
        )
    cfg = core.config
    if state.group_size != cfg.group_size:
        raise CheckpointError(
            f"checkpoint has group_size={state.group_size}, this producer "
            f"{cfg.group_size}: resume with the same group_size"
        )
    core.prompts.check(state.cursor)
    if len(state.latency_counts) != LatencyHistogram.BUCKETS:
        raise CheckpointError("checkpoint latency histogram has another bucket layout")
    held = len(state.ready) + len(state.resume)
    if held > cfg.max_buffer_groups:
        raise CheckpointError(
            f"the checkpoint holds {held} groups ({len(state.ready)} ready, "
            f"{len(state.resume)} to resume), more than max_buffer_groups="
            f"{cfg.max_buffer_groups}: resume with max_buffer_groups={held} or more"
        )
    sampling, max_model_len = cfg.sampling, core.engine.max_model_len
    try:
        state = fit_to_run(
            state,
            lambda group: rollout.token_budget(group, sampling, max_model_len),
            episodes=core.episodes,
        )
        core.buffer.restore(state.version, state.ready, state.resume, admission.reservation)
    except codec.CodecError as exc:
        raise CheckpointError(f"corrupt checkpoint: a stored group: {exc}") from None
    core.prompts.load(state.cursor)
    core.progress.restore(state.counters, state.latency_counts)
    core.version = state.version
    admission.next_uid = state.next_uid
    scheduled = state.scheduled_groups
    admission.anchor(
        state.counters.consumed_groups if scheduled is None else scheduled, state.version
    )
