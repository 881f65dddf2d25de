"""The multi-turn data model: a per-token loss mask and turn boundaries on `RolloutState`,
carried by the codec and checkpoints, applied by `to_batch`."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from asyncroll.codec import decode, encode
from asyncroll.config import ProducerConfig
from asyncroll.engines.base import SamplingConfig
from asyncroll.train import to_batch, turn_index, turn_loss
from asyncroll.types import RolloutGroup, RolloutState, Status
from tests.factories import make_group


def turned(sample: RolloutState, mask: list[int], ends: list[int]) -> RolloutState:
    return msgspec.structs.replace(
        sample,
        loss_mask=np.array(mask, dtype=np.uint8),
        turn_ends=np.array(ends, dtype=np.int32),
    )


def multi_group() -> RolloutGroup:
    group = make_group(samples=2, tokens=5)
    a, b = group.samples
    samples = (turned(a, [1, 1, 0, 0, 1], [2, 4, 5]), b)  # b: single turn, no mask
    return msgspec.structs.replace(group, samples=samples)


def test_a_mask_or_boundaries_that_do_not_fit_the_tokens_are_refused() -> None:
    sample = make_group(tokens=4).samples[0]
    with pytest.raises(ValueError, match="loss_mask must be a 1-D uint8 array of 4"):
        turned(sample, [1, 0, 1], [4])
    with pytest.raises(ValueError, match="loss_mask must be a 1-D uint8"):
        msgspec.structs.replace(sample, loss_mask=np.ones(4, dtype=np.int64))
    with pytest.raises(ValueError, match="turn_ends must rise to the number of tokens"):
        turned(sample, [1, 1, 0, 0], [2, 3])  # last turn ends before the last token
    with pytest.raises(ValueError, match="turn_ends must rise"):
        turned(sample, [1, 1, 0, 0], [3, 2, 4])
    with pytest.raises(TypeError, match="turn_ends must be 1-D int32"):
        msgspec.structs.replace(sample, turn_ends=np.array([4], dtype=np.int64))


def test_counts_of_policy_tokens_and_turns() -> None:
    group = multi_group()
    a, b = group.samples
    assert (a.num_policy_tokens, a.num_turns) == (3, 3)
    assert (b.num_policy_tokens, b.num_turns) == (5, 1)  # single turn: every token, one turn


def test_codec_round_trips_the_mask_and_boundaries_zero_copy() -> None:
    group = multi_group()
    data = encode(group)
    out = decode(data)
    a, b = out.samples
    assert a.loss_mask is not None and a.turn_ends is not None
    assert a.loss_mask.tolist() == [1, 1, 0, 0, 1] and a.loss_mask.dtype == np.uint8
    assert a.turn_ends.tolist() == [2, 4, 5]
    assert np.shares_memory(a.loss_mask, np.frombuffer(data, dtype=np.uint8))
    assert b.loss_mask is None and b.turn_ends is None


def test_single_turn_samples_store_no_mask() -> None:
    """No mask is stored for single-turn samples (two nil fields on the wire, nothing more)."""
    group = make_group(samples=3, tokens=7)
    out = decode(encode(group))
    assert all(s.loss_mask is None and s.turn_ends is None for s in out.samples)


def test_to_batch_trains_only_policy_tokens() -> None:
    group = multi_group()
    group = msgspec.structs.replace(
        group,
        samples=tuple(
            msgspec.structs.replace(s, reward=float(i)) for i, s in enumerate(group.samples)
        ),
        status=Status.COMPLETED,
    )
    batch = to_batch([decode(encode(group))])
    p = len(group.prompt_tokens)
    a = group.samples[0]
    assert batch.loss_mask[0, p : p + 5].tolist() == [True, True, False, False, True]
    assert batch.attention_mask[0, p : p + 5].all()  # the policy saw the environment's tokens
    assert batch.input_ids[0, p : p + 5].tolist() == a.tokens.tolist()
    old = batch.old_logprobs[0, p : p + 5].tolist()
    assert old[2:4] == [0.0, 0.0] and old[4] == pytest.approx(float(a.logprobs[4]))
    assert batch.versions[0, p + 2 : p + 4].tolist() == [-1, -1]
    assert batch.loss_mask[1, p : p + 5].all()  # the single-turn row: every response token
    assert batch.num_tokens == 3 + 5


@pytest.mark.parametrize("tokens", [1, 7, 64, 1000])
def test_an_episode_at_its_limits_encodes_within_its_reservation(tokens: int) -> None:
    """The worst case for bytes: every token a turn of its own, plus max_turns empty policy
    turns, in every sample, with the longest prompt-free group header."""
    config = ProducerConfig(
        group_size=3, max_turns=5, max_episode_tokens=tokens, sampling=SamplingConfig()
    )
    ends = np.concatenate([np.zeros(5, dtype=np.int32), np.arange(1, tokens + 1, dtype=np.int32)])
    sample = RolloutState(
        tokens=np.ones(tokens, dtype=np.int32),
        logprobs=np.zeros(tokens, dtype=np.float32),
        versions=np.zeros(tokens, dtype=np.int32),
        status=Status.COMPLETED,
        finish_reason="length",
        reward=1.0,
        loss_mask=(np.arange(tokens) % 2).astype(np.uint8),
        turn_ends=ends.astype(np.int32),
    )
    group = RolloutGroup(
        uid=2**40, prompt_id="t/123456", task="t", prompt_tokens=np.ones(9, dtype=np.int32),
        samples=(sample,) * 3, status=Status.COMPLETED,
    )  # fmt: skip
    assert len(encode(group)) <= config.group_bytes(0, prompt_tokens=9, episodes=True)


def scored_turn_group(samples: int) -> RolloutGroup:
    """Samples of 3 policy turns (2, 1, 2 tokens) with 2-token environment answers between."""
    group = make_group(samples=samples, tokens=9)
    mask, ends = [1, 1, 0, 0, 1, 0, 0, 1, 1], [2, 4, 5, 7, 9]
    out = tuple(
        msgspec.structs.replace(turned(s, mask, ends), reward=float(i % 3))
        for i, s in enumerate(group.samples)
    )
    return msgspec.structs.replace(group, samples=out)


def test_turn_index_follows_turn_ends_and_skips_the_environment() -> None:
    group = scored_turn_group(2)
    index = turn_index([group], 14)
    p = len(group.prompt_tokens)
    assert index[0, :p].tolist() == [-1] * p
    assert index[0, p:].tolist() == [0, 0, -1, -1, 1, -1, -1, 2, 2, -1, -1]
    single = make_group(samples=1, tokens=4)  # no mask: one policy turn
    assert turn_index([single], 8)[0].tolist() == [-1] * 3 + [0] * 4 + [-1]


def test_turn_loss_with_every_turn_scored_as_the_episode_is_the_episode_loss() -> None:
    """Per-turn credit reduces to the plain loss when each turn's reward is the sample's:
    the turn masks partition the trained tokens and the weights add back to one mean."""
    torch = pytest.importorskip("torch")
    from asyncroll.train import CORRECTIONS, policy_loss

    groups = [scored_turn_group(4), scored_turn_group(4)]
    batch = to_batch(groups)
    # Seed 32 makes the loss ~6e-4, a sum of terms ~1 that nearly cancel: float32 rounding then
    # differs by 2e-5 of it between the two sums (1 draw in ~40 did before `abs` was given).
    noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(32))
    logprobs = (batch.old_logprobs + 0.05 * noise).requires_grad_()

    def same(group: RolloutGroup) -> np.ndarray:
        return np.repeat(group.rewards()[:, None], 3, axis=1)

    for correction in (None, CORRECTIONS["tis"]):
        anchor = logprobs.detach() if correction is not None else None
        expected, _ = policy_loss(logprobs, batch, correction=correction, proximal_logprobs=anchor)
        got = turn_loss(logprobs, batch, groups, same, correction, anchor)
        assert float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-6)

    def only_turn_two(group: RolloutGroup) -> np.ndarray:  # turns 0 and 2 tie: no advantage
        out = np.zeros((group.num_samples, 3))
        out[:, 1] = np.arange(group.num_samples)
        return out

    got = turn_loss(logprobs, batch, groups, only_turn_two, None, None)
    got.backward()
    index = torch.from_numpy(turn_index(groups, batch.input_ids.shape[1]))
    assert logprobs.grad is not None
    assert (logprobs.grad[index == 1] != 0).all() and (logprobs.grad[index != 1] == 0).all()


def test_turn_loss_judges_a_sample_band_on_the_whole_sample() -> None:
    """`seq-mask` drops a sample whose geometric-mean ratio leaves (0.5, 2): of the whole
    sample, as `policy_loss` judges it. Turns of ratio 2.46 and 0.41 around one of 1.0 make a
    sample of geometric mean 1.0, which is kept; judged turn by turn, turns 0 and 2 were each
    dropped (the sample was all but lost) and the loss differed from `policy_loss`'s."""
    torch = pytest.importorskip("torch")
    from asyncroll.train import CORRECTIONS, behaviour_weights, policy_loss

    groups = [scored_turn_group(4), scored_turn_group(4)]
    batch = to_batch(groups)
    index = torch.from_numpy(turn_index(groups, batch.input_ids.shape[1]))
    shift = torch.zeros_like(batch.old_logprobs)
    shift[index == 0], shift[index == 2] = 0.9, -0.9  # rho 2.46 on turn 0, 0.41 on turn 2
    anchor = batch.old_logprobs + shift
    noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(3))
    logprobs = (anchor + 0.05 * noise).requires_grad_()
    correction = CORRECTIONS["seq-mask"]
    weights = behaviour_weights(anchor, batch, correction)
    assert not weights.masked.any()  # every sample's geometric mean is 1.0: all kept

    def same(group: RolloutGroup) -> np.ndarray:
        return np.repeat(group.rewards()[:, None], 3, axis=1)

    expected, _ = policy_loss(logprobs, batch, correction=correction, proximal_logprobs=anchor)
    got = turn_loss(logprobs, batch, groups, same, correction, anchor)
    assert float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-6)
    got.backward()
    assert logprobs.grad is not None and (logprobs.grad[index == 0] != 0).any()


@pytest.mark.parametrize(("advantage", "std"), [("rloo", "population"), ("grpo", "sample")])
def test_turn_loss_takes_the_batchs_advantage_settings(advantage: str, std: str) -> None:
    """Each turn's advantages are computed as `to_batch`'s were: the same `advantage` and
    `std`, so every turn scored as the sample gives `policy_loss` of that batch."""
    torch = pytest.importorskip("torch")
    from asyncroll.train import policy_loss

    groups = [scored_turn_group(4), scored_turn_group(4)]
    batch = to_batch(groups, advantage=advantage, std=std)  # type: ignore[arg-type]
    noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(5))
    logprobs = (batch.old_logprobs + 0.05 * noise).requires_grad_()

    def same(group: RolloutGroup) -> np.ndarray:
        return np.repeat(group.rewards()[:, None], 3, axis=1)

    expected, _ = policy_loss(logprobs, batch)
    got = turn_loss(logprobs, batch, groups, same, None, None, advantage=advantage, std=std)  # type: ignore[arg-type]
    assert float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-6)


def test_mean_entropy_is_of_the_distributions_that_sampled_the_trained_tokens() -> None:
    """The logits one position before each trained token give the distribution it was sampled
    from: uniform there (entropy log V) and a certain token everywhere else (entropy 0) must
    give exactly log V, at any temperature; off by one position it would give 0."""
    torch = pytest.importorskip("torch")
    from asyncroll.train import mean_entropy

    batch = to_batch([scored_turn_group(2)])
    vocab = 16
    rows, length = batch.input_ids.shape
    logits = torch.full((rows, length, vocab), -1e4)
    logits[..., 0] = 0.0  # certain: entropy 0
    before = torch.zeros_like(batch.loss_mask)
    before[:, :-1] = batch.loss_mask[:, 1:]
    logits[before] = 0.0  # uniform before each trained token
    for temperature in (1.0, 0.7):
        got = float(mean_entropy(logits, batch, temperature))
        assert got == pytest.approx(float(np.log(vocab)), rel=1e-5)
    logits.requires_grad_()
    mean_entropy(logits, batch, 1.0).backward()
    assert logits.grad is not None and (logits.grad[~before] == 0).all()


def test_tool_echo_step_metrics_name_the_letter_that_stalls() -> None:
    """Per-letter hit rates and the share of zero-variance problems, from a batch of groups."""
    from asyncroll.app.demo_tool import TURNS, step_metrics

    groups = []
    for letters, said in (("abc", "abb"), ("cab", "xab")):  # "c" is never echoed
        group = scored_turn_group(2)
        targets = [ord(ch) for ch in letters]
        a, b, c = (ord(ch) for ch in said)  # turns at 0-2, 4, 7-9 (`scored_turn_group`)
        tokens = np.array([a, a, 0, 0, b, 0, 0, c, c], dtype=group.samples[0].tokens.dtype)
        samples = [msgspec.structs.replace(s, tokens=tokens) for s in group.samples]
        meta = {"letters": letters, "targets": targets}
        groups.append(msgspec.structs.replace(group, samples=tuple(samples), metadata=meta))
    got = step_metrics(groups)
    assert got["letter_c"] == 0.0 and got["letter_a"] == 1.0 and got["letter_b"] == 1.0
    assert got["zero_std"] == 1.0 and got["zero_std_wrong"] == 2 / (2 * TURNS)
    assert got["turn0"] == 0.5 and got["turn2"] == 0.5


def test_failed_tokens_are_those_of_the_problems_every_sample_missed() -> None:
    """The entropy bonus of `--entropy-on failed` covers exactly the trained tokens of the
    (group, turn) problems whose samples all scored 0: not a problem one sample hit (GRPO has
    a signal there), not one every sample solved (it may become certain), not the environment's
    tokens. Without per-turn rewards a problem is a whole group."""
    torch = pytest.importorskip("torch")
    from asyncroll.train import failed_tokens, mean_entropy

    groups = [scored_turn_group(2), scored_turn_group(2)]
    scores = {  # [samples, turns] per group: turn 0 of group 0 and turns 0, 2 of group 1 fail
        0: np.array([[0.0, 0.0, 1.0], [0.0, 0.5, 1.0]]),
        1: np.array([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]),
    }
    groups = [msgspec.structs.replace(g, prompt_id=str(i)) for i, g in enumerate(groups)]
    batch = to_batch(groups)
    failed = failed_tokens(batch, groups, lambda g: scores[int(g.prompt_id)])
    turn = torch.from_numpy(turn_index(groups, batch.input_ids.shape[1]))
    expected = torch.zeros_like(batch.loss_mask)
    expected[:2] = turn[:2] == 0
    expected[2:] = (turn[2:] == 0) | (turn[2:] == 2)
    assert torch.equal(failed, expected) and bool((failed <= batch.loss_mask).all())

    missed = tuple(msgspec.structs.replace(s, reward=0.0) for s in groups[0].samples)
    flat = [msgspec.structs.replace(groups[0], samples=missed), groups[1]]  # group 1: 0 and 1
    whole = failed_tokens(to_batch(flat), flat, None)
    assert torch.equal(whole[:2], batch.loss_mask[:2]) and not bool(whole[2:].any())

    logits = torch.randn((*batch.input_ids.shape, 16)).requires_grad_()  # not uniform: grad != 0
    mean_entropy(logits, batch, 1.0, mask=failed).backward()
    assert logits.grad is not None
    sampled_at = torch.zeros_like(failed)  # the position whose logits sampled a failed token
    sampled_at[:, :-1] = failed[:, 1:]
    moved = logits.grad.abs().sum(-1) > 0
    assert torch.equal(moved, sampled_at)
