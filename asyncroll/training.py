"""Turn a batch of groups into padded torch tensors, and the GRPO/RLOO pieces that use them.

Layout: one row per sample, `input_ids = prompt + response`, right-padded. Every per-token
tensor is aligned with `input_ids`: position t holds what belongs to token t (its old logprob,
its policy version, whether it is trained). `token_logprobs(logits, input_ids)` returns the
policy's logprobs in the same alignment, so the loss needs no off-by-one bookkeeping.

Each decoded array is copied exactly once, straight into the padded numpy buffer that the
tensors then share (`torch.from_numpy`): no Python lists per token, no second copy.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from asyncroll.types import RolloutGroup

Advantage = Literal["grpo", "rloo", "none"]


class TrainBatch(msgspec.Struct, frozen=True, kw_only=True):
    """Padded tensors of one batch (B samples, L = longest prompt + response)."""

    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L] bool: real tokens
    loss_mask: torch.Tensor  # [B, L] bool: response tokens (the ones trained on)
    old_logprobs: torch.Tensor  # [B, L] float32: behaviour policy's logprob, 0 off the mask
    versions: torch.Tensor  # [B, L] int32: policy version per response token, -1 elsewhere
    advantages: torch.Tensor  # [B] float32: one per sample
    rewards: torch.Tensor  # [B] float32
    group_index: torch.Tensor  # [B] int64: which group of the batch a row came from

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(**{f: getattr(self, f).to(device) for f in self.__struct_fields__})


def group_advantages(
    rewards: npt.NDArray[np.float64], method: Advantage = "grpo", eps: float = 1e-6
) -> npt.NDArray[np.float64]:
    """Advantages of each sample within its group (`rewards` is [groups, samples]).

    grpo: (r - mean) / (std + eps), the GRPO normalisation. rloo: r minus the mean of the
    *other* samples (leave-one-out baseline, unbiased). none: the raw rewards.
    """
    if method == "none":
        return rewards.copy()
    n = rewards.shape[1]
    centered: npt.NDArray[np.float64] = rewards - rewards.mean(axis=1, keepdims=True)
    if method == "grpo":
        scale: npt.NDArray[np.float64] = rewards.std(axis=1, keepdims=True) + eps
        return centered / scale
    if method == "rloo":
        if n < 2:
            raise ValueError("rloo needs at least 2 samples per group")
        return centered * np.float64(n / (n - 1))
    raise ValueError(f"advantage={method!r}: use 'grpo', 'rloo' or 'none'")


def to_batch(
    groups: list[RolloutGroup], *, advantage: Advantage = "grpo", pad_id: int = 0
) -> TrainBatch:
    """Pack scored groups into padded tensors with per-sample advantages."""
    if not groups:
        raise ValueError("to_batch() of no groups")
    if len({g.num_samples for g in groups}) != 1:
        raise ValueError("to_batch() needs groups of one size (advantages are per group)")
    rewards = np.stack([g.rewards() for g in groups])
    if np.isnan(rewards).any():
        raise ValueError("to_batch() needs scored groups: a sample has no reward")
    rows = [(g, s) for g in groups for s in g.samples]
    length = max(len(g.prompt_tokens) + len(s.tokens) for g, s in rows)
    ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    attention = np.zeros((len(rows), length), dtype=np.bool_)
    trained = np.zeros((len(rows), length), dtype=np.bool_)
    old = np.zeros((len(rows), length), dtype=np.float32)
    versions = np.full((len(rows), length), -1, dtype=np.int32)
    for row, (g, s) in enumerate(rows):
        p, r = len(g.prompt_tokens), len(s.tokens)
        ids[row, :p] = g.prompt_tokens
        ids[row, p : p + r] = s.tokens
        attention[row, : p + r] = True
        trained[row, p : p + r] = True
        old[row, p : p + r] = s.logprobs
        versions[row, p : p + r] = s.versions
    adv = group_advantages(rewards, advantage).astype(np.float32).reshape(-1)
    return TrainBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attention),
        loss_mask=torch.from_numpy(trained),
        old_logprobs=torch.from_numpy(old),
        versions=torch.from_numpy(versions),
        advantages=torch.from_numpy(adv),
        rewards=torch.from_numpy(rewards.astype(np.float32).reshape(-1)),
        group_index=torch.arange(len(groups)).repeat_interleave(groups[0].num_samples),
    )


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Logprob of each token of `input_ids` under `logits` ([B, L, V], causal), aligned with
    `input_ids`: position t is log p(input_ids[t] | input_ids[:t]); position 0 is 0."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def policy_loss(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    clip: float = 0.2,
    max_ratio: float | None = 10.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss with per-sample advantages, as GRPO uses it, averaged over trained tokens.

    The ratio is taken against the behaviour policy's logprobs recorded at generation, so tokens
    sampled by an older policy version (asynchronous, partial rollouts) are importance-weighted;
    `max_ratio` caps that weight (truncated importance sampling) for very stale tokens.
    """
    mask = batch.loss_mask
    log_ratio = (logprobs - batch.old_logprobs).masked_fill(~mask, 0.0)
    ratio = log_ratio.exp()
    if max_ratio is not None:
        ratio = ratio.clamp(max=max_ratio)
    adv = batch.advantages[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip, 1 + clip) * adv
    per_token = -torch.minimum(unclipped, clipped)
    n = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        stats = {
            "loss": float(loss),
            "clip_fraction": float(((unclipped != clipped) & mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "kl_behaviour": float((-log_ratio * mask).sum() / n),
        }
    return loss, stats
