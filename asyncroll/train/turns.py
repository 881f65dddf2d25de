"""Trainer maths for multi-turn episodes: a GRPO loss with one advantage per policy turn, an
entropy bonus (plain or capped at a target), and the problems GRPO is blind to (every sample
scored the same, below solved) with the unlikelihood term that pushes their sampled answers
down. The demo's tool_echo task uses them; any trainer may."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from asyncroll.train.loss import Advantage, Std, TrainBatch
from asyncroll.types import RolloutGroup

TurnRewards = Callable[[RolloutGroup], npt.NDArray[np.float64]]
"""A multi-turn task's reward of each policy turn of each sample: [samples, turns]."""


def turn_loss(
    logprobs: Any,
    batch: TrainBatch,
    groups: list[RolloutGroup],
    turn_rewards: TurnRewards,
    correction: Any,
    anchor: Any,
    *,
    advantage: Advantage = "grpo",
    std: Std = "population",
) -> Any:
    """The policy loss with advantages per policy turn: the token-weighted sum of one loss per
    turn index, each over that turn's tokens, its advantages from that turn's rewards (with
    `advantage` and `std` as given to `to_batch`). It is the same mean over all trained tokens
    as `policy_loss` of the batch, with each token's advantage its own turn's.

    A `correction`'s weights are those of the whole batch: its `sequence_band` judges each
    sample by the geometric mean of all its ratios, as `policy_loss` does, not each turn by
    its own (a turn of ratio 2.46 and one of 0.41 are a sample of 1.0, which is kept). Each
    turn's loss is therefore taken with the band off and the tokens the batch's band dropped
    left out: those weigh 0 in `policy_loss` too, and every turn's share is of the batch's
    trained tokens, so the sum is the same mean."""
    import torch

    from asyncroll.train.loss import behaviour_weights, group_advantages, policy_loss

    rewards = np.stack([turn_rewards(g) for g in groups])  # [groups, samples, turns]
    turn = torch.from_numpy(turn_index(groups, batch.input_ids.shape[1]))
    total = batch.loss_mask.sum().clamp(min=1)
    trained = batch.loss_mask
    if correction is not None and correction.sequence_band is not None:
        if anchor is None:
            raise ValueError("a correction needs the proximal logprobs (anchor)")
        trained = trained & ~behaviour_weights(anchor.detach(), batch, correction).masked
        correction = msgspec.structs.replace(correction, sequence_band=None)
    loss = logprobs.new_zeros(())
    for k in range(rewards.shape[2]):
        mask = trained & (turn == k)
        if not bool(mask.any()):
            continue
        turn_advantages = group_advantages(rewards[:, :, k], advantage, std=std)
        part = msgspec.structs.replace(
            batch,
            loss_mask=mask,
            advantages=torch.from_numpy(turn_advantages.astype(np.float32).reshape(-1)),
        )
        part_loss, _ = policy_loss(logprobs, part, correction=correction, proximal_logprobs=anchor)
        loss = loss + part_loss * mask.sum() / total
    return loss


def token_entropy(logits: Any, temperature: float) -> Any:
    """[B, L]: the entropy of the distribution each token was sampled from (the logits one
    position before it, at the sampling temperature; the demo samples without top-k/top-p),
    aligned with `input_ids` as `token_logprobs` is; position 0 is 0."""
    import torch

    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)  # [B, L - 1]: of the token at position t + 1
    return torch.nn.functional.pad(entropy, (1, 0))


def mean_entropy(logits: Any, batch: TrainBatch, temperature: float, mask: Any = None) -> Any:
    """Mean entropy of the distributions that sampled the trained tokens (`token_entropy`), or
    the tokens of `mask` (a [B, L] bool within the loss mask; `failed_tokens`); 0 where none.

    A bonus on it pushes the policy away from certainty, where GRPO is blind: once every sample
    of a group agrees, its advantages are 0 and nothing corrects a mistake."""
    mask = batch.loss_mask if mask is None else mask
    return (token_entropy(logits, temperature) * mask).sum() / mask.sum().clamp(min=1)


def failed_problems(rewards: npt.NDArray[np.float64]) -> npt.NDArray[np.bool_]:
    """[groups, turns] of `rewards` [groups, samples, turns]: the problems (one per group and
    turn) whose samples all failed, each scoring 0 or less. GRPO gives them no advantage (their
    rewards do not vary) and nothing in them to reinforce; unlike an all-right problem, the
    policy must change there."""
    return np.asarray((rewards <= 0).all(axis=1), dtype=np.bool_)


def blind_problems(rewards: npt.NDArray[np.float64], solved: float = 1.0) -> npt.NDArray[np.bool_]:
    """[groups, turns] of `rewards` [groups, samples, turns]: the problems GRPO is blind to and
    has not solved, whose samples all scored the same, below `solved`. All 0 (`failed_problems`)
    and also all the same partial score (every sample half right): neither has an advantage,
    and in both the policy must change to improve. `solved`: the reward of a right answer."""
    if not math.isfinite(solved):
        raise ValueError(f"solved must be a finite reward, not {solved}")
    flat = (rewards == rewards[:, :1]).all(axis=1)
    return np.asarray(flat & (rewards[:, 0] < solved), dtype=np.bool_)


def failed_tokens(
    batch: TrainBatch, groups: list[RolloutGroup], turn_rewards: TurnRewards | None
) -> Any:
    """[B, L] bool: the trained tokens of the problems every sample failed (`failed_problems`):
    a (group, policy turn) with `turn_rewards`, else a whole group by its samples' rewards. An
    entropy bonus on these alone (`mean_entropy(..., mask=...)`) explores where the policy fails
    and lets the contexts it has solved become certain."""
    return problem_tokens(batch, groups, turn_rewards, failed_problems)


def blind_tokens(
    batch: TrainBatch,
    groups: list[RolloutGroup],
    turn_rewards: TurnRewards | None,
    solved: float = 1.0,
) -> Any:
    """[B, L] bool: the trained tokens of the blind problems (`blind_problems`), per (group,
    policy turn) with `turn_rewards`, else per group."""
    return problem_tokens(batch, groups, turn_rewards, lambda r: blind_problems(r, solved))


def problem_tokens(
    batch: TrainBatch,
    groups: list[RolloutGroup],
    turn_rewards: TurnRewards | None,
    problems: Callable[[npt.NDArray[np.float64]], npt.NDArray[np.bool_]],
) -> Any:
    """[B, L] bool: the trained tokens of the problems `problems` picks from the rewards
    [groups, samples, turns] (one turn, the samples' rewards, without `turn_rewards`)."""
    import torch

    if turn_rewards is None:
        picked = problems(np.stack([g.rewards() for g in groups])[:, :, None])[:, 0]
        per_row = torch.from_numpy(np.repeat(picked, groups[0].num_samples))
        return batch.loss_mask & per_row[:, None]
    per_turn = problems(np.stack([turn_rewards(g) for g in groups]))  # [groups, turns]
    turn = turn_index(groups, batch.input_ids.shape[1])  # [rows, L], -1 off the policy turns
    rows = np.repeat(per_turn, groups[0].num_samples, axis=0)  # [rows, turns]
    known = (turn >= 0) & (turn < rows.shape[1])  # a turn past the task's has no reward
    hit = np.take_along_axis(rows, np.where(known, turn, 0), axis=1) & known
    return batch.loss_mask & torch.from_numpy(hit)


def capped_entropy(per_token: Any, mask: Any, target: float) -> Any:
    """Mean over the tokens of `mask` of min(entropy, `target`) (`per_token`: `token_entropy`);
    0 where none. A bonus on it raises the entropy of the contexts below `target` and leaves
    the others alone: a stuck context is spread over a few of the policy's likeliest answers,
    not driven towards uniform over the vocabulary, where a sample almost never hits the one
    right answer. `target=math.inf` is the plain mean (`mean_entropy`)."""
    if not target >= 0:
        raise ValueError(f"the entropy target must be >= 0 nats, not {target}")
    return (per_token.clamp(max=target) * mask).sum() / mask.sum().clamp(min=1)


def unlikelihood(logprobs: Any, mask: Any, total: Any) -> Any:
    """Sum over the tokens of `mask` of -log(1 - p(token)) (`logprobs`: `token_logprobs`),
    divided by `total` (the batch's trained tokens, as the policy loss is, so a weight on it
    reads as an advantage). Minimising it makes the masked tokens less likely: its gradient on
    a token's own logit is p, ~1 at a context certain of that token, where an entropy bonus's
    vanishes (~p log(1/p) of the rest), and the mass goes to the other tokens in proportion to
    their probability (the policy's next answers, not the vocabulary at large). A token with
    logprob -inf (sampled outside the trainer's nucleus) adds 0."""
    import torch

    # p < 1 - 1e-6 keeps the log finite; -inf off the mask: those add exactly 0, gradient too
    chosen = torch.where(mask, logprobs.clamp(max=math.log1p(-1e-6)), -math.inf)
    return -torch.log(-torch.expm1(chosen)).sum() / torch.as_tensor(total).clamp(min=1)


def turn_index(groups: list[RolloutGroup], length: int) -> npt.NDArray[np.int64]:
    """[rows, length] of `to_batch`'s layout: which policy turn (0, 1, ...) each token belongs
    to, from the samples' `turn_ends` and `loss_mask`; -1 for prompt, environment and padding."""
    rows = [(g, s) for g in groups for s in g.samples]
    out = np.full((len(rows), length), -1, dtype=np.int64)
    for row, (g, s) in enumerate(rows):
        offset, start, k = len(g.prompt_tokens), 0, 0
        ends = [len(s.tokens)] if s.turn_ends is None else s.turn_ends.tolist()
        for end in ends:
            if end > start and (s.loss_mask is None or s.loss_mask[start]):
                out[row, offset + start : offset + end] = k
                k += 1
            elif end == start:  # an empty turn is still a policy turn
                k += 1
            start = end
    return out
