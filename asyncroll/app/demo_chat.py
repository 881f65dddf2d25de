"""The demo's chat task, "chat": a question in a chat template, a verifier on the decoded reply,
and evaluation on held-out questions.

The user says "red cat: say the letter c c c"; the answer is the letter ("c"). The question
goes through the tiny tokenizer's chat template (`asyncroll.chat.TINY_CHAT_TEMPLATE`) once, as
a dataset of chat messages would (`asyncroll.chat.chat_prompts`), and the reward reads the
decoded reply (`asyncroll.chat.text_reward`, TRL's `reward_funcs` convention): the share of the
reply's words that are the answer, so "c" and "c c" score 1, "c cat" 1/2, "cat" and "d" 0. A
reply passes (the evaluation's accuracy) when it scores 1: it says the letter and nothing else.

Of the questions (two of 16 words before one of eight letters: 2,048), a seeded 64 are held
out: the policy trains on the others and is evaluated on these, greedily, every `eval_every`
steps on the training engine (`asyncroll.evaluation.Evaluator`). A random policy's replies
almost never consist of one letter (accuracy ~0).

What the tiny model (361k parameters, random weights) can learn fast, measured with seed 0
(eval accuracy after 100 s of running): asking for the last of three letters (position matters)
stayed at 0 for 150 steps; scoring the share of the reply's *characters* that are the letter
rewards words that contain it ("cat" 1/3), and the policy settled on such words (accuracy 0
after 160 steps, 0.11 after 70 with the letter said three times); with one mention of the
letter and this reward, a random reply so rarely holds the letter as a word that GRPO's filter
dropped almost every group (accuracy 0.125 after 20 steps of 12 s). Said three times, the
letter is what the template's context holds most of, and the first hits come soon.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from asyncroll.chat import PromptBuilder, text_reward, tiny_chat_tokenizer
from asyncroll.types import Prompt

LETTERS = "abcdefgh"
WORDS = (  # each one token of the tiny tokenizer
    "red", "green", "blue", "cat", "dog", "sun", "up", "down",
    "left", "right", "true", "false", "one", "two", "three", "four",
)  # fmt: skip
HELD_OUT = 64  # questions evaluated, never trained on
QUESTION = "{} {}: say the letter {l} {l} {l}"

DEFAULTS: Final = {"max_new_tokens": 4, "steps": 150, "eval_every": 10, "solved_reward": 0.0}
"""chat's defaults where they differ from `DemoConfig`'s; `asyncroll.app.demo.demo_config` applies
them (a flag given wins)."""

REWARD_EXECUTOR = "inline"
"""Where the verifier runs: "inline" (on the event loop: it splits a few words), "thread" or
"process" (worker processes, which a hung verifier cannot stop). benchmarks/demo_reward_executor.py
sets this to compare them (benchmarks/results/2026-12-07-demo-reward-executor.md): processes
cost the training loop nothing measurable, but each evaluation ~2 s (its workers start anew),
past the 5% of the demo's time that a switch may cost, so the demo stays inline."""


def rows(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training and the held-out rows (chat messages and the reference answer), split by
    `seed`."""
    questions = list(itertools.product(WORDS, WORDS, LETTERS))
    random.Random(seed).shuffle(questions)

    def row(question: tuple[str, str, str]) -> dict[str, Any]:
        first, second, letter = question
        content = QUESTION.format(first, second, l=letter)
        return {"messages": [{"role": "user", "content": content}], "answer": question[-1]}

    return [row(q) for q in questions[HELD_OUT:]], [row(q) for q in questions[:HELD_OUT]]


def letter_reward(completions: Sequence[Any], answer: Sequence[str]) -> list[float]:
    """The verifier: the share of the reply's words that are the answer (0 for no word)."""
    out = []
    for completion, letter in zip(completions, answer, strict=True):
        words = completion[0]["content"].split()
        out.append(words.count(letter) / len(words) if words else 0.0)
    return out


class ChatTask:
    """What the demo needs of the chat task: the tokenizer with its chat template, the
    endless training prompts, the held-out prompts and the reward on decoded text."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        self.tokenizer = tiny_chat_tokenizer(model_dir)
        builder = PromptBuilder(self.tokenizer, task="chat")
        train, held_out = rows(seed)
        self.train = [builder.build(row, i) for i, row in enumerate(train)]
        eval_builder = PromptBuilder(self.tokenizer, task="chat_held_out")
        self.held_out = [eval_builder.build(row, i) for i, row in enumerate(held_out)]
        self.reward = text_reward(letter_reward, self.tokenizer)
        self.reward_args = reward_args(REWARD_EXECUTOR)
        self.seed = seed

    def prompts(self) -> Iterator[Prompt]:
        """Training questions drawn at random (seeded), without end."""
        rng = random.Random(self.seed)
        while True:
            yield rng.choice(self.train)


def reward_args(executor: str) -> dict[str, Any]:
    """The `Producer` arguments that run the reward on `executor` (see `REWARD_EXECUTOR`)."""
    if executor == "inline":
        return {"reward_in_thread": False}
    return {"reward_in_thread": True, "reward_executor": executor}
