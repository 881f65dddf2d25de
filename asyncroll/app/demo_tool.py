"""The demo's multi-turn task, "tool_echo": a tool answers each policy turn with a letter the
policy must echo on its next turn.

The prompt is a letter and a colon ("q:"), as in the single-turn echo task. After each policy
turn the tool appends the next letter and a colon ("c:"), as environment tokens the policy sees
but is not trained on. The reward is the fraction of the policy's tokens, over all its turns,
equal to the letter just before that turn. A random policy scores ~1/500; echoing the most
recent letter scores 1. Only the policy's tokens are scored and trained (`to_batch` masks the
tool's), so the reward can only rise if the loss mask, the turn boundaries and token-level
continuation across turns all work.

The demo's trainer gives each policy turn its own GRPO advantage (`turn_rewards`, from the
samples' `turn_ends`): with one advantage per episode, every turn was credited with the other
turns' luck, and the per-turn hit rates stalled together near 1/8 (letters said at random).
`--credit episode` trains with the episode's reward instead.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from asyncroll.episode import Episode, split_turns
from asyncroll.types import Prompt, RolloutGroup

LETTERS = "abcdefgh"
TURNS = 3  # policy turns per episode
ANSWER_TOKENS = 2  # the tool's answer: a letter and a colon

DEFAULTS: Final = {
    "max_new_tokens": 4,
    "steps": 200,
    "filter": "none",
    "entropy": 0.03,
    "blind_push": 1.0,
    "blind_target": 2.0,
}
"""tool_echo's defaults where they differ from `DemoConfig`'s (the echo task's); the command
line and `asyncroll.app.demo.demo_config` apply them.

Turns of 4 tokens, not 8: with 8, later turns drift back to the letter that fills the context
(after "g: gggggggg h:" every sample said "hhgggggg"). Every group trained (`filter="none"`):
a group every sample got wrong has no variance, and DAPO's filter (`nonzero_std`) would drop
it, so a stuck context would never reach the trainer (seed 1 stalled at 0.87 so). An entropy
bonus of 0.03 on every trained token (0.02 and 0.05 did worse).

The push (`blind_push=1.0` up to `blind_target=2.0` nats, on the failed problems: `DemoConfig.
push_on`): a (group, turn) problem whose samples all scored 0 has no GRPO advantage; a letter
the policy answers wrongly with certainty stayed so for 40-100 steps with the entropy bonus
alone, which barely moves a certain context (the runs that ended at 0.48-0.75). The push makes
those problems' sampled tokens less likely (`asyncroll.train.unlikelihood`, gradient ~1 at
certainty) until their context's entropy reaches 2 nats, so the next samples differ and GRPO
sees them. With it, 14 runs of 14 on seeds 1-3 were solved in 63-148 steps. Pushing every
blind problem (`push_on="blind"`: all the same partial score too) also lowered the right tokens
of half-right answers, and one run of 11 sat at 0.5 for 120 steps; a capped entropy bonus there
instead (`blind_entropy`) left those contexts at 0.02-0.1 nats and stalled seed 2 at 0.66; the
bonus on the failed problems alone (`entropy_on="failed"`) drove them to near-uniform over the
vocabulary and stalled others; a target of 4 nats collapsed a run.
benchmarks/results/tool_echo_dynamics.md has every run. `steps` is a
ceiling with room for a slow run: the demo stops once solved (`DemoConfig.solved_reward`)."""


def episode_tokens(max_new_tokens: int) -> int:
    """Tokens an episode holds at most: every policy turn in full and every tool answer."""
    return TURNS * max_new_tokens + (TURNS - 1) * ANSWER_TOKENS


def tool_echo_prompts(tokenizer: Any, seed: int) -> Iterator[Prompt]:
    """Endless seeded stream of prompts; the metadata holds the tool's answers (token ids, the
    same for every sample of the group, so GRPO compares policies, not environments) and each
    turn's target letter."""
    rng = random.Random(seed)
    bos = tokenizer.token_to_id("<|bos|>")
    for index in range(1 << 62):
        letters = [rng.choice(LETTERS) for _ in range(TURNS)]
        yield Prompt(
            tokens=[bos, *tokenizer.encode(f"{letters[0]}:").ids],
            task="tool_echo",
            prompt_id=f"tool_echo/{index}",
            metadata={
                "letters": "".join(letters),
                "targets": [tokenizer.token_to_id(letter) for letter in letters],
                "answers": [tokenizer.encode(f"{letter}:").ids for letter in letters[1:]],
            },
        )


async def tool_echo_agent(episode: Episode) -> None:
    """Policy turn, tool answer, policy turn, ...: `TURNS` policy turns."""
    answers = episode.metadata["answers"]
    for turn in range(TURNS):
        await episode.generate()
        if turn < len(answers):
            episode.append(answers[turn])


def turn_rewards(group: RolloutGroup) -> npt.NDArray[np.float64]:
    """[samples, TURNS]: each policy turn's fraction of tokens equal to its letter (0 for a
    missing or empty turn). The demo's trainer gives each turn its own GRPO advantage."""
    targets = group.metadata["targets"]
    out = np.zeros((group.num_samples, TURNS))
    for i, sample in enumerate(group.samples):
        policy_turns = [tokens for policy, tokens in split_turns(sample) if policy]
        for k, (target, tokens) in enumerate(zip(targets, policy_turns, strict=False)):
            out[i, k] = float(np.mean(tokens == target)) if len(tokens) else 0.0
    return out


def tool_echo_reward(group: RolloutGroup) -> list[float]:
    """Fraction of policy tokens equal to the letter given just before their turn."""
    targets = group.metadata["targets"]
    rewards = []
    for sample in group.samples:
        hits = total = 0
        policy_turns = [tokens for policy, tokens in split_turns(sample) if policy]
        for target, tokens in zip(targets, policy_turns, strict=False):
            hits += int(np.count_nonzero(tokens == target))
            total += len(tokens)
        rewards.append(hits / total if total else 0.0)
    return rewards


def step_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """What shows where learning stalls, per training batch: each turn's and each target
    letter's hit rate, and the share of (group, turn) problems whose samples all scored the
    same (GRPO gives them no advantage), split into all wrong (0) and all right (1)."""
    rewards = np.stack([turn_rewards(g) for g in groups])  # [groups, samples, turns]
    out = {f"turn{k}": float(rewards[:, :, k].mean()) for k in range(TURNS)}
    per_problem = rewards.mean(axis=1)  # [groups, turns]
    flat = rewards.std(axis=1) == 0
    out["zero_std"] = float(flat.mean())
    out["zero_std_wrong"] = float((flat & (per_problem == 0)).mean())
    out["zero_std_right"] = float((flat & (per_problem == 1)).mean())
    letters = np.array([list(g.metadata["letters"]) for g in groups])  # [groups, turns]
    for letter in LETTERS:
        if (letters == letter).any():
            out[f"letter_{letter}"] = float(per_problem[letters == letter].mean())
    return out
