import math
import warnings
import weakref

import msgspec
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncroll.codec import decode, encode
from asyncroll.train import (
    CORRECTIONS,
    Correction,
    TrainBatch,
    behaviour_weights,
    group_advantages,
    mismatch_metrics,
    policy_loss,
    proximal_logprobs,
    to_batch,
    token_logprobs,
)
from asyncroll.train.loss import CHUNK_BYTES
from tests.factories import make_group


def scored(uid: int, rewards: list[float], tokens: int = 3, version: int = 0):  # type: ignore[no-untyped-def]
    import msgspec

    g = make_group(uid, samples=len(rewards), tokens=tokens, version=version)
    samples = tuple(
        msgspec.structs.replace(s, reward=r) for s, r in zip(g.samples, rewards, strict=True)
    )
    return msgspec.structs.replace(g, samples=samples)


def test_advantages() -> None:
    r = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    grpo = group_advantages(r, "grpo")
    assert np.allclose(grpo[0], [1, -1, -1, 1], atol=1e-5) and np.allclose(grpo[1], 0)
    rloo = group_advantages(r, "rloo")
    # leave-one-out: r_i - mean of the other three
    assert np.allclose(rloo[0], [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3])
    assert np.array_equal(group_advantages(r, "none"), r)
    with pytest.raises(ValueError, match="rloo needs"):
        group_advantages(np.ones((1, 1)), "rloo")


def test_grpo_divides_by_the_population_std_unless_told_the_samples() -> None:
    """Population std (numpy's default, ddof 0) unless `std="sample"` (ddof 1, what TRL and
    verl divide by): the two differ by sqrt(n / (n - 1)), 1.15 for groups of 4."""
    r = np.array([[1.0, 0.0, 0.0, 0.0]])
    centered = r - 0.25
    assert np.allclose(group_advantages(r, "grpo"), centered / (np.std(r) + 1e-6))
    sample = group_advantages(r, "grpo", std="sample")
    assert np.allclose(sample, centered / (np.std(r, ddof=1) + 1e-6))
    assert to_batch([scored(0, [1.0, 0.0, 0.0, 0.0])], std="sample").advantages.numpy() == (
        pytest.approx(sample.ravel())
    )
    with pytest.raises(ValueError, match="std='sample' needs at least 2 samples"):
        group_advantages(np.ones((3, 1)), "grpo", std="sample")
    with pytest.raises(ValueError, match="std='bessel'"):
        group_advantages(r, "grpo", std="bessel")  # type: ignore[arg-type]


@pytest.mark.parametrize("eps", [0.0, -0.5, math.nan])
def test_grpo_refuses_an_eps_that_lets_equal_rewards_divide_by_zero(eps: float) -> None:
    equal = np.array([[1.0, 1.0], [1.0, 0.0]])  # std 0: eps=0 made NaN, eps=-0.5 made inf
    with pytest.raises(ValueError, match=f"eps={eps}"):
        group_advantages(equal, "grpo", eps=eps)


def test_to_batch_layout_is_aligned_with_input_ids() -> None:
    a, b = scored(0, [1.0, 0.0], tokens=3, version=2), scored(1, [0.5, 0.5], tokens=5)
    batch = to_batch([a, b], pad_id=7)
    assert batch.input_ids.shape == (4, 3 + 5)
    row = 0
    p = len(a.prompt_tokens)
    s = a.samples[0]
    assert batch.input_ids[row, :p].tolist() == a.prompt_tokens.tolist()
    assert batch.input_ids[row, p : p + 3].tolist() == s.tokens.tolist()
    assert batch.input_ids[row, p + 3 :].tolist() == [7] * 2
    assert batch.loss_mask[row].tolist() == [False] * p + [True] * 3 + [False] * 2
    assert batch.attention_mask[row].sum() == p + 3
    assert torch.equal(batch.old_logprobs[row, p : p + 3], torch.from_numpy(s.logprobs))
    assert batch.versions[row, p : p + 3].tolist() == [2, 2, 2]
    assert batch.versions[row, :p].tolist() == [-1] * p
    assert batch.group_index.tolist() == [0, 0, 1, 1]
    assert batch.advantages[2:].abs().max() < 1e-3  # equal rewards: zero advantage
    assert batch.num_tokens == 2 * 3 + 2 * 5


def test_to_batch_reads_decoded_read_only_arrays_without_warnings() -> None:
    group = decode(encode(scored(0, [1.0, 0.0])))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = to_batch([group])
    batch.input_ids[0, 0] = 5  # the tensors own their padded memory: writable, not aliased
    assert group.prompt_tokens[0] == 0


def test_to_batch_refuses_unscored_or_ragged_groups() -> None:
    with pytest.raises(ValueError, match="no reward"):
        to_batch([_unscored()])
    with pytest.raises(ValueError, match="one size"):
        to_batch([scored(0, [1.0, 0.0]), scored(1, [1.0, 0.0, 1.0])])
    with pytest.raises(ValueError, match="finite rewards"):  # its advantages would be NaN
        to_batch([scored(0, [math.inf, 0.0])])


def _unscored():  # type: ignore[no-untyped-def]
    import msgspec

    g = make_group(samples=2)
    return msgspec.structs.replace(
        g, samples=tuple(msgspec.structs.replace(s, reward=None) for s in g.samples)
    )


def test_token_logprobs_alignment() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    out = token_logprobs(logits, ids)
    assert out.shape == (2, 5) and (out[:, 0] == 0).all()
    expected = torch.log_softmax(logits[1, 2], -1)[ids[1, 3]]
    assert torch.isclose(out[1, 3], expected)


def test_policy_loss_on_policy_is_minus_mean_advantage_and_pushes_the_right_way() -> None:
    batch = to_batch([scored(0, [1.0, 0.0], tokens=4)])
    logp = batch.old_logprobs.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, batch)
    mask = batch.loss_mask
    expected = -(batch.advantages[:, None].expand_as(mask)[mask]).mean()
    assert torch.isclose(loss, expected, atol=1e-6)
    assert stats["clip_fraction"] == 0 and abs(stats["ratio_mean"] - 1) < 1e-6
    loss.backward()
    assert logp.grad is not None
    # gradient descent raises the logprobs of the better sample, lowers the worse one's
    assert (logp.grad[0][mask[0]] < 0).all() and (logp.grad[1][mask[1]] > 0).all()


def test_clip_fraction_counts_only_tokens_whose_clipped_branch_wins() -> None:
    """Ratio e on every token: for A > 0 the clipped branch (1.2 A) wins, for A < 0 the
    unclipped one (e A < 1.2 A) does, so only the positive row counts, though both rows lie
    outside the band."""
    batch = to_batch([scored(0, [1.0, 0.0], tokens=4)])
    logp = batch.old_logprobs + 1.0 * batch.loss_mask
    loss, stats = policy_loss(logp, batch, clip=0.2)
    assert stats["clip_fraction"] == 0.5
    a = float(batch.advantages[0])  # GRPO of [1, 0]: +a, -a
    assert torch.isclose(loss, torch.tensor(-(1.2 * a - math.e * a) / 2), atol=1e-5)


def hand_batch(old: list[list[float]], adv: list[float], versions: int = 0) -> TrainBatch:
    """A batch of len(old) rows of response tokens only (no prompt), to check the loss by hand."""
    b, length = len(old), len(old[0])
    return TrainBatch(
        input_ids=torch.zeros(b, length, dtype=torch.int64),
        attention_mask=torch.ones(b, length, dtype=torch.bool),
        loss_mask=torch.ones(b, length, dtype=torch.bool),
        old_logprobs=torch.tensor(old, dtype=torch.float64),
        versions=torch.full((b, length), versions, dtype=torch.int32),
        advantages=torch.tensor(adv, dtype=torch.float64),
        rewards=torch.zeros(b, dtype=torch.float64),
        group_index=torch.zeros(b, dtype=torch.int64),
    )


LN = math.log
# Behaviour ratios rho = pi_prox / mu per token: rows are samples, all logprobs relative to 0.
RHO = [[0.25, 1.0, 3.0], [1.5, 0.8, 1.0]]
ADV = [1.0, -2.0]


def proximal_and_batch() -> tuple[torch.Tensor, TrainBatch]:
    prox = torch.full((2, 3), -1.0, dtype=torch.float64)
    old = [[-1.0 - LN(r) for r in row] for row in RHO]
    return prox, hand_batch(old, ADV)


@pytest.mark.parametrize(
    ("correction", "weights"),
    [
        (Correction(), RHO),  # decoupled PPO: w = rho
        (Correction(truncate=2.0), [[0.25, 1.0, 2.0], [1.5, 0.8, 1.0]]),  # TIS: min(rho, 2)
        (Correction(token_band=(0.5, 2.0)), [[0.0, 1.0, 0.0], [1.5, 0.8, 1.0]]),  # IcePop
        # geometric means: row 0 (0.25 * 1 * 3)^(1/3) = 0.909, row 1 (1.2)^(1/3) = 1.063
        (Correction(sequence_band=(0.95, 2.0)), [[0.0, 0.0, 0.0], [1.5, 0.8, 1.0]]),
        (Correction(sequence_band=(0.9, 1.05)), [[0.25, 1.0, 3.0], [0.0, 0.0, 0.0]]),
        (Correction(truncate=1.2, sequence_band=(0.9, 2.0)), [[0.25, 1.0, 1.2], [1.2, 0.8, 1.0]]),
    ],
)
def test_behaviour_weights_by_hand(correction: Correction, weights: list[list[float]]) -> None:
    prox, batch = proximal_and_batch()
    w = behaviour_weights(prox, batch, correction)
    assert torch.allclose(w.ratio, torch.tensor(RHO, dtype=torch.float64))
    assert torch.allclose(w.weight, torch.tensor(weights, dtype=torch.float64))
    assert torch.equal(w.masked, w.weight == 0)
    expected_truncated = (w.ratio > (correction.truncate or math.inf)) & ~w.masked
    assert torch.equal(w.truncated, expected_truncated)


@pytest.mark.parametrize("name", [n for n, c in CORRECTIONS.items() if c is not None])
def test_corrected_loss_and_gradient_by_hand(name: str) -> None:
    """With the proximal policy = the current one (one step per batch) every PPO ratio is 1, so
    loss = -mean(w * A) and d loss / d logprob_t = -w_t * A / n_tokens."""
    correction = CORRECTIONS[name]
    assert correction is not None
    prox, batch = proximal_and_batch()
    logp = prox.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, batch, correction=correction, proximal_logprobs=prox)
    w = behaviour_weights(prox, batch, correction).weight
    adv = torch.tensor(ADV, dtype=torch.float64)[:, None]
    assert torch.isclose(loss, -(w * adv).sum() / 6)
    loss.backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    assert torch.allclose(logp.grad, -w * adv / 6)
    assert stats["clip_fraction"] == 0


def test_decoupled_ppo_clips_around_the_proximal_policy() -> None:
    """Trainer moved past the proximal policy by e^0.5 (beyond 1.2): the row with A > 0 is
    clipped (loss -w * 1.2 * A, no gradient), the row with A < 0 is not (-w * e^0.5 * A)."""
    prox, batch = proximal_and_batch()
    correction = Correction()
    logp = (prox + 0.5).requires_grad_(True)
    loss, stats = policy_loss(logp, batch, clip=0.2, correction=correction, proximal_logprobs=prox)
    rho = torch.tensor(RHO, dtype=torch.float64)
    r = math.exp(0.5)
    expected = -(rho[0] * 1.2 * ADV[0]).sum() - (rho[1] * r * ADV[1]).sum()
    assert torch.isclose(loss, expected / 6)
    assert stats["clip_fraction"] == 0.5 and math.isclose(stats["ratio_mean"], r, rel_tol=1e-9)
    loss.backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    assert (logp.grad[0] == 0).all()
    assert torch.allclose(logp.grad[1], -rho[1] * r * ADV[1] / 6)


def test_uncorrected_loss_clips_against_the_behaviour_policy() -> None:
    """Without correction the ratio is pi / mu: the stale tokens' ratios (RHO) are clipped as if
    this update had moved them. With A > 0 the token at rho 3 is clipped (1.2 A wins the min: no
    gradient); with A < 0 rho 1.5 is not (1.5 A < 1.2 A), so it keeps its full gradient."""
    prox, batch = proximal_and_batch()
    logp = prox.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, batch, clip=0.2)
    terms = [min(r, 1.2) * ADV[0] for r in RHO[0]]  # A > 0: min(r A, clip(r) A)
    terms += [max(r, 0.8) * ADV[1] for r in RHO[1]]  # A < 0
    assert math.isclose(float(loss.detach()), -sum(terms) / 6, rel_tol=1e-9)
    assert stats["clip_fraction"] == pytest.approx(1 / 6)
    loss.backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    assert logp.grad[0, 2] == 0
    assert torch.allclose(logp.grad[1, 0], torch.tensor(-1.5 * ADV[1] / 6, dtype=torch.float64))


def test_policy_loss_refuses_a_missing_or_unused_proximal_policy() -> None:
    prox, batch = proximal_and_batch()
    with pytest.raises(ValueError, match="needs proximal_logprobs"):
        policy_loss(prox, batch, correction=Correction())
    with pytest.raises(ValueError, match="only with a correction"):
        policy_loss(prox, batch, proximal_logprobs=prox)
    with pytest.raises(ValueError, match="truncate"):
        Correction(truncate=0.0)
    with pytest.raises(ValueError, match="token_band"):
        Correction(token_band=(1.5, 2.0))


@pytest.mark.parametrize("clip", [-0.2, math.nan])
def test_policy_loss_refuses_a_clip_range_that_is_not_one(clip: float) -> None:
    prox, batch = proximal_and_batch()  # a negative clip inverts the range, NaN makes NaN
    with pytest.raises(ValueError, match=f"clip={clip}"):
        policy_loss(prox, batch, clip=clip)


def test_policy_loss_gradcheck_for_every_correction() -> None:
    """Away from the clip's kinks, autograd's gradient of the loss matches finite differences
    (the proximal policy fixed, the trainer moved off it by small random steps)."""
    prox, batch = proximal_and_batch()
    torch.manual_seed(0)
    start = prox + 0.05 * torch.randn_like(prox)
    for correction in CORRECTIONS.values():
        extra = {"proximal_logprobs": prox} if correction is not None else {}

        def loss(
            x: torch.Tensor, c: Correction | None = correction, kw: dict = extra
        ) -> torch.Tensor:  # type: ignore[type-arg]
            return policy_loss(x, batch, correction=c, **kw)[0]

        assert torch.autograd.gradcheck(loss, (start.clone().requires_grad_(True),))


@pytest.mark.parametrize("name", [n for n, c in CORRECTIONS.items() if c is not None])
def test_a_token_outside_the_trainers_nucleus_keeps_a_corrected_loss_finite(name: str) -> None:
    """With top_p < 1 a sampled token can fall outside the trainer's nucleus: logprob -inf,
    in the proximal policy too (`logprobs.detach()` for one step). Its behaviour weight is 0,
    but its ratio to the proximal policy was exp(-inf - -inf) = NaN, and 0 * NaN made the
    whole loss NaN."""
    batch = to_batch([scored(0, [1.0, 0.0], tokens=4)])
    torch.manual_seed(0)
    logits = torch.randn(*batch.input_ids.shape, 100, requires_grad=True)
    logprobs = token_logprobs(logits, batch.input_ids, top_p=0.3)
    outside = logprobs.isneginf() & batch.loss_mask
    assert outside.any() and not outside.all()
    loss, stats = policy_loss(
        logprobs, batch, correction=CORRECTIONS[name], proximal_logprobs=logprobs.detach()
    )
    assert math.isfinite(float(loss.detach())) and all(map(math.isfinite, stats.values()))
    loss.backward()  # type: ignore[no-untyped-call]
    assert logits.grad is not None and logits.grad.isfinite().all()


def outside_the_nucleus() -> tuple[torch.Tensor, TrainBatch]:
    """`proximal_and_batch` with row 1's last token outside the trainer's nucleus (logprob
    -inf): rho exactly 0 there, its other ratios 1.5 and 0.8."""
    prox, batch = proximal_and_batch()
    prox[1, 2] = -math.inf
    return prox, batch


@pytest.mark.parametrize("name", [n for n, c in CORRECTIONS.items() if c is not None])
def test_a_token_outside_the_nucleus_is_dropped_alone(name: str) -> None:
    """Its rho is exactly 0: it gets weight 0 and counts as masked, and it is left out of the
    sample's geometric mean, which judges the sample's drift. In it, log 0 = -inf made the
    geometric mean 0, so `seq-mask` dropped the whole sample for one boundary token."""
    correction = CORRECTIONS[name]
    assert correction is not None
    prox, batch = outside_the_nucleus()
    w = behaviour_weights(prox, batch, correction)
    expected = behaviour_weights(proximal_and_batch()[0], batch, correction).weight
    expected[1, 2] = 0.0
    assert w.ratio[1, 2] == 0 and w.masked[1, 2] and w.outside[1, 2]
    assert int(w.outside.sum()) == 1 and torch.equal(w.masked, w.weight == 0)
    assert torch.allclose(w.weight, expected)  # row 1's other tokens keep their weights


def test_mismatch_metrics_report_tokens_outside_the_nucleus_apart_from_the_kl() -> None:
    """KL(mu || pi_prox) is infinite when mu samples a token pi_prox cannot: the k3 mean was inf
    for the whole batch. It is now the KL over the tokens inside the nucleus, and the share of
    tokens outside it is its own number."""
    prox, batch = outside_the_nucleus()
    m = mismatch_metrics(prox, batch, version=0, correction=CORRECTIONS["seq-mask"])
    inside = np.array([0.25, 1.0, 3.0, 1.5, 0.8])
    assert m["offpolicy/kl"] == pytest.approx(np.mean(inside - 1 - np.log(inside)))
    assert m["offpolicy/outside_share"] == pytest.approx(1 / 6)
    assert m["offpolicy/ratio_p05"] == pytest.approx(np.percentile([*inside, 0.0], 5))
    assert all(map(math.isfinite, m.values()))


def test_mismatch_metrics_by_hand_and_by_staleness() -> None:
    prox, batch = proximal_and_batch()
    batch = msgspec.structs.replace(
        batch, versions=torch.tensor([[3, 3, 3], [2, 2, 3]], dtype=torch.int32)
    )
    m = mismatch_metrics(
        prox, batch, version=3, correction=Correction(truncate=2.0, token_band=(0.5, 4.0))
    )
    rho = np.array(RHO).ravel()
    assert m["offpolicy/tokens"] == 6
    assert m["offpolicy/kl"] == pytest.approx(np.mean(rho - 1 - np.log(rho)))
    assert m["offpolicy/ratio_p50"] == pytest.approx(np.percentile(rho, 50))
    assert m["offpolicy/masked_share"] == pytest.approx(1 / 6)  # 0.25
    assert m["offpolicy/truncated_share"] == pytest.approx(1 / 6)  # 3.0
    fresh = np.array([0.25, 1.0, 3.0, 1.0])
    assert m["offpolicy/staleness_0/tokens"] == 4 and m["offpolicy/staleness_1/tokens"] == 2
    assert m["offpolicy/staleness_0/kl"] == pytest.approx(np.mean(fresh - 1 - np.log(fresh)))
    assert m["offpolicy/staleness_1/ratio_p95"] == pytest.approx(np.percentile([1.5, 0.8], 95))
    assert m["offpolicy/staleness_1/masked_share"] == 0
    plain = mismatch_metrics(prox, batch, version=3)
    assert "offpolicy/masked_share" not in plain and plain["offpolicy/kl"] == m["offpolicy/kl"]


def test_token_logprobs_gradcheck_with_temperature_top_k_top_p() -> None:
    torch.manual_seed(0)
    logits = (2 * torch.randn(2, 5, 9, dtype=torch.float64)).requires_grad_(True)
    ids = torch.randint(0, 9, (2, 5))
    for kwargs in [{}, {"temperature": 0.7}, {"temperature": 0.7, "top_p": 0.9}, {"top_k": 4}]:
        kept = token_logprobs(logits.detach(), ids, **kwargs).isfinite()

        def f(x: torch.Tensor, kw: dict = kwargs, keep: torch.Tensor = kept) -> torch.Tensor:  # type: ignore[type-arg]
            return token_logprobs(x, ids, **kw).masked_fill(~keep, 0.0)

        assert torch.autograd.gradcheck(f, (logits,))


def reference_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, t: float, p: float, k: int | None
) -> torch.Tensor:
    """The sampler written out plainly, the way vLLM's PyTorch path does it: scale, mask below
    the k-th largest, sort, drop the ascending prefix of cumulative probability <= 1 - p (keeping
    the largest), scatter back, log_softmax over the full [B, L, V]."""
    z = logits[:, :-1] / t
    if k is not None:
        z = z.masked_fill(z < z.topk(k, -1).values[..., -1:], float("-inf"))
    if p < 1:
        ordered, index = z.sort(-1)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - p
        drop[..., -1] = False
        z = torch.empty_like(z).scatter_(-1, index, ordered.masked_fill(drop, float("-inf")))
    picked = torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


@pytest.mark.parametrize(
    ("t", "p", "k"),
    # k = 10 of 13 finds its threshold from the bottom (the 4th smallest); k = 13 keeps all
    [(1.0, 1.0, None), (0.7, 0.9, None), (1.3, 0.8, 5), (1.0, 1.0, 3), (1.0, 1.0, 10),
     (0.9, 1.0, 13)],
)  # fmt: skip
def test_token_logprobs_match_the_sampler_written_out(t: float, p: float, k: int | None) -> None:
    torch.manual_seed(1)
    logits = 3 * torch.randn(3, 7, 13, dtype=torch.float64)
    ids = torch.randint(0, 13, (3, 7))
    out = token_logprobs(logits, ids, temperature=t, top_p=p, top_k=k)
    ref = reference_logprobs(logits, ids, t, p, k)
    assert torch.equal(out.isneginf(), ref.isneginf())
    if p < 1 or (k is not None and k < 13):
        assert out.isneginf().any()  # some sampled ids fall outside the nucleus: -inf
    finite = ref.isfinite()
    assert torch.allclose(out[finite], ref[finite], atol=1e-12)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperature": 0.0}, "temperature=0.0"),
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"temperature": math.nan}, "temperature=nan"),  # NaN logprobs everywhere
        ({"temperature": math.inf}, "temperature=inf"),  # a uniform distribution
        ({"top_p": math.nan}, "top_p=nan"),
        ({"top_k": 0}, "top_k=0"),
    ],
)
def test_token_logprobs_refuses_sampling_parameters_with_no_distribution(
    options: dict[str, float], message: str
) -> None:
    logits, ids = torch.randn(1, 3, 5), torch.randint(0, 5, (1, 3))
    with pytest.raises(ValueError, match=message):
        token_logprobs(logits, ids, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "filters", [{}, {"top_p": 0.9}, {"top_k": 7}, {"top_k": 7, "top_p": 0.8}], ids=str
)
def test_token_logprobs_chunks_agree_with_one_chunk(
    monkeypatch: pytest.MonkeyPatch, filters: dict[str, float]
) -> None:
    torch.manual_seed(2)
    logits = torch.randn(2, 9, 50, requires_grad=True)
    ids = torch.randint(0, 50, (2, 9))
    monkeypatch.setattr("asyncroll.train.loss._chunk_rows", lambda *_: 18)  # all rows at once
    whole = token_logprobs(logits, ids, temperature=0.8, **filters)  # type: ignore[arg-type]
    (g_whole,) = torch.autograd.grad(whole.sum(), logits)
    monkeypatch.setattr("asyncroll.train.loss._chunk_rows", lambda *_: 4)  # 4 + 4 + 4 + 4 + 2
    chunked = token_logprobs(logits, ids, temperature=0.8, **filters)  # type: ignore[arg-type]
    (g_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    assert torch.equal(whole.isneginf(), chunked.isneginf())
    assert torch.allclose(whole, chunked) and torch.allclose(g_whole, g_chunked)


def test_proximal_logprobs_in_micro_batches_equals_one_pass() -> None:
    torch.manual_seed(3)
    table = torch.randn(100, 100)
    batch = to_batch([scored(0, [1.0, 0.0, 0.5], tokens=4)])

    def forward(ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        return table[ids] * attention[..., None]

    one = proximal_logprobs(forward, batch, temperature=0.5)
    assert not one.requires_grad
    assert torch.equal(one, proximal_logprobs(forward, batch, temperature=0.5, micro_batch=2))
    assert torch.allclose(
        one,
        token_logprobs(
            forward(batch.input_ids, batch.attention_mask), batch.input_ids, temperature=0.5
        ),
    )


@pytest.mark.parametrize("micro_batch", [0, -1])
def test_proximal_logprobs_refuses_a_micro_batch_below_one(micro_batch: int) -> None:
    """0 ran the whole batch in one pass (the memory a micro-batch is meant to bound), -1 ran
    none and failed inside torch.cat."""
    batch = to_batch([scored(0, [1.0, 0.0], tokens=4)])
    calls: list[int] = []

    def forward(ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        calls.append(len(ids))
        return torch.zeros(*ids.shape, 100)

    with pytest.raises(ValueError, match=f"micro_batch={micro_batch}"):
        proximal_logprobs(forward, batch, micro_batch=micro_batch)
    assert calls == []


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors that ops allocate while the mode is on (inputs not counted).

    Every op output that is not a view or an in-place result of an input is a new allocation;
    views inherit their base's allocation, and an allocation is freed when its last tensor
    dies. On the meta device nothing is really allocated, so the real shapes (a 152k vocabulary)
    cost nothing to check."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.owner: dict[int, list[int]] = {}  # id(tensor) -> [bytes, tensors alive]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        aliased = any(r.alias_info is not None for r in func._schema.returns)
        base = next((a for a in args if isinstance(a, torch.Tensor)), None)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            if aliased and base is not None and id(base) in self.owner:
                cell = self.owner[id(base)]
            elif aliased:
                continue  # a view of an input: no allocation of ours
            else:
                cell = [t.numel() * t.element_size(), 0]
                self.live += cell[0]
                self.peak = max(self.peak, self.live)
            cell[1] += 1
            self.owner[id(t)] = cell
            weakref.finalize(t, self._release, id(t), cell)
        return out

    def _release(self, key: int, cell: list[int]) -> None:
        self.owner.pop(key, None)
        cell[1] -= 1
        if cell[1] == 0:
            self.live -= cell[0]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_token_logprobs_extra_memory_at_a_152k_vocabulary(top_p: float) -> None:
    """One 2,048-token row at vocabulary 152,064 (Qwen): forward and backward each allocate at
    most a quarter of the logits' size besides the gradient of the logits itself; the old
    float32 log_softmax alone was the logits' size."""
    logits = torch.empty(1, 2048, 152_064, device="meta", requires_grad=True)
    ids = torch.zeros(1, 2048, dtype=torch.int64, device="meta")
    with LiveBytes() as forward:
        out = token_logprobs(logits, ids, temperature=0.7, top_p=top_p)
    assert forward.peak <= logits.nbytes / 4, forward.peak / logits.nbytes
    assert forward.peak >= CHUNK_BYTES / 8  # the chunks are what it measured, not nothing
    with LiveBytes() as backward:
        (grad,) = torch.autograd.grad(out.sum(), logits)
    assert backward.peak - grad.nbytes <= logits.nbytes / 4, backward.peak / logits.nbytes
    with LiveBytes() as naive:
        torch.log_softmax(logits[:, :-1].float() / 0.7, dim=-1)
    assert naive.peak >= logits.nbytes * 0.99  # the tracker sees a full-size allocation


def vllm_processed_logprobs(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int | None
) -> torch.Tensor:
    """vLLM's own sampler ([N, V] logits): its float32 cast, temperature, top-k/top-p (the
    dispatcher: the PyTorch path on a CPU wheel, the Triton kernel on CUDA, where the logits
    go to the GPU so that the GPU tier checks that kernel's tie rule) and processed logprobs.
    Model Runner V1's `Sampler` (gone in vLLM 0.34) divides by the temperature and takes a
    float32 log_softmax; without it that is written out here."""
    sampling = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = logits.shape[0]
    x = logits.to(device, torch.float32)
    temperatures = torch.full((n,), temperature, device=device)
    try:
        from vllm.v1.sample.sampler import Sampler
    except ImportError:  # vLLM >= 0.34: Model Runner V2 only
        x = x / temperatures.unsqueeze(1)
    else:
        x = Sampler.apply_temperature(x, temperatures, all_random=True)
    p = torch.full((n,), top_p, device=device) if top_p < 1 else None
    k = torch.full((n,), top_k, dtype=torch.int32, device=device) if top_k is not None else None
    x = sampling.apply_top_k_top_p(x, k, p)
    return x.log_softmax(dim=-1, dtype=torch.float32).cpu()


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("t", "p", "k"),
    [(0.7, 0.9, None), (1.0, 0.8, None), (1.2, 0.95, 300), (1.0, 1.0, 40), (1.0, 1.0, 2000)],
)
def test_token_logprobs_break_boundary_ties_as_vllm_does(t: float, p: float, k: int | None) -> None:
    """bf16 logits tie often (8 bits of mantissa: dozens of tokens share the boundary value
    at a 152k vocabulary). vLLM's top-p removes an ascending-sorted *prefix*, so it drops some
    tokens of a tied value and keeps the others; keeping the whole tie made the trainer's
    normaliser larger and every ratio to vLLM's logprobs biased below 1 at staleness 0.

    Every token of every row is scored (row r is repeated once per vocabulary id, each copy
    predicting that id), so the kept sets are compared whole, against vLLM's function called on
    the same logits."""
    vocab, rows = 2048, 6
    torch.manual_seed(4)
    base = (2 * torch.randn(rows, vocab)).to(torch.bfloat16)
    logits = base[:, None, :].expand(rows, vocab + 1, vocab)  # position i predicts id i
    ids = torch.nn.functional.pad(torch.arange(vocab), (1, 0)).expand(rows, vocab + 1)
    ours = token_logprobs(logits, ids, temperature=t, top_p=p, top_k=k)[:, 1:]
    theirs = vllm_processed_logprobs(base, t, p, k)
    if p < 1:  # the case under test happens: a tied value both kept and dropped by vLLM
        kept = theirs.isfinite()
        split = [
            (base[r][kept[r]].float().min() == base[r][~kept[r]].float().max()).item()
            for r in range(rows)
        ]
        assert any(split), "no tie at the boundary: the test checks nothing"
    assert torch.equal(ours.isneginf(), theirs.isneginf())
    finite = theirs.isfinite()
    assert torch.allclose(ours[finite], theirs[finite], atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "filters",
    [
        {},
        {"top_p": 0.9},
        {"top_k": 50},
        {"top_k": 50, "top_p": 0.9},
        {"top_k": 152_064 // 2},
        {"top_k": 152_064},
        {"top_k": 152_064 // 2, "top_p": 0.9},
    ],
    ids=str,
)
def test_token_logprobs_extra_memory_scales_with_the_batch(
    dtype: torch.dtype, filters: dict[str, float]
) -> None:
    """A 2 x 256 batch at vocabulary 152,064, every filter: forward and backward each allocate
    under a quarter of the logits' size besides the gradient itself. A fixed 128 MiB chunk is
    most of a small batch's logits (bf16: 156 MB), and the top-k path held three copies of a
    chunk: 0.30-0.93x before. A large top-k without top-p: `topk` returns k values and k int64
    indices per row, which the chunk sizing once ignored (0.55x of the bf16 logits at k =
    vocab / 2, 0.86x at k = vocab)."""
    logits = torch.empty(2, 256, 152_064, dtype=dtype, device="meta", requires_grad=True)
    ids = torch.zeros(2, 256, dtype=torch.int64, device="meta")
    with LiveBytes() as forward:
        out = token_logprobs(logits, ids, temperature=0.7, **filters)  # type: ignore[arg-type]
    assert forward.peak < logits.nbytes / 4, forward.peak / logits.nbytes
    with LiveBytes() as backward:
        (grad,) = torch.autograd.grad(out.sum(), logits)
    assert backward.peak - grad.nbytes < logits.nbytes / 4, backward.peak / logits.nbytes


# --- The problems GRPO is blind to: zero variance below the solved reward ---


def test_blind_problems_are_every_zero_variance_problem_below_solved() -> None:
    """A (group, turn) problem is blind when its samples all scored the same and below the
    solved reward: all 0 (the failed ones) and all the same partial score too (each sample
    half right gets no advantage either); not one whose samples differ (GRPO has a signal) nor
    one every sample solved (nothing to change)."""
    from asyncroll.train import blind_problems

    rewards = np.array(  # [groups, samples, turns]
        [
            [[0.0, 0.5, 1.0, 0.0], [0.0, 0.5, 1.0, 0.25]],
            [[0.0, 0.5, 0.25, 1.0], [1.0, 0.25, 0.25, 1.0]],
        ]
    )
    assert blind_problems(rewards).tolist() == [
        [True, True, False, False],
        [False, False, True, False],
    ]
    # the solved reward is the caller's: with rewards up to 2, an all-1 problem is blind
    assert blind_problems(rewards, solved=2.0)[0].tolist() == [True, True, True, False]
    with pytest.raises(ValueError, match="solved"):
        blind_problems(rewards, solved=float("nan"))


def test_blind_tokens_are_the_trained_tokens_of_the_blind_problems() -> None:
    """Exactly the trained tokens of the blind (group, turn) problems, the partial ones
    included (which `failed_tokens` leaves out); without per-turn rewards a problem is a
    whole group, judged by the samples' rewards."""
    import msgspec

    from asyncroll.train import blind_tokens, failed_tokens, turn_index
    from tests.test_turns import scored_turn_group

    scores = {  # [samples, turns]: group 0 turn 0 all 0, turn 1 all 0.5; group 1 turn 2 all 1
        0: np.array([[0.0, 0.5, 1.0], [0.0, 0.5, 0.0]]),
        1: np.array([[0.0, 0.5, 1.0], [1.0, 0.0, 1.0]]),
    }
    groups = [msgspec.structs.replace(scored_turn_group(2), prompt_id=str(i)) for i in range(2)]
    batch = to_batch(groups)
    blind = blind_tokens(batch, groups, lambda g: scores[int(g.prompt_id)])
    turn = torch.from_numpy(turn_index(groups, batch.input_ids.shape[1]))
    expected = torch.zeros_like(batch.loss_mask)
    expected[:2] = (turn[:2] == 0) | (turn[:2] == 1)
    assert torch.equal(blind, expected) and bool((blind <= batch.loss_mask).all())
    failed = failed_tokens(batch, groups, lambda g: scores[int(g.prompt_id)])
    assert torch.equal(failed[:2], turn[:2] == 0)  # the partial problem is not "failed"

    half = tuple(msgspec.structs.replace(s, reward=0.5) for s in groups[0].samples)
    flat = [msgspec.structs.replace(groups[0], samples=half), groups[1]]  # group 1: 0 and 1
    whole = blind_tokens(to_batch(flat), flat, None)
    assert torch.equal(whole[:2], batch.loss_mask[:2]) and not bool(whole[2:].any())


def test_capped_entropy_pushes_only_the_tokens_below_the_target() -> None:
    """`capped_entropy` is the mean over the masked tokens of min(entropy, target): its
    gradient reaches the logits that sampled a masked token whose entropy is below the target
    and no others, so a bonus on it raises a certain context's entropy up to the target and
    no further (a plain bonus drives a stuck context towards uniform over the vocabulary).
    With an infinite target it is `mean_entropy`."""
    from asyncroll.train import capped_entropy, mean_entropy, token_entropy

    batch = to_batch([scored(0, [0.0, 1.0], tokens=4)])
    rows, length = batch.input_ids.shape
    vocab = 16
    logits = torch.zeros((rows, length, vocab))  # uniform: entropy log 16 = 2.77
    logits[0, :, 0] = 6.0  # row 0 nearly certain: entropy ~0.1
    logits.requires_grad_()
    per_token = token_entropy(logits, 1.0)
    mask = batch.loss_mask
    low, high = float(per_token[0, -1].detach()), math.log(vocab)
    assert low < 1.0 < high
    got = capped_entropy(per_token, mask, target=1.0)
    expected = float((per_token.detach().clamp(max=1.0) * mask).sum() / mask.sum())
    assert float(got.detach()) == pytest.approx(expected, rel=1e-6)
    got.backward()
    assert logits.grad is not None
    sampled_at = torch.zeros_like(mask)  # the position whose logits sampled a trained token
    sampled_at[:, :-1] = mask[:, 1:]
    moved = logits.grad.abs().sum(-1) > 0
    assert torch.equal(moved[0], sampled_at[0])  # below the target: pushed up
    assert not bool(moved[1].any())  # at log 16 > 1: left alone

    uncapped = capped_entropy(per_token.detach(), mask, target=math.inf)
    plain = mean_entropy(logits.detach(), batch, 1.0)
    assert float(uncapped) == pytest.approx(float(plain), rel=1e-6)
    assert float(capped_entropy(per_token.detach(), torch.zeros_like(mask), 1.0)) == 0.0
    with pytest.raises(ValueError, match="target"):
        capped_entropy(per_token, mask, target=-1.0)


def test_unlikelihood_pushes_a_certain_wrong_token_down_where_entropy_cannot() -> None:
    """`unlikelihood` is the sum over the masked tokens of -log(1 - p(token)), divided by
    `total` (the batch's trained tokens, as the policy loss is, so its weight reads as an
    advantage). Its gradient on a token's own logit is p: at a context 99.9% sure of the
    sampled (wrong) token it is ~1, where the entropy's is ~0.01 (an entropy bonus barely moves
    a certain context); the mass leaves that token for the others in proportion to their
    probability. A masked token sampled outside the nucleus (logprob -inf) adds 0, finitely."""
    from asyncroll.train import token_entropy, unlikelihood

    vocab = 8
    logits = torch.zeros((1, 3, vocab))
    logits[0, 0, 3] = math.log(0.999 * (vocab - 1) / 0.001)  # p(3) = 0.999 at position 0
    logits[0, 0, 5] = math.log(2.0)  # the others 1:2 between tokens 5 and 4, say
    logits.requires_grad_()
    ids = torch.tensor([[0, 3, 0]])  # position 1 was sampled from position 0's logits
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    logprobs = torch.nn.functional.pad(logprobs, (1, 0))
    p = float(logprobs[0, 1].detach().exp())
    mask = torch.tensor([[False, True, False]])
    got = unlikelihood(logprobs, mask, total=4)
    assert float(got) == pytest.approx(-math.log(1 - p) / 4, rel=1e-4)
    (grad,) = torch.autograd.grad(got * 4, logits)
    assert float(grad[0, 0, 3]) == pytest.approx(p, rel=1e-4)  # d/dz_x -log(1-p_x) = p_x
    others = -grad[0, 0, [4, 5]]
    assert float(others[1] / others[0]) == pytest.approx(2.0, rel=1e-4)  # in proportion
    assert not bool(grad[0, 1:].any())
    entropy = token_entropy(logits, 1.0)[0, 1]
    (entropy_grad,) = torch.autograd.grad(entropy, logits)
    assert abs(float(entropy_grad[0, 0, 3])) < 0.02 < float(grad[0, 0, 3])

    outside = torch.tensor([[0.0, -math.inf, 0.0]], requires_grad=True)
    value = unlikelihood(outside, mask, total=1)
    value.backward()
    assert float(value) == 0.0 and outside.grad is not None
    assert bool(torch.isfinite(outside.grad).all())
    assert float(unlikelihood(logprobs.detach(), torch.zeros_like(mask), total=0)) == 0.0
