from collections import Counter
from typing import Any

import numpy as np
import pytest

from asyncroll.codec import CodecError, encode_value
from asyncroll.prompts import CursorState, PromptStream, TaskMix, encode_prompt
from asyncroll.types import Prompt


async def draw_all(stream: PromptStream) -> list[Prompt]:
    out = []
    while (p := await stream.next()) is not None:
        out.append(p)
    return out


async def test_plain_list_gives_ids_and_ends() -> None:
    stream = PromptStream([[1, 2], {"tokens": [3], "task": "math", "metadata": {"label": 4}}])
    got = await draw_all(stream)
    assert [p.prompt_id for p in got] == ["default/0", "math/1"]
    assert got[1].metadata == {"label": 4} and stream.exhausted


async def test_requeued_prompts_come_first_and_unread_comes_next() -> None:
    stream = PromptStream([[1], [2], [3]])
    first = await stream.next()
    assert first is not None
    stream.requeue(Prompt(tokens=[9], prompt_id="x"))
    stream.unread(first)
    assert [p.prompt_id for p in await draw_all(stream)] == [
        "default/0", "x", "default/1", "default/2",
    ]  # fmt: skip


async def test_task_mix_follows_its_weights() -> None:
    mix = TaskMix({"a": [[1]] * 4000, "b": [[2]] * 4000}, weights={"a": 3.0, "b": 1.0}, seed=1)
    stream = PromptStream(mix)
    tasks = Counter()
    for _ in range(2000):
        p = await stream.next()
        assert p is not None
        tasks[p.task] += 1
    assert 0.71 < tasks["a"] / 2000 < 0.79  # 0.75 expected; 4 sigma is ~0.04


async def test_task_mix_drains_every_task() -> None:
    stream = PromptStream(TaskMix({"a": [[1]] * 5, "b": [[2]] * 2}, seed=0))
    got = await draw_all(stream)
    assert Counter(p.task for p in got) == {"a": 5, "b": 2}
    assert sorted(p.prompt_id for p in got if p.task == "b") == ["b/0", "b/1"]


async def test_a_mix_labels_what_carries_no_task_and_refuses_a_prompt_of_another() -> None:
    """A `Prompt` kept its own task in a `TaskMix`: chat prompts built without `task=` (so
    "default", ids "default/<row>") went into the mix's "math" under the wrong task, and two
    such sources gave the same prompt ids. Rows without a task take the mix's; a `Prompt` of
    another task is an error naming the source and the fix."""
    rows = [{"tokens": [1, 2]}, {"tokens": [3], "prompt_id": "r1"}]
    got = await draw_all(PromptStream(TaskMix({"math": rows}, seed=0)))
    assert [(p.task, p.prompt_id) for p in got] == [("math", "math/0"), ("math", "r1")]
    mislabelled = PromptStream(TaskMix({"math": [Prompt(tokens=[1], prompt_id="default/0")]}))
    with pytest.raises(
        ValueError, match=r"TaskMix source 'math' gave prompt 'default/0' of task 'default'"
    ):
        await mislabelled.next()
    # outside a mix a prompt keeps the task it carries
    kept = await draw_all(PromptStream([Prompt(tokens=[1], task="code")]))
    assert [p.task for p in kept] == ["code"]


async def test_cursor_resumes_exactly() -> None:
    def source() -> TaskMix:
        return TaskMix(
            {"a": [[i] for i in range(50)], "b": [[100 + i] for i in range(50)]},
            weights={"a": 2.0, "b": 1.0},
            seed=7,
        )

    straight = [p.prompt_id for p in await draw_all(PromptStream(source()))]
    first = PromptStream(source())
    head = [(await first.next()) for _ in range(30)]
    head_ids = [p.prompt_id for p in head if p is not None]
    first.requeue(Prompt(tokens=[1], prompt_id="again", task="a"))
    resumed = PromptStream(source())
    resumed.load(first.state())
    tail = [p.prompt_id for p in await draw_all(resumed)]
    assert tail[0] == "again"
    assert head_ids + tail[1:] == straight


async def test_cursor_resumes_exactly_after_a_task_ran_dry() -> None:
    """Finding a task used up costs the mix a draw. A resumed stream that did not know the
    task had run dry found it again, one more draw, and every choice after it differed."""

    def source() -> TaskMix:
        return TaskMix(
            {"a": [[i] for i in range(2)], "b": [[100 + i] for i in range(30)],
             "c": [[200 + i] for i in range(30)]},
            seed=3,
        )  # fmt: skip

    straight = [p.prompt_id for p in await draw_all(PromptStream(source()))]
    for cut in range(len(straight)):
        first = PromptStream(source())
        head = [p.prompt_id for p in [await first.next() for _ in range(cut)] if p is not None]
        resumed = PromptStream(source())
        resumed.load(first.state())
        assert head + [p.prompt_id for p in await draw_all(resumed)] == straight, cut


async def test_async_sources_and_their_cursor() -> None:
    async def gen():  # type: ignore[no-untyped-def]
        for i in range(5):
            yield [i]

    stream = PromptStream(gen())
    await stream.next()
    state = stream.state()
    resumed = PromptStream(gen())
    resumed.load(state)
    assert [p.prompt_id for p in await draw_all(resumed)] == [f"default/{i}" for i in range(1, 5)]


async def test_resuming_past_the_end_of_a_shorter_source_is_an_error() -> None:
    stream = PromptStream([[1], [2], [3]])
    await draw_all(stream)
    shorter = PromptStream([[1]])
    shorter.load(stream.state())
    with pytest.raises(ValueError, match="same prompt source"):
        await shorter.next()


@pytest.mark.parametrize(
    ("tasks", "weights", "message"),
    [
        ({}, None, "at least one task"),
        ({"a": []}, {"b": 1.0}, "weights name tasks"),
        ({"a": []}, {"a": 0.0}, "finite and > 0"),
        ({"a": []}, {"a": float("nan")}, "finite and > 0"),
        # a group's task is a str: an int name failed every prompt of the task as a bad
        # prompt, and made checkpoints `load` refused (their cursor is keyed by task name)
        ({0: [], "b": []}, None, "task names must be str"),
    ],
)
def test_task_mix_validation(tasks: dict, weights: dict | None, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        TaskMix(tasks, weights)


async def test_a_none_item_is_a_prompt_and_the_stream_goes_on() -> None:
    """None is a bad prompt (its group fails, counted), not the end of the source."""
    stream = PromptStream([[1], None, [3]])
    got = await draw_all(stream)
    assert [p.prompt_id for p in got] == ["default/0", "default/1", "default/2"]
    assert got[1].tokens is None and got[2].tokens == [3]
    assert stream.state().drawn == {"default": 3}


async def test_a_none_item_in_an_async_source_is_a_prompt_too() -> None:
    async def gen():  # type: ignore[no-untyped-def]
        yield [1]
        yield None
        yield [3]

    got = await draw_all(PromptStream(gen()))
    assert [p.tokens for p in got] == [[1], None, [3]]


async def test_resuming_skips_none_items_like_any_other() -> None:
    stream = PromptStream([None, None, [3], [4]])
    for _ in range(3):
        await stream.next()
    resumed = PromptStream([None, None, [3], [4]])
    resumed.load(stream.state())
    assert [p.tokens for p in await draw_all(resumed)] == [[4]]


def metadata_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a
    )


async def test_requeued_and_unread_prompts_keep_arrays_through_the_cursor() -> None:
    stream = PromptStream([np.arange(4), [5]])
    first = await stream.next()
    assert first is not None
    again = Prompt(
        tokens=[1, 2], prompt_id="x", metadata={"arr": np.arange(3), "label": np.int64(7)}
    )
    stream.requeue(again)
    stream.unread(first)
    resumed = PromptStream([np.arange(4), [5]])
    resumed.load(stream.state())
    got = await draw_all(resumed)
    assert [p.prompt_id for p in got] == ["default/0", "x", "default/1"]
    assert got[0].tokens.tolist() == [0, 1, 2, 3]
    assert got[1].tokens == [1, 2] and metadata_equal(got[1].metadata, again.metadata)


async def test_a_prompt_that_cannot_be_checkpointed_is_named() -> None:
    stream = PromptStream([[1]])
    stream.requeue(Prompt(tokens=[1], prompt_id="odd", metadata={"x": object()}))
    with pytest.raises(CodecError, match=r"'odd'.*object"):
        stream.state()


@pytest.mark.parametrize(
    "blob",
    [
        b"\xc1",  # not msgpack
        encode_value(["not", "a", "prompt"]),
        encode_value({"tokens": [1], "task": 3, "prompt_id": None, "metadata": {}}),
        encode_value({"tokens": [1], "task": "t", "prompt_id": None, "metadata": []}),
        encode_value({"tokens": [1], "task": "t", "prompt_id": 5, "metadata": {}}),
        encode_value({"tokens": [1], "task": "t", "prompt_id": None, "metadata": {}, "x": 1}),
    ],
)
def test_a_corrupt_requeued_prompt_is_refused_before_loading(blob: bytes) -> None:
    good = PromptStream([[1]]).state()
    bad = CursorState(
        drawn=good.drawn, rng_state=None, requeued=[encode_prompt(Prompt(tokens=[1])), blob]
    )
    stream = PromptStream([[1], [2]])
    with pytest.raises(ValueError, match="re-queued prompt 1"):
        stream.check(bad)
    with pytest.raises(ValueError, match="re-queued prompt 1"):
        stream.load(bad)
    assert stream.state().requeued == []  # nothing loaded


def _owner(arr: np.ndarray) -> object:
    """The object that owns an array's memory (the array itself when it owns it)."""
    while isinstance(arr.base, np.ndarray):
        arr = arr.base
    return arr if arr.base is None else arr.base


async def test_a_requeued_prompt_holds_no_view_into_its_expired_group() -> None:
    """An expired group's prompt goes back with copies of its metadata's arrays, nested ones
    too: a view would keep the group's whole decoded payload alive (the buffer decodes arrays
    as views into a group's bytes), against the byte bound. The simulation's payload is
    64 kB a sample; the arrays are 32 bytes."""
    from asyncroll import Producer, SamplingConfig, SimEngine

    metadata = {"top": np.arange(4), "nested": {"ids": np.arange(4)}, "listed": [np.arange(4)]}
    engine = SimEngine(vocab_size=64, payload_bytes_per_sample=65536)
    producer = Producer(
        engine, [Prompt(tokens=[3, 4], metadata=metadata) for _ in range(4)],
        lambda g: [1.0] * g.num_samples, group_size=2, batch_size=2, max_staleness=0,
        sampling=SamplingConfig(max_new_tokens=4), max_buffer_bytes=1 << 24,
    )  # fmt: skip
    async with engine, producer:
        await producer._changed.wait_until(lambda: producer.buffer.num_ready == 2, 30)
        await producer.pause()
        await producer.update_weights()  # both ready groups are too stale now: they expire
        requeued = list(producer._core.prompts._requeued)
        await producer.resume()
    assert len(requeued) >= 2 and producer.progress.counters.expired_groups >= 2
    for prompt in requeued:
        arrays = [prompt.metadata["top"], prompt.metadata["nested"]["ids"]]
        arrays.append(prompt.metadata["listed"][0])
        for arr in arrays:
            assert arr.tolist() == [0, 1, 2, 3]
            owner = _owner(arr)
            assert owner is arr, f"a view into a {type(owner).__name__} of {len(owner)} bytes"  # type: ignore[arg-type]
