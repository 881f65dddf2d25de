"""The chat demo's task without vLLM: held-out questions are never trained on, prompts go
through the tiny chat template once, and the verifier reads the decoded reply."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from asyncroll.app.demo_chat import HELD_OUT, ChatTask, letter_reward, reward_args, rows
from asyncroll.config import ProducerConfig
from asyncroll.types import RolloutGroup, RolloutState, Status


def test_held_out_questions_are_never_trained_on() -> None:
    train, held_out = rows(seed=3)
    questions = [r["messages"][0]["content"] for r in train + held_out]
    assert len(held_out) == HELD_OUT and len(set(questions)) == len(questions) == 16 * 16 * 8
    assert rows(seed=3) == (train, held_out) and rows(seed=4)[1] != held_out
    assert all(r["answer"] == r["messages"][0]["content"][-1] for r in train + held_out)


def test_the_verifier_scores_the_share_of_the_replys_words_that_are_the_answer() -> None:
    replies = ["c", " c c", "c cat", "cat", "d", "", "C?"]
    assert letter_reward([[{"role": "assistant", "content": r}] for r in replies], ["c"] * 7) == [
        1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0,
    ]  # fmt: skip


def test_prompts_render_through_the_chat_template_and_rewards_read_text(tiny_model: Path) -> None:
    task = ChatTask(tiny_model, seed=0)
    prompt = task.held_out[0]
    text = task.tokenizer.decode(prompt.tokens)
    question = prompt.metadata["messages"][0]["content"]
    assert text == f"<|bos|>user: {question}\nassistant: "
    assert {p.task for p in task.train} == {"chat"} and len(task.train) == 16 * 16 * 8 - HELD_OUT
    drawn = list(itertools.islice(task.prompts(), 50))
    assert {p.prompt_id for p in drawn} <= {p.prompt_id for p in task.train}
    answer = prompt.metadata["answer"]
    ids = [task.tokenizer.encode(r, add_special_tokens=False) for r in (answer, f"{answer} xyz")]
    samples = tuple(
        RolloutState(
            tokens=np.array(t, dtype=np.int32),
            logprobs=np.zeros(len(t), np.float32),
            versions=np.zeros(len(t), np.int32),
            status=Status.COMPLETED,
        )
        for t in ids
    )
    group = RolloutGroup(
        uid=0, prompt_id="p", task="chat", prompt_tokens=np.asarray(prompt.tokens, np.int32),
        samples=samples, metadata=prompt.metadata,
    )  # fmt: skip
    assert task.reward(group) == [1.0, 0.5]  # decoded: "c" and "c xyz"


def test_the_demo_runs_its_verifier_where_it_is_told() -> None:
    """`REWARD_EXECUTOR` (which benchmarks/demo_reward_executor.py sets) becomes the
    producer's settings: on the loop, in a thread, or in worker processes."""
    assert reward_args("inline") == {"reward_in_thread": False}
    assert reward_args("process") == {"reward_in_thread": True, "reward_executor": "process"}
    for executor in ("inline", "thread", "process"):
        ProducerConfig(**reward_args(executor))  # settings the producer accepts
