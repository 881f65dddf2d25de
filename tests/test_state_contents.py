"""What a checkpoint file holds beyond its frame: re-queued prompts and encoded groups, checked
on load (no producer needed)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from asyncroll import CheckpointError, ProducerState, ProgressCounters
from asyncroll._core.progress import LatencyHistogram
from asyncroll._core.state import STATE_FORMAT, dumps, fit_to_run, loads
from asyncroll.codec import decode, encode
from asyncroll.prompts import CursorState, PromptStream
from asyncroll.types import Prompt, Status
from tests.factories import make_group, make_sample


def producer_state(cursor: CursorState, ready: list[bytes], resume: list[bytes]) -> ProducerState:
    return ProducerState(
        format=STATE_FORMAT,
        version=3,
        next_uid=10,
        group_size=2,
        counters=ProgressCounters(),
        latency_counts=[0] * LatencyHistogram.BUCKETS,
        cursor=cursor,
        ready=ready,
        resume=resume,
    )


async def test_requeued_prompt_with_array_metadata_survives_a_checkpoint_file() -> None:
    """Defect 6: an expired group's prompt, re-queued with array metadata, broke save()."""
    stream = PromptStream([[1], [2]])
    await stream.next()
    metadata = {"arr": np.arange(3), "label": np.int64(7), "tags": ["a", {"n": 1}]}
    stream.requeue(Prompt(tokens=[1], prompt_id="default/0", metadata=metadata))
    state = loads(dumps(producer_state(stream.state(), [], [])))
    resumed = PromptStream([[1], [2]])
    resumed.load(state.cursor)
    prompt = await resumed.next()
    assert prompt is not None and prompt.prompt_id == "default/0" and prompt.tokens == [1]
    assert prompt.metadata.keys() == metadata.keys()
    assert prompt.metadata["arr"].tolist() == [0, 1, 2]
    assert prompt.metadata["label"] == 7 and prompt.metadata["tags"] == ["a", {"n": 1}]
    nxt = await resumed.next()
    assert nxt is not None and nxt.prompt_id == "default/1"


def test_good_checkpoint_loads_equal() -> None:
    cursor = PromptStream([[1]]).state()
    state = producer_state(cursor, [encode(make_group(1))], [encode(make_group(2))])
    assert loads(dumps(state)) == state


@pytest.mark.parametrize("where", ["ready", "resume"])
def test_damaged_group_bytes_under_a_good_checksum_are_a_checkpoint_error(where: str) -> None:
    good = [encode(make_group(uid, tokens=50)) for uid in range(4)]
    damaged = good[3][:-20]  # truncated, then checksummed as if whole
    groups = {"ready": [good[0], good[1]], "resume": [good[2]]}
    groups[where] = [good[0 if where == "ready" else 2], damaged]
    data = dumps(producer_state(PromptStream([[1]]).state(), groups["ready"], groups["resume"]))
    with pytest.raises(CheckpointError, match=f"corrupt checkpoint: {where} group 1: truncated"):
        loads(data)


def test_damaged_requeued_prompt_under_a_good_checksum_is_a_checkpoint_error() -> None:
    cursor = CursorState(drawn={"default": 0}, rng_state=None, requeued=[b"\xc1"])
    with pytest.raises(CheckpointError, match="corrupt checkpoint: re-queued prompt 0"):
        loads(dumps(producer_state(cursor, [], [])))


def test_a_checkpoint_of_the_previous_format_is_refused_clearly() -> None:
    """Format 1 held re-queued prompts as plain structs; this one holds them encoded."""
    data = bytearray(dumps(producer_state(PromptStream([[1]]).state(), [], [])))
    data[4:8] = (1).to_bytes(4, "little")
    with pytest.raises(CheckpointError, match="format 1 cannot be read"):
        loads(bytes(data))


@pytest.mark.parametrize("where", ["ready", "resume", "both"])
def test_one_uid_held_twice_under_a_good_checksum_is_a_checkpoint_error(where: str) -> None:
    """Issue 25: the buffer's restore raised a plain ValueError for it, which a caller falling
    back to an older checkpoint on CheckpointError would miss."""
    one = encode(make_group(1))
    groups = {"ready": ([one, one], []), "resume": ([], [one, one]), "both": ([one], [one])}[where]
    with pytest.raises(CheckpointError, match="uid 1"):
        loads(dumps(producer_state(PromptStream([[1]]).state(), *groups)))


@pytest.mark.parametrize(("budget", "lengths", "wasted"), [(8, [8, 8, 5], 12), (-3, [0, 0, 0], 33)])
def test_fit_to_run_truncates_partials_to_the_budget_and_counts_the_rest(
    budget: int, lengths: list[int], wasted: int
) -> None:
    """A budget of -3 (a smaller max_model_len than the prompt now needs) must not slice from
    the end: the samples keep no token."""
    group = make_group(1, status=Status.ABORTED, samples=3, tokens=20)
    short = msgspec.structs.replace(group.samples[2], tokens=group.samples[2].tokens[:5],
        logprobs=group.samples[2].logprobs[:5], versions=group.samples[2].versions[:5])  # fmt: skip
    samples = (group.samples[0], make_sample(8, status=Status.ABORTED, seed=1), short)
    group = msgspec.structs.replace(group, samples=samples)
    state = producer_state(PromptStream([[1]]).state(), [], [encode(group)])
    fitted = fit_to_run(state, lambda g: budget, episodes=False)
    (resumed,) = [decode(data) for data in fitted.resume]
    assert [len(s.tokens) for s in resumed.samples] == lengths
    assert fitted.counters.wasted_tokens_truncated == wasted
    done = [s.status for s in resumed.samples[:2]]
    assert done == [Status.COMPLETED, Status.COMPLETED]
    assert resumed.samples[0].finish_reason == "length"
