"""`asyncroll.chat.answers.math_reward`: math-verify on GSM8K / MATH-style answers, run in reward
worker processes, where its SIGALRM timeouts work. The completions are fixed texts (a
character tokenizer, `tests/verifiers.py`); the engine side is not involved."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from asyncroll._core.rewards import RewardFailure, RewardRunner
from asyncroll.chat import text_reward
from asyncroll.chat.answers import gold_answer, math_reward
from tests.factories import make_group
from tests.verifiers import CharTokenizer

pytest.importorskip("math_verify")

CASES = [
    ("So the answer is \\boxed{42}.", "42", 1.0),
    ("I think it is 41", "42", 0.0),
    ("The result: $\\frac{1}{2}$", "0.5", 1.0),
    ("48 + 24 = 72 clips.", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", 1.0),
    ("The total is 1234", "#### 1,234", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("no answer here", "7", 0.0),
]


def group_of(texts: list[str], answer: str) -> Any:
    group = make_group(samples=len(texts))
    samples = []
    for s, t in zip(group.samples, texts, strict=True):
        ids = np.array([ord(c) for c in t], np.int32)
        zeros = np.zeros(len(ids), np.int32)
        samples.append(msgspec.structs.replace(s, tokens=ids, logprobs=zeros.astype(np.float32),
                                               versions=zeros))  # fmt: skip
    return msgspec.structs.replace(group, samples=tuple(samples), metadata={"answer": answer})


def test_gold_answers_are_read_as_gsm8k_writes_them() -> None:
    assert gold_answer("work... #### 1,234") == "1234"
    assert gold_answer(7) == "7"


@pytest.mark.parametrize(("text", "answer", "reward"), CASES)
async def test_math_reward_in_a_worker_process(
    runner: RewardRunner, text: str, answer: str, reward: float
) -> None:
    assert await runner.score(group_of([text, "nothing"], answer)) == [reward, 0.0]


@pytest.fixture(scope="module")
def runner() -> Any:
    """One pool for the cases (a worker imports math-verify once)."""
    r = RewardRunner(text_reward(math_reward, CharTokenizer()), timeout_s=60.0, workers=1,
                     in_thread=True, executor="process")  # fmt: skip
    yield r
    r.close()


async def test_in_a_thread_math_reward_says_to_use_processes() -> None:
    """math-verify's SIGALRM timeouts cannot work off the main thread: asked there, the
    reward says what to change instead of failing inside math-verify."""
    thread = RewardRunner(text_reward(math_reward, CharTokenizer()), timeout_s=60.0, workers=1,
                          in_thread=True)  # fmt: skip
    with pytest.raises(RuntimeError, match="reward_executor='process'"):
        await thread.score(group_of(["\\boxed{1}"], "1"))
    assert RewardFailure  # the process path's failures are the producer's tests
