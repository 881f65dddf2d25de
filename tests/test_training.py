import warnings

import numpy as np
import pytest
import torch

from asyncroll.codec import decode, encode
from asyncroll.training import group_advantages, policy_loss, to_batch, token_logprobs
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


def test_policy_loss_clips_large_ratios() -> None:
    batch = to_batch([scored(0, [1.0, 0.0], tokens=4)])
    logp = batch.old_logprobs + 1.0 * batch.loss_mask  # ratio e for every trained token
    _, stats = policy_loss(logp, batch, clip=0.2)
    assert stats["clip_fraction"] > 0.4  # the positive-advantage row is clipped
