"""The training side of LoRA: a hand-wrapped HF model trains A and B only, through the unchanged
`asyncroll.train.loss`, and its adapter is exactly what `merged_weights` folds into the base."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec
import pytest
import torch

from asyncroll.app.models import TinyModelConfig, build_tiny_model
from asyncroll.lora import LoraAdapter, LoraConfig, LoraError, from_peft_state, merged_weights
from asyncroll.train import (
    CORRECTIONS,
    adapter_of,
    lora_layers,
    policy_loss,
    to_batch,
    token_logprobs,
    trainable_parameters,
    wrap_lora,
)
from tests.factories import make_group

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG = LoraConfig(rank=4, alpha=8.0, target_modules=TARGETS)
UNTIED = TinyModelConfig(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
MODELS = {"tied": TinyModelConfig(), "untied-biases": UNTIED}


def load(config: TinyModelConfig) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(config), dtype=torch.float32)
    return model.eval()


def input_ids() -> torch.Tensor:
    return torch.randint(3, 512, (3, 11), generator=torch.Generator().manual_seed(0))


def randomise(model: Any, seed: int = 1) -> None:
    """Non-zero A and B everywhere (B starts at zero: an untrained adapter would prove nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            for weight in (layer.lora_A.weight, layer.lora_B.weight):
                weight.copy_(torch.randn(weight.shape, generator=g) * 0.05)


def scored(uid: int, rewards: list[float]) -> Any:
    g = make_group(uid, samples=len(rewards), tokens=5)
    samples = tuple(
        msgspec.structs.replace(s, reward=r) for s, r in zip(g.samples, rewards, strict=True)
    )
    return msgspec.structs.replace(g, samples=samples)


def test_a_fresh_adapter_is_the_base_model_exactly() -> None:
    base = load(TinyModelConfig())
    ids = input_ids()
    with torch.no_grad():
        expected = base(input_ids=ids).logits
        wrapped = wrap_lora(base, CONFIG)
        assert torch.equal(wrapped(input_ids=ids).logits, expected)  # B = 0
    adapter = adapter_of(wrapped)
    assert len(adapter.tensors) == 2 * len(TARGETS) * 2  # A and B, 7 targets, 2 layers
    a = adapter.tensors["model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = adapter.tensors["model.layers.0.mlp.down_proj.lora_B.weight"]
    assert a.shape == (4, 128) and bool(a.abs().gt(0).all())  # Kaiming-uniform, not zero
    assert b.shape == (128, 4) and not bool(b.any())


@pytest.mark.parametrize("name", list(MODELS))
def test_wrapped_logits_equal_the_base_model_with_the_merged_weights(name: str) -> None:
    wrapped = wrap_lora(load(MODELS[name]), CONFIG)
    randomise(wrapped)
    adapter = adapter_of(wrapped)
    merged_model = load(MODELS[name])
    base_state = merged_model.state_dict()
    merged = merged_weights(base_state, adapter)
    changed = [k for k in base_state if not torch.equal(merged[k], base_state[k])]
    assert len(changed) == 2 * len(TARGETS)  # every targeted weight, no bias, norm or embedding
    merged_model.load_state_dict(merged)
    ids = input_ids()
    with torch.no_grad():
        got, expected = wrapped(input_ids=ids).logits, merged_model(input_ids=ids).logits
        plain = load(MODELS[name])(input_ids=ids).logits
    assert (got - plain).abs().max() > 1e-2  # the adapter changes the output
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_training_losses_reach_only_a_and_b_and_steps_change_the_adapter() -> None:
    """`token_logprobs` (with top-k/top-p), the TIS-corrected `policy_loss` and AdamW, all
    unchanged: gradients reach B first (B = 0 stops A's at the first step, as in PEFT), A
    from the second step on, and no base tensor ever."""
    wrapped = wrap_lora(load(UNTIED), CONFIG)
    wrapped.train()
    frozen = {n: p.detach().clone() for n, p in wrapped.named_parameters() if not p.requires_grad}
    names = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert names == set(adapter_of(wrapped).tensors)
    batch = to_batch([scored(0, [1.0, 0.0, 0.5]), scored(1, [0.0, 1.0, 0.0])])
    optimizer = torch.optim.AdamW(trainable_parameters(wrapped), lr=1e-2, weight_decay=0.0)

    def step() -> dict[str, torch.Tensor | None]:
        optimizer.zero_grad(set_to_none=True)
        mask = batch.attention_mask.long()
        logits = wrapped(input_ids=batch.input_ids, attention_mask=mask).logits
        logprobs = token_logprobs(logits, batch.input_ids, temperature=0.9, top_k=50, top_p=0.9)
        loss, _ = policy_loss(
            logprobs, batch, correction=CORRECTIONS["tis"], proximal_logprobs=logprobs.detach()
        )
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        return {n: p.grad for n, p in wrapped.named_parameters()}

    def moved(grads: dict[str, torch.Tensor | None], suffix: str) -> bool:
        return all(
            grads[n] is not None and bool(grads[n].abs().sum() > 0)  # type: ignore[union-attr]
            for n in names
            if n.endswith(suffix)
        )

    initial = adapter_of(wrapped)
    first = step()
    assert all(first[n] is None for n in frozen)  # no gradient kept for a base tensor
    assert moved(first, "lora_B.weight")
    assert all(not bool(first[n].any()) for n in names if n.endswith("lora_A.weight"))  # type: ignore[union-attr]
    after_one = adapter_of(wrapped)
    for key, value in after_one.tensors.items():
        changed = not torch.equal(value, initial.tensors[key])
        assert changed == key.endswith("lora_B.weight"), key
    second = step()
    assert all(second[n] is None for n in frozen)
    assert moved(second, "lora_A.weight") and moved(second, "lora_B.weight")
    after_two = adapter_of(wrapped)
    assert all(not torch.equal(after_two.tensors[k], after_one.tensors[k]) for k in names)
    for n, p in wrapped.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    # adapter_of copied: the steps did not reach into the adapter taken before them
    assert not any(bool(t.any()) for k, t in initial.tensors.items() if "lora_B" in k)


def test_a_peft_state_dict_gives_the_same_adapter() -> None:
    """peft's `model.state_dict()` names the same tensors with its wrapper's prefix and the
    adapter's name, and holds the frozen base too: `from_peft_state` reads the adapter from it."""
    wrapped = wrap_lora(load(TinyModelConfig()), CONFIG)
    randomise(wrapped)
    peft_state = {
        "base_model.model."
        + k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
        for k, v in wrapped.state_dict().items()
    }
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in peft_state
    ours, theirs = adapter_of(wrapped), from_peft_state(peft_state, CONFIG)
    assert isinstance(theirs, LoraAdapter) and theirs.config == ours.config
    assert theirs.tensors.keys() == ours.tensors.keys()
    assert all(torch.equal(theirs.tensors[k], ours.tensors[k]) for k in ours.tensors)


def test_bad_targets_and_double_wrapping_are_refused_with_what_to_change() -> None:
    model = load(TinyModelConfig())
    with pytest.raises(LoraError, match=r"\['qkv_proj'\] match no nn.Linear.*'q_proj'"):
        wrap_lora(model, msgspec.structs.replace(CONFIG, target_modules=("q_proj", "qkv_proj")))
    assert not list(lora_layers(model))  # nothing wrapped on the way to the error
    with pytest.raises(LoraError, match="no LoRA layers"):
        adapter_of(model)
    wrap_lora(model, CONFIG)
    with pytest.raises(LoraError, match="already LoRA-wrapped"):
        wrap_lora(model, CONFIG)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_output_head_is_refused_at_wrap_lora(name: str) -> None:
    """vLLM serves no adapter on the output head (nor the embedding) that asyncroll can
    load: refused when wrapping, with the reason, not by the engine after training."""
    model = load(MODELS[name])
    with pytest.raises(LoraError, match="lm_head is the model's output head"):
        wrap_lora(model, LoraConfig(rank=2, alpha=2.0, target_modules=("q_proj", "lm_head")))
    assert not list(lora_layers(model))


def test_a_and_b_train_in_float32_on_a_bfloat16_model() -> None:
    """As PEFT does by default (`autocast_adapter_dtype`): A and B of a 16-bit model are
    float32 (a bf16 B would round away most of a small optimizer step), the layer's output
    keeps the model's dtype, and the adapter is float32."""
    model = wrap_lora(load(TinyModelConfig()).to(torch.bfloat16), CONFIG)
    layer = dict(lora_layers(model))["model.layers.0.self_attn.q_proj"]
    assert layer.lora_A.weight.dtype == layer.lora_B.weight.dtype == torch.float32
    assert layer.base_layer.weight.dtype == torch.bfloat16
    randomise(model)
    logits = model(input_ids=input_ids()).logits
    assert logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).sum().backward()
    grad = layer.lora_B.weight.grad
    assert grad is not None and grad.dtype == torch.float32 and bool(grad.any())
    before = layer.lora_B.weight.detach().clone()
    torch.optim.SGD(trainable_parameters(model), lr=1e-6).step()
    moved = layer.lora_B.weight.detach() - before
    assert bool(moved.any())
    assert not bool((before.to(torch.bfloat16) - (before + moved).to(torch.bfloat16)).any())
    assert all(t.dtype == torch.float32 for t in adapter_of(model).tensors.values())


def test_only_the_targets_are_wrapped() -> None:
    model = wrap_lora(
        load(TinyModelConfig()), LoraConfig(rank=2, alpha=2.0, target_modules=("v_proj",))
    )
    assert [p for p, _ in lora_layers(model)] == [
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    assert sum(p.numel() for p in trainable_parameters(model)) == 2 * (2 * 128 + 64 * 2)


@pytest.mark.parametrize(
    ("options", "flag"),
    [({"lora_rank": 0}, "--lora-rank"), ({"lora_rank": 1024}, "--lora-rank"),
     ({"lora_alpha": 0.0}, "--lora-alpha"), ({"lora_alpha": float("nan")}, "--lora-alpha")],
)  # fmt: skip
def test_demo_lora_options_are_refused_by_flag(options: dict[str, Any], flag: str) -> None:
    from asyncroll.app.demo import DemoConfig

    with pytest.raises(ValueError, match=flag):
        DemoConfig(lora=True, **options)


def test_demo_trains_full_weights_unless_told_lora() -> None:
    from asyncroll.app.demo import LORA_TARGETS, DemoConfig

    assert DemoConfig().lora_config() is None
    config = DemoConfig(lora=True, lora_rank=16, lora_alpha=8.0).lora_config()
    assert config == LoraConfig(rank=16, alpha=8.0, target_modules=LORA_TARGETS)


def test_demo_lora_takes_its_own_defaults_and_a_given_flag_wins() -> None:
    """`asyncroll demo --lora` runs with `demo.LORA_DEFAULTS` (every group kept and an entropy
    bonus: with the filter, a letter the policy answers with one wrong letter scores 0 in every
    sample, its groups are dropped and it never learns; docs/lora-training.md); a flag given
    wins; full fine-tuning and `DemoConfig(...)` keep their own defaults; tool_echo's apply with
    --lora."""
    from asyncroll.app import cli, demo_tool
    from asyncroll.app.demo import LORA_DEFAULTS, DemoConfig

    parser = cli._parser()

    def config(*flags: str) -> DemoConfig:
        return cli._demo_config(parser.parse_args(["demo", *flags]))

    assert LORA_DEFAULTS["entropy"] > 0
    lora = config("--lora")
    assert lora.lora and {k: getattr(lora, k) for k in LORA_DEFAULTS} == LORA_DEFAULTS
    assert config("--lora", "--entropy", "0").entropy == 0.0
    assert config("--lora", "--filter", "nonzero_std").filter == "nonzero_std"
    assert (config().entropy, config().filter) == (0.0, "nonzero_std")
    assert (DemoConfig(lora=True).entropy, DemoConfig(lora=True).filter) == (0.0, "nonzero_std")
    tool = config("--lora", "--task", "tool_echo")
    assert tool.entropy == LORA_DEFAULTS["entropy"]
    assert tool.max_new_tokens == demo_tool.DEFAULTS["max_new_tokens"]
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    help_text = " ".join(commands.choices["demo"].format_help().split())
    tool_defaults = demo_tool.DEFAULTS
    assert (
        f"(default 0.0; tool_echo: {tool_defaults['entropy']}; --lora: {LORA_DEFAULTS['entropy']})"
        in (help_text)
    )
    assert f"(default nonzero_std; tool_echo: {tool_defaults['filter']}; --lora: none)" in help_text
