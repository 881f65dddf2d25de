"""Turn a batch of groups into padded torch tensors, and the GRPO/RLOO pieces that use them.

Layout: one row per sample, `input_ids = prompt + response`, right-padded. Every per-token
tensor is aligned with `input_ids`: position t holds what belongs to token t (its old logprob,
its policy version, whether it is trained). `token_logprobs(logits, input_ids)` returns the
policy's logprobs in the same alignment, so the loss needs no off-by-one bookkeeping.

Each decoded array is copied exactly once, straight into the padded numpy buffer that the
tensors then share (`torch.from_numpy`): no Python lists per token, no second copy.

Off-policy correction. An async producer hands the trainer tokens sampled by older weights (the
*behaviour* policy mu, whose logprobs `old_logprobs` holds), so the PPO ratio against mu mixes
two things: the update's own step and the staleness of the data. `policy_loss(...,
correction=Correction(...))` separates them as decoupled PPO does: the trust region is clipped
around the *proximal* policy (the trainer's weights before this update), and the behaviour ratio
rho = pi_prox / mu becomes a per-token weight, truncated or masked so that a few very stale
tokens cannot dominate the gradient. `mismatch_metrics` reports how far mu and pi_prox are
apart, per staleness. The behaviour logprobs must be those of the distribution that sampled
(temperature, top-p, top-k applied: `VLLMEngine` asks vLLM for processed logprobs), and
`token_logprobs` must be given the same sampling parameters, or rho measures the sampler's
settings instead of the staleness.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from asyncroll.types import RolloutGroup

Advantage = Literal["grpo", "rloo", "none"]
Std = Literal["population", "sample"]


class TrainBatch(msgspec.Struct, frozen=True, kw_only=True):
    """Padded tensors of one batch (B samples, L = longest prompt + response)."""

    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L] bool: real tokens
    loss_mask: torch.Tensor  # [B, L] bool: tokens the policy sampled (the ones trained on)
    old_logprobs: torch.Tensor  # [B, L] float32: behaviour policy's logprob, 0 off the mask
    versions: torch.Tensor  # [B, L] int32: policy version per policy token, -1 elsewhere
    advantages: torch.Tensor  # [B] float32: one per sample
    rewards: torch.Tensor  # [B] float32
    group_index: torch.Tensor  # [B] int64: which group of the batch a row came from

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(**{f: getattr(self, f).to(device) for f in self.__struct_fields__})


def group_advantages(
    rewards: npt.NDArray[np.float64],
    method: Advantage = "grpo",
    eps: float = 1e-6,
    *,
    std: Std = "population",
) -> npt.NDArray[np.float64]:
    """Advantages of each sample within its group (`rewards` is [groups, samples]).

    grpo: (r - mean) / (std + eps), the GRPO normalisation, with the group's *population*
    standard deviation (divided by n) by default; `std="sample"` divides by n - 1 instead, as
    TRL and verl do, which makes every advantage sqrt((n - 1) / n) as large (0.87x for groups
    of 4, 0.97x for 16; Adam is nearly invariant to such a uniform scale, the clip is not).
    rloo: r minus the mean of the *other* samples (leave-one-out baseline, unbiased). none:
    the raw rewards.
    """
    if std not in ("population", "sample"):
        raise ValueError(f"std={std!r}: use 'population' (n) or 'sample' (n - 1)")
    if method == "none":
        return rewards.copy()
    n = rewards.shape[1]
    centered: npt.NDArray[np.float64] = rewards - rewards.mean(axis=1, keepdims=True)
    if method == "grpo":
        if not eps > 0:  # NaN too
            raise ValueError(
                f"eps={eps}: must be > 0 (a group of equal rewards has std 0: with eps <= 0 its "
                "advantages would be NaN or infinite)"
            )
        if std == "sample" and n < 2:
            raise ValueError(
                "std='sample' needs at least 2 samples per group (it divides by n - 1)"
            )
        ddof = 1 if std == "sample" else 0
        scale: npt.NDArray[np.float64] = rewards.std(axis=1, keepdims=True, ddof=ddof) + eps
        return centered / scale
    if method == "rloo":
        if n < 2:
            raise ValueError("rloo needs at least 2 samples per group")
        return centered * np.float64(n / (n - 1))
    raise ValueError(f"advantage={method!r}: use 'grpo', 'rloo' or 'none'")


def to_batch(
    groups: list[RolloutGroup],
    *,
    advantage: Advantage = "grpo",
    std: Std = "population",
    pad_id: int = 0,
) -> TrainBatch:
    """Pack scored groups into padded tensors with per-sample advantages (`advantage` and
    `std` as in `group_advantages`).

    Environment tokens of multi-turn samples (`loss_mask` 0) are in `input_ids` and
    `attention_mask` (the policy saw them) but not in `loss_mask`; their `old_logprobs` are 0
    and their `versions` -1, as for the prompt."""
    if not groups:
        raise ValueError("to_batch() of no groups")
    if len({g.num_samples for g in groups}) != 1:
        raise ValueError("to_batch() needs groups of one size (advantages are per group)")
    rewards = np.stack([g.rewards() for g in groups])
    if np.isnan(rewards).any():
        raise ValueError("to_batch() needs scored groups: a sample has no reward")
    if not np.isfinite(rewards).all():  # a group built or decoded outside the producer
        raise ValueError("to_batch() needs finite rewards: an infinite one makes NaN advantages")
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
        if s.loss_mask is None:  # single turn: every response token is the policy's
            trained[row, p : p + r] = True
            old[row, p : p + r] = s.logprobs
            versions[row, p : p + r] = s.versions
        else:  # environment tokens are context: not trained, no logprob, no version
            policy = s.loss_mask.view(np.bool_)
            trained[row, p : p + r] = policy
            old[row, p : p + r] = np.where(policy, s.logprobs, np.float32(0))
            versions[row, p : p + r] = np.where(policy, s.versions, np.int32(-1))
    adv = group_advantages(rewards, advantage, std=std).astype(np.float32).reshape(-1)
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


# Chunks of `token_logprobs` are sized so that their temporaries stay under `CHUNK_SHARE`-th of
# the logits' own size (whatever the batch: a fixed size would be most of a small batch's logits)
# and under `CHUNK_BYTES` (a large batch gains nothing from larger chunks). An eighth leaves room
# for what torch's kernels allocate inside (sort, topk, softmax) under a quarter of the logits.
# Only a single row can exceed it: one row is the smallest chunk there is.
CHUNK_BYTES = 128 << 20
CHUNK_SHARE = 8


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
) -> torch.Tensor:
    """Logprob of each token of `input_ids` under `logits` ([B, L, V], causal), aligned with
    `input_ids`: position t is log p(input_ids[t] | input_ids[:t]); position 0 is 0.

    p is the distribution the sampler draws from: softmax(logits / temperature), restricted to
    the top-k tokens and then to the top-p nucleus (vLLM's order) and renormalised, with vLLM's
    rule at the boundary (see `_Sampler`). Pass the sampling parameters the rollouts used, so
    that these logprobs and vLLM's processed logprobs describe the same policy. A token outside
    the trainer's own nucleus gets -inf (probability 0 under the truncated policy): its
    importance ratio is 0 and it gets no gradient.

    Computed as the chosen logit minus a logsumexp, in chunks of rows, by a custom autograd
    function that keeps only `logits` and one float per position for backward and recomputes the
    softmax there: no [B, L, V] float32 log_softmax is ever built (tens of GB at a 152k
    vocabulary). Each chunk works in place on one float32 copy of its rows (plus, with top-p, a
    sort; with top-k alone, a `topk` of at most half a row, counted in the chunk's size), so the
    extra memory of forward and of backward (the gradient of `logits` itself, which backward
    must return, aside) is at most min(`CHUNK_BYTES`, the logits' size / `CHUNK_SHARE`), or one
    row's worth when that is more.
    """
    check_sampling(temperature=temperature, top_p=top_p, top_k=top_k)
    b, length, vocab = logits.shape
    # Row t predicts token t + 1; the last row predicts nothing (target 0, result dropped).
    # Using every row keeps `logits` a view in the graph: slicing off the last row would make
    # autograd allocate a second full-size gradient to pad it back.
    targets = torch.nn.functional.pad(input_ids[:, 1:], (0, 1)).reshape(-1)
    sampler = _Sampler(temperature, top_p, top_k)
    picked: torch.Tensor = _ChosenLogprob.apply(  # type: ignore[no-untyped-call]
        logits.reshape(b * length, vocab), targets, sampler, _chunk_rows(logits, sampler)
    )
    return torch.nn.functional.pad(picked.view(b, length)[:, :-1], (1, 0))


def check_sampling(*, temperature: float, top_p: float, top_k: int | None) -> None:
    """Raise a ValueError that says what to change if these sampling parameters describe no
    distribution (shared by `token_logprobs` and `LossConfig`)."""
    if not 0 < temperature < math.inf:  # NaN too: it would make every logprob NaN
        raise ValueError(
            f"temperature={temperature}: must be a finite number > 0 (greedy has no logprobs)"
        )
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: must be in (0, 1]")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}: use None to disable or a value >= 1")


def _chunk_rows(logits: torch.Tensor, sampler: _Sampler) -> int:
    """Rows per chunk: their temporaries within min(CHUNK_BYTES, the logits' size /
    CHUNK_SHARE), at least one row."""
    budget = min(CHUNK_BYTES, logits.numel() * logits.element_size() // CHUNK_SHARE)
    return max(1, budget // sampler.bytes_per_row(logits.shape[-1], logits.dtype))


class _Sampler(msgspec.Struct, frozen=True):
    """vLLM's transformation of the logits (temperature, then top-k, then top-p), the way its
    PyTorch sampler does it (`apply_top_k_top_p_pytorch`, the path of the CPU wheel), down to
    the order of the floating-point operations, so that the kept set is the same token for
    token: top-k keeps every logit >= the k-th largest (ties with it included); top-p sorts the
    logits ascending with the same (unstable) `sort` and removes the *prefix* of sorted
    positions whose float32 cumulative probability is <= 1 - top_p (1 - top_p taken in float32
    too), always keeping the last. A value tied across that boundary is thus partly removed and
    partly kept, by sort position: bf16 logits tie in dozens of tokens at a large vocabulary,
    and keeping the whole tie (a threshold on the value) gave a larger normaliser than vLLM's
    and ratios biased below 1. On GPUs vLLM samples with a Triton kernel (or FlashInfer), which
    picks the set by other algorithms: there a tie at the boundary may be split differently.
    """

    temperature: float
    top_p: float
    top_k: int | None

    def dtype(self, logits_dtype: torch.dtype) -> torch.dtype:
        """float32, as vLLM samples in; float64 stays (gradcheck)."""
        return torch.promote_types(logits_dtype, torch.float32)

    def bytes_per_row(self, vocab: int, logits_dtype: torch.dtype) -> int:
        """Bytes `kept` allocates per row at its peak: the copy it returns; with top-p the
        sorted values, their int64 order, their cumulative probabilities and a bool mask; with
        top-k alone the values and int64 indices `topk` returns for the threshold (of
        `_threshold_count` entries) and a bool mask."""
        size = self.dtype(logits_dtype).itemsize
        if self.top_p < 1:
            return vocab * (3 * size + 8 + 1)
        count = self._threshold_count(vocab)
        return vocab * size + (count * (size + 8) + vocab if count else 0)

    def _threshold_count(self, vocab: int) -> int:
        """How many entries `topk` must return to find the k-th largest logit: k from the top
        or vocab - k + 1 from the bottom, whichever is fewer (the same order statistic, ties
        included); 0 when top-k keeps every token."""
        if self.top_k is None or self.top_k >= vocab:
            return 0
        return min(self.top_k, vocab - self.top_k + 1)

    def kept(self, logits: torch.Tensor) -> torch.Tensor:
        """A new tensor of the sampling distribution's logits, -inf outside the kept tokens
        (the caller may overwrite it)."""
        x = logits.to(self.dtype(logits.dtype), copy=True)
        if self.temperature != 1.0:
            x.div_(self.temperature)
        vocab = x.shape[-1]
        k = min(self.top_k, vocab) if self.top_k is not None else None
        if self.top_p >= 1:
            count = self._threshold_count(vocab)
            if count:
                x.masked_fill_(x < _kth_largest(x, self.top_k or vocab, count), float("-inf"))
            return x
        ascending, order = x.sort(dim=-1, descending=False)
        if k is not None:
            ascending.masked_fill_(ascending < ascending[:, vocab - k, None], float("-inf"))
        cumulative = ascending.softmax(dim=-1)
        torch.cumsum(cumulative, dim=-1, out=cumulative)
        removed = cumulative <= float(np.float32(1) - np.float32(self.top_p))
        del cumulative
        removed[:, -1] = False
        return x.scatter_(-1, order, ascending.masked_fill_(removed, float("-inf")))


def _kth_largest(x: torch.Tensor, k: int, count: int) -> torch.Tensor:
    """The k-th largest value of each row of `x`, as a column, through a `topk` of `count`
    entries (`_Sampler._threshold_count`); only the column outlives the call."""
    if count == k:
        return x.topk(k, dim=-1).values[:, -1:].clone()
    return x.topk(count, dim=-1, largest=False).values[:, -1:].clone()


class _ChosenLogprob(torch.autograd.Function):
    """log p(target) per row of [N, V] logits, chunked over rows, softmax recomputed in backward."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, sampler: _Sampler, rows: int
    ) -> torch.Tensor:
        dtype = sampler.dtype(logits.dtype)
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        lse = torch.empty_like(out)
        for start in range(0, logits.shape[0], rows):
            stop = start + rows
            out[start:stop], lse[start:stop] = _chunk_logprob(
                sampler, logits[start:stop], targets[start:stop]
            )
        ctx.save_for_backward(logits, targets, lse, out.isneginf())
        ctx.sampler, ctx.rows = sampler, rows
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, targets, lse, outside = ctx.saved_tensors
        sampler: _Sampler = ctx.sampler
        # d log p(y) / d logit_j = (1[j = y] - p_j) / T over the kept tokens, 0 elsewhere; a
        # target outside the kept set has the constant logprob -inf, hence no gradient.
        scale = grad.masked_fill(outside, 0.0) / sampler.temperature
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            stop = start + ctx.rows
            grad_logits[start:stop] = _chunk_gradient(
                sampler, logits[start:stop], targets[start:stop], lse[start:stop], scale[start:stop]
            )
        return grad_logits, None, None, None


# One chunk each, in functions of their own: their temporaries die on return, before the next
# chunk's are allocated (a loop variable would keep the previous chunk alive beside it).


def _chunk_logprob(
    sampler: _Sampler, logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), logsumexp) per row, the logsumexp in place on the chunk's one copy."""
    x = sampler.kept(logits)
    chosen = x.gather(-1, targets[:, None]).squeeze(-1)
    peak = x.amax(dim=-1, keepdim=True)  # finite: the largest logit is always kept
    lse = x.sub_(peak).exp_().sum(dim=-1).log_().add_(peak.squeeze(-1))
    return chosen - lse, lse


def _chunk_gradient(
    sampler: _Sampler,
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """scale * (1[j = target] - p_j) per row, in place on the chunk's one copy."""
    g = sampler.kept(logits).sub_(lse[:, None]).exp_().neg_()
    g.scatter_add_(-1, targets[:, None], torch.ones_like(g[:, :1]))
    return g.mul_(scale[:, None])


class Correction(msgspec.Struct, frozen=True, kw_only=True):
    """Off-policy correction of `policy_loss`: decoupled PPO with a behaviour weight.

    With rho_t = pi_prox(t) / mu(t) (proximal over behaviour policy), each trained token's PPO
    term is clipped around pi_prox and weighted by

        w_t = min(rho_t, truncate)                  (rho_t itself when truncate is None)
              * [low <= rho_t <= high]              (token_band; IcePop-style masked IS)
              * [low <= geomean_s(rho_s) <= high]   (sequence_band; over the sample's tokens)
              * [pi_prox(t) > 0]                    (always; see `behaviour_weights`)

    `Correction()` is plain decoupled PPO (AReaL): unbiased but unbounded weights. `truncate`
    is token-level truncated IS (TIS): it bounds the variance and biases only the tokens above
    the cap, which still get a gradient. `token_band` drops tokens whose weight is implausible
    (also the ones far *below* 1, which TIS keeps), trading some data for a weight that always
    lies in the band. `sequence_band` judges a whole sample by the geometric mean of its ratios
    (a length-independent mean log-ratio) and drops samples that drifted as a whole, such as
    partial rollouts resumed across several weight updates. The options combine. Masked tokens
    stay in the loss's denominator, so masking lowers the step size rather than raising the
    other tokens' weight.
    """

    truncate: float | None = None
    token_band: tuple[float, float] | None = None
    sequence_band: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.truncate is not None and not self.truncate > 0:
            raise ValueError(f"truncate={self.truncate}: must be > 0 (None: no truncation)")
        for name in ("token_band", "sequence_band"):
            band = getattr(self, name)
            if band is not None and not 0 <= band[0] <= 1 <= band[1]:
                raise ValueError(f"{name}={band}: need 0 <= low <= 1 <= high")


CORRECTIONS: dict[str, Correction | None] = {
    "none": None,  # PPO clipped against the behaviour policy (no correction)
    "decoupled": Correction(),
    "tis": Correction(truncate=2.0),
    "mask": Correction(token_band=(0.5, 2.0)),
    "seq-mask": Correction(truncate=2.0, sequence_band=(0.5, 2.0)),
}
"""Named presets (the demo's `--correction`); docs/off-policy.md says which to pick when."""


class BehaviourWeights(msgspec.Struct, frozen=True, kw_only=True):
    """Per-token results of a `Correction` ([B, L], all False / 0 off the loss mask)."""

    ratio: torch.Tensor  # rho = pi_prox / mu on trained tokens, 1 elsewhere
    weight: torch.Tensor  # w, 0 where masked and off the loss mask
    truncated: torch.Tensor  # bool: the cap lowered the weight
    masked: torch.Tensor  # bool: dropped by the token or the sequence band, or outside
    outside: torch.Tensor  # bool: outside the trainer's top-k/top-p set (pi_prox = 0, rho = 0)


def behaviour_weights(
    proximal_logprobs: torch.Tensor, batch: TrainBatch, correction: Correction
) -> BehaviourWeights:
    """The behaviour weights of `correction` (see `Correction`), without gradient.

    A token outside the trainer's top-k/top-p set (proximal logprob -inf: the proximal policy
    cannot sample it, typically a token near the boundary that the staleness moved out) has
    rho exactly 0. It is dropped on its own: masked, weight 0, whatever the correction. It is
    left out of its sample's geometric mean, which judges how far the sample drifted as a
    whole: log 0 = -inf would make that mean 0 and drop every token of the sample for one
    boundary token."""
    mask = batch.loss_mask
    outside = proximal_logprobs.detach().isneginf() & mask
    inside = mask & ~outside
    log_ratio = (proximal_logprobs.detach() - batch.old_logprobs).masked_fill(~inside, 0.0)
    ratio = log_ratio.exp().masked_fill(outside, 0.0)
    weight = ratio
    truncated = torch.zeros_like(mask)
    if correction.truncate is not None:
        truncated = (ratio > correction.truncate) & mask
        weight = ratio.clamp(max=correction.truncate)
    masked = torch.zeros_like(mask)
    if correction.token_band is not None:
        low, high = correction.token_band
        masked |= (ratio < low) | (ratio > high)
    if correction.sequence_band is not None:
        low, high = correction.sequence_band
        geomean = (log_ratio.sum(-1) / inside.sum(-1).clamp(min=1)).exp()
        masked |= ((geomean < low) | (geomean > high))[:, None]
    masked = (masked & mask) | outside
    return BehaviourWeights(
        ratio=ratio,
        weight=weight.masked_fill(masked | ~mask, 0.0),
        truncated=truncated & ~masked,
        masked=masked,
        outside=outside,
    )


Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
"""How `policy_loss` turns per-token terms into one loss (verl's `loss_agg_mode` names):

- "token-mean": sum over all trained tokens / trained tokens (each token weighs the same; a
  long sample weighs more than a short one);
- "seq-mean-token-mean": mean over samples of each sample's mean over its trained tokens (each
  sample weighs the same: GRPO's original 1/|o_i|);
- "seq-mean-token-sum-norm": sum over all trained tokens / (samples x `norm_length`), a
  constant per sample such as max_new_tokens (Dr. GRPO: no length bias, and a token's weight
  does not change with the other samples' lengths).
"""
AGGREGATIONS: tuple[Aggregation, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KlEstimator = Literal["k1", "k3"]
"""Per-token estimators of KL(pi || pi_ref) on tokens sampled from pi (Schulman's names):
k1 = log pi - log pi_ref; k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1 (never
negative, unbiased; GRPO's "low_var_kl")."""


class LossNorm(msgspec.Struct, frozen=True, kw_only=True):
    """The whole batch's denominators, so that the loss of a slice of it (a micro-batch, a
    rank's shard) is that slice's exact share of the whole batch's loss: the sum of the slices'
    losses is the whole batch's loss, and so is the sum of their gradients, whatever the
    slicing. Without it a micro-batch would divide by its own token count, and gradient
    accumulation would weigh a token of a short micro-batch more than one of a long one.

    `tokens`: trained tokens (`loss_mask`) of the whole batch; `samples`: its samples (rows of
    `to_batch`, not counting the padding rows a split adds)."""

    tokens: int
    samples: int

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.samples < 0:
            raise ValueError(f"{self}: counts must be >= 0")

    @classmethod
    def of(cls, batch: TrainBatch) -> LossNorm:
        """The denominators of `batch` itself (what `policy_loss` uses without `norm`)."""
        return cls(tokens=batch.num_tokens, samples=int(batch.input_ids.shape[0]))


def check_loss_settings(
    *,
    clip: float,
    clip_high: float | None,
    aggregation: str,
    norm_length: int | None,
    kl_coef: float,
    kl_estimator: str,
) -> None:
    """Raise a ValueError that says what to change if these `policy_loss` settings make no
    loss (shared by `policy_loss` and `LossConfig`, which checks them at construction)."""
    if not clip >= 0:  # NaN too: it would make the loss NaN
        raise ValueError(f"clip={clip}: must be >= 0 (the PPO clip range, e.g. 0.2)")
    if clip_high is not None and not clip_high >= 0:
        raise ValueError(
            f"clip_high={clip_high}: must be >= 0 (DAPO's upper clip range, e.g. 0.28; "
            "None: the same as clip)"
        )
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}: use one of {', '.join(AGGREGATIONS)}")
    if aggregation == "seq-mean-token-sum-norm":
        if norm_length is None or not norm_length >= 1:
            raise ValueError(
                f"norm_length={norm_length}: 'seq-mean-token-sum-norm' divides each sample's "
                "token sum by this constant: give it, e.g. the sampling's max_new_tokens"
            )
    elif norm_length is not None:
        raise ValueError(
            f"norm_length={norm_length} is used only with 'seq-mean-token-sum-norm' "
            f"(aggregation={aggregation!r}): drop it"
        )
    if not 0 <= kl_coef < math.inf:
        raise ValueError(f"kl_coef={kl_coef}: must be a finite number >= 0 (0: no KL penalty)")
    if kl_estimator not in ("k1", "k3"):
        raise ValueError(f"kl_estimator={kl_estimator!r}: use 'k1' or 'k3'")


def policy_loss(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    clip: float = 0.2,
    clip_high: float | None = None,
    correction: Correction | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KlEstimator = "k3",
    aggregation: Aggregation = "token-mean",
    norm_length: int | None = None,
    norm: LossNorm | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss with per-sample advantages, as GRPO uses it; by default averaged over
    trained tokens.

    Without `correction`: the ratio pi / mu is taken against the behaviour logprobs recorded at
    generation, as plain PPO does; with stale tokens its clip then stops the gradient of every
    token the *earlier* updates already moved past 1 +- clip, whatever this update does.

    With `correction` (see `Correction`): decoupled PPO. The ratio is pi / pi_prox, clipped
    around the proximal policy given as `proximal_logprobs` (the trainer's logprobs of the batch
    before this update, from `proximal_logprobs()`; with one optimizer step per batch that is
    just `logprobs.detach()`), and each token is weighted by its behaviour weight.

    The ratio is clamped to [1 - clip, 1 + clip_high] (`clip_high` None: clip; DAPO's
    clip-higher uses 0.28 over 0.2, so that unlikely tokens can grow). Per trained token t of
    sample s the term is

        l_t = -w_t * min(r_t A_s, clamp(r_t, 1 - clip, 1 + clip_high) A_s) + kl_coef * kl_t

    with kl_t the `kl_estimator` of KL(pi || pi_ref) from `ref_logprobs` (the reference
    policy's logprobs of the batch, as `token_logprobs` gives them; needed when kl_coef > 0).
    The KL term is not weighted by the behaviour weight, and a token whose logprob or reference
    logprob is -inf (outside a top-k/top-p set) has none. `aggregation` (see `Aggregation`)
    sums the terms into the loss, with the denominators of `norm` (`LossNorm.of(batch)` when
    None): give a slice of a batch the whole batch's `norm`, and the slices' losses and
    gradients add up to the whole batch's.

    Stats (each additive over slices that share a `norm`: shares of the whole batch's trained
    tokens): `loss`; `clip_fraction`, the share of trained tokens whose clipped branch wins the
    PPO min (the ones whose gradient the clip stops), split into `clip_fraction_high` (ratio
    above 1 + clip_high, positive advantage) and `clip_fraction_low`; `ratio_mean`; with a
    reference, `kl` (the estimator's mean over trained tokens).
    """
    check_loss_settings(
        clip=clip,
        clip_high=clip_high,
        aggregation=aggregation,
        norm_length=norm_length,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
    )
    loss, stats = loss_terms(
        logprobs,
        batch,
        clip=clip,
        clip_high=clip_high,
        correction=correction,
        proximal_logprobs=proximal_logprobs,
        ref_logprobs=ref_logprobs,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        aggregation=aggregation,
        norm_length=norm_length,
        norm=norm,
    )
    return loss, {name: float(value) for name, value in stats.items()}


def loss_terms(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    clip: float,
    clip_high: float | None,
    correction: Correction | None,
    proximal_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    kl_coef: float,
    kl_estimator: KlEstimator,
    aggregation: Aggregation,
    norm_length: int | None,
    norm: LossNorm | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss` with its stats as 0-dim tensors on the batch's device (no host sync per
    micro-batch: `train_step` sums them and reads them once); settings already checked."""
    mask = batch.loss_mask
    weight: torch.Tensor | None = None
    anchor = batch.old_logprobs
    if correction is not None:
        if proximal_logprobs is None:
            raise ValueError(
                "a correction needs proximal_logprobs (logprobs.detach() when one step)"
            )
        anchor = proximal_logprobs.detach()
        weight = behaviour_weights(anchor, batch, correction).weight
    elif proximal_logprobs is not None:
        raise ValueError("proximal_logprobs is used only with a correction")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs (the reference's logprobs)")
    # A token outside the anchor's nucleus (proximal logprob -inf; behaviour logprobs are
    # finite) has behaviour weight 0, and a ratio to it of exp(-inf - -inf) = NaN: taken as 1,
    # so that the weight zeroes its term instead of 0 * NaN making the whole loss NaN.
    ratio = (logprobs - anchor).masked_fill(~mask | anchor.isneginf(), 0.0).exp()
    adv = batch.advantages[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip, 1 + (clip if clip_high is None else clip_high)) * adv
    surrogate = torch.minimum(unclipped, clipped)
    if weight is not None:
        surrogate = weight * surrogate
    kl: torch.Tensor | None = None
    if ref_logprobs is not None:
        kl = _kl(logprobs, ref_logprobs.detach(), mask, kl_estimator)
    norm = norm or LossNorm.of(batch)
    n = max(norm.tokens, 1)  # a Python number: a device tensor would sync per micro-batch
    per_token = -surrogate  # negation is exact: the default loss keeps its bits
    if kl is not None and kl_coef:
        per_token = per_token + kl_coef * kl
    loss = _aggregate(per_token * mask, mask, n, aggregation, norm, norm_length)
    with torch.no_grad():
        wins = (clipped < unclipped) & mask
        stats = {
            "loss": loss.detach(),
            "clip_fraction": wins.sum() / n,
            "clip_fraction_high": (wins & (adv > 0)).sum() / n,
            "clip_fraction_low": (wins & (adv < 0)).sum() / n,
            "ratio_mean": (ratio * mask).sum() / n,
        }
        if kl is not None:
            stats["kl"] = (kl * mask).sum() / n
    return loss, stats


def _kl(
    logprobs: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, estimator: KlEstimator
) -> torch.Tensor:
    """Per-token KL estimate, 0 off the mask and where either logprob is -inf. The difference
    is masked *before* `exp`: masking after would leave exp(inf) in the graph, and its backward
    0 * inf = NaN."""
    inside = mask & logprobs.detach().isfinite() & ref.isfinite()
    log_ratio = (ref - logprobs).masked_fill(~inside, 0.0)  # log pi_ref / pi
    if estimator == "k1":
        return -log_ratio
    return log_ratio.exp() - log_ratio - 1


def _aggregate(
    terms: torch.Tensor,
    mask: torch.Tensor,
    tokens: int,
    aggregation: Aggregation,
    norm: LossNorm,
    norm_length: int | None,
) -> torch.Tensor:
    """The loss of per-token `terms` ([B, L], 0 off the mask) under `aggregation`, divided by
    the whole batch's `norm` (`tokens`: its token count, at least 1); a sample's
    own token count is its own, since a split never cuts a row."""
    if aggregation == "token-mean":
        return terms.sum() / tokens
    samples = max(norm.samples, 1)
    if aggregation == "seq-mean-token-mean":
        return (terms.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / samples
    assert norm_length is not None  # checked by check_loss_settings
    return terms.sum() / (samples * norm_length)


def proximal_logprobs(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batch: TrainBatch,
    *,
    micro_batch: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
) -> torch.Tensor:
    """The trainer's logprobs of `batch` under its current weights, without gradient: the
    proximal policy of decoupled PPO when one batch is trained with several optimizer steps
    (call it before the first). `forward(input_ids, attention_mask)` returns the logits;
    `micro_batch` rows at a time bound the activations."""
    if micro_batch is not None and micro_batch < 1:
        raise ValueError(f"micro_batch={micro_batch}: must be >= 1 rows (None: the whole batch)")
    step = micro_batch or batch.input_ids.shape[0]
    parts = []
    with torch.no_grad():
        for start in range(0, batch.input_ids.shape[0], step):
            ids = batch.input_ids[start : start + step]
            logits = forward(ids, batch.attention_mask[start : start + step])
            parts.append(
                token_logprobs(logits, ids, temperature=temperature, top_p=top_p, top_k=top_k)
            )
    return torch.cat(parts)


def mismatch_metrics(
    proximal_logprobs: torch.Tensor,
    batch: TrainBatch,
    *,
    version: int,
    correction: Correction | None = None,
    prefix: str = "offpolicy/",
) -> dict[str, float]:
    """How far the behaviour policy is from the trainer's, as a flat `{name: number}` dict (like
    `ProduceBatchResult.metrics`), over all trained tokens and per staleness
    (`{prefix}staleness_<s>/...`, s = `version` - the token's version):

    - `kl`: KL(mu || pi_prox) estimated from the tokens (sampled from mu) with the k3 estimator
      mean(rho - 1 - log rho), unbiased and never negative, over the tokens inside the
      trainer's top-k/top-p set (NaN if there are none);
    - `outside_share`: the share of tokens outside that set (rho = 0). The true KL is infinite
      as soon as mu samples a token pi_prox cannot; one such token made the k3 mean inf and
      hid everything else, so the two are reported apart;
    - `ratio_p05`, `ratio_p50`, `ratio_p95`: percentiles of rho = pi_prox / mu (0 outside);
    - `tokens`: how many trained tokens;
    - with a `correction`: `masked_share` (tokens outside the set included) and
      `truncated_share` of the tokens.

    `version` is the policy version of the weights that computed `proximal_logprobs`.
    """
    mask = batch.loss_mask
    weights = behaviour_weights(proximal_logprobs, batch, correction or Correction())
    staleness = (version - batch.versions.long())[mask]
    out: dict[str, float] = {}
    groups = [("", torch.ones_like(staleness, dtype=torch.bool))]
    groups += [(f"staleness_{s}/", staleness == s) for s in sorted(set(staleness.tolist()))]
    for name, rows in groups:
        rho = weights.ratio[mask][rows].double()
        if not rho.numel():
            continue
        outside = weights.outside[mask][rows]
        inside = rho[~outside]
        p05, p50, p95 = np.percentile(rho.cpu().numpy(), [5, 50, 95]).tolist()
        out |= {
            f"{prefix}{name}tokens": float(rho.numel()),
            f"{prefix}{name}kl": float((inside - 1 - inside.log()).mean()),
            f"{prefix}{name}outside_share": float(outside.double().mean()),
            f"{prefix}{name}ratio_p05": p05,
            f"{prefix}{name}ratio_p50": p50,
            f"{prefix}{name}ratio_p95": p95,
        }
        if correction is not None:
            out[f"{prefix}{name}masked_share"] = float(weights.masked[mask][rows].double().mean())
            out[f"{prefix}{name}truncated_share"] = float(
                weights.truncated[mask][rows].double().mean()
            )
    return out
