"""The first mistakes a new user makes with prompts and budgets get a message that says what to
change: chat rows passed without `chat_prompts`, plain strings, a batch larger than the data,
a token budget the model cannot hold.

The producer runs on `SimEngine`, a simulation: what is checked is the producer's handling of
its input, not language.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from asyncroll import (
    Producer,
    ProducerError,
    ProducerExhausted,
    RolloutGroup,
    SamplingConfig,
    SimEngine,
)
from asyncroll.evaluation import Evaluator

VOCAB = 64


def reward(group: RolloutGroup) -> list[float]:
    return [1.0] * len(group.samples)


def producer(engine: Any, prompts: Any, **options: Any) -> Producer:
    return Producer(engine, prompts, reward, group_size=2, **options)


CHAT_ROWS = [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}] * 3


async def test_chat_rows_without_chat_prompts_name_chat_prompts() -> None:
    """A dataset of chat rows handed straight to the producer: the message says to render them
    with `chat_prompts` (it was "TypeError: Unexpected keyword argument 'messages'")."""
    async with SimEngine(vocab_size=VOCAB) as engine:
        with pytest.raises(ProducerError, match="chat_prompts") as caught:
            async with producer(engine, CHAT_ROWS, batch_size=2) as p:
                await p.produce_batch()
        with pytest.raises(ValueError, match="chat_prompts") as refused:
            Evaluator(producer(engine, [[3, 4]]), CHAT_ROWS, reward)
    for message in (str(caught.value), str(refused.value)):
        assert "'messages'" in message and "chat_prompts(rows, tokenizer)" in message, message
        assert "tokens, task, prompt_id, metadata" in message


@pytest.mark.parametrize("text", ["What is 2+2?", b"What is 2+2?"])
async def test_plain_strings_say_to_tokenize_them(text: str | bytes) -> None:
    """Plain strings are not token ids: every group would fail as a bad prompt and the first
    batch raised `ProducerExhausted`, which reads as an empty dataset."""
    async with SimEngine(vocab_size=VOCAB) as engine:
        with pytest.raises(ProducerError, match=r"is a (str|bytes).*tokenize") as caught:
            async with producer(engine, [text] * 4, batch_size=2) as p:
                await p.produce_batch()
        with pytest.raises(ValueError, match=r"is a (str|bytes).*tokenize"):
            Evaluator(producer(engine, [[3, 4]]), [text], reward)
    assert "chat_prompts" in str(caught.value)


async def test_a_batch_cut_short_by_the_end_of_the_prompts_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`batch_size=16` on 10 prompts returns the 10 (the documented last batch), with a warning
    that says why and what to change; a full batch logs nothing."""
    caplog.set_level(logging.WARNING, logger="asyncroll.producer")
    prompts = [[3, 4 + i] for i in range(10)]
    async with SimEngine(vocab_size=VOCAB) as engine, producer(engine, prompts, batch_size=16) as p:
        assert len((await p.produce_batch(4)).groups) == 4
        assert not caplog.records
        batch = await p.produce_batch()
    assert len(batch.groups) == 6
    (record,) = caplog.records
    message = record.getMessage()
    assert "6 of the 16 groups" in message and "the prompts are used up" in message, message


class ShortModelEngine(SimEngine):
    """A simulated engine whose model holds 16 positions."""

    @property
    def max_model_len(self) -> int:
        return 16


async def test_a_budget_the_model_cannot_hold_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """`max_new_tokens` at or beyond `max_model_len` can never be reached (the prompt takes at
    least one position): every sample is capped, which is now said once, at construction."""
    caplog.set_level(logging.WARNING, logger="asyncroll")
    async with ShortModelEngine(vocab_size=VOCAB) as engine:
        producer(engine, [[3]], sampling=SamplingConfig(max_new_tokens=15))
        assert not caplog.records  # 1 prompt token + 15 fit
        p = producer(engine, [[3, 4]], batch_size=1, sampling=SamplingConfig(max_new_tokens=100))
        (record,) = caplog.records
        message = record.getMessage()
        assert "max_new_tokens=100" in message and "max_model_len=16" in message, message
        assert "lower max_new_tokens or raise max_model_len" in message
        async with p:
            batch = await p.produce_batch()
        assert {len(s.tokens) for s in batch.groups[0].samples} == {14}  # what the warning said
        caplog.clear()
        Evaluator(p, [[3]], reward, sampling=SamplingConfig(max_new_tokens=40))
        assert "max_new_tokens=40" in caplog.records[0].getMessage()


async def test_a_run_whose_every_group_failed_says_so_when_the_prompts_run_out() -> None:
    """Prompts that all fail alone (ids outside the vocabulary) end in `ProducerExhausted`: its
    message says no group was ever ready and what became of them, not "every ready group
    handed out", which reads as an empty dataset."""
    async with SimEngine(vocab_size=VOCAB) as engine, producer(engine, [[VOCAB]] * 4) as p:
        with pytest.raises(ProducerExhausted) as caught:
            await p.produce_batch(2)
    message = str(caught.value)
    assert "no group was ever ready: 4 started, 4 failed (bad_prompt: 4)" in message, message
