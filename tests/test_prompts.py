from collections import Counter

import pytest

from asyncroll.prompts import PromptStream, TaskMix
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
