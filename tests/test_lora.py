"""`asyncroll.lora`: adapters are checked when built, PEFT's names are understood, merging
and the PEFT folder layout are what vLLM and PEFT compute and read."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from asyncroll.lora import (
    LoraAdapter,
    LoraConfig,
    LoraError,
    LoraSlots,
    adapter_name,
    check_servable,
    from_peft_state,
    merged_weights,
    peft_config,
    write_peft,
)

torch = pytest.importorskip("torch")

Q = "model.layers.0.self_attn.q_proj"
V = "model.layers.0.self_attn.v_proj"
CONFIG = LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj"))


def tensors(rank: int = 2, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"{Q}.lora_A.weight": torch.randn(rank, 8, generator=g),
        f"{Q}.lora_B.weight": torch.randn(6, rank, generator=g),
        f"{V}.lora_A.weight": torch.randn(rank, 8, generator=g),
        f"{V}.lora_B.weight": torch.randn(4, rank, generator=g),
    }


def test_config_scale() -> None:
    assert CONFIG.scale == 2.0


def test_rslora_scales_by_the_square_root_of_the_rank() -> None:
    """rsLoRA (PEFT's `use_rslora`): scale alpha / sqrt(rank), in the merged weights and in
    the adapter_config.json vLLM reads."""
    config = LoraConfig(rank=4, alpha=3.0, target_modules=("q_proj",), use_rslora=True)
    assert config.scale == 1.5
    assert peft_config(config)["use_rslora"] is True
    assert peft_config(CONFIG)["use_rslora"] is False
    g = torch.Generator().manual_seed(3)
    a, b, w = (torch.randn(*shape, generator=g) for shape in ((4, 8), (6, 4), (6, 8)))
    adapter = LoraAdapter(config, {f"{Q}.lora_A.weight": a, f"{Q}.lora_B.weight": b})
    merged = merged_weights({f"{Q}.weight": w}, adapter)[f"{Q}.weight"]
    assert torch.equal(merged, w + 1.5 * (b @ a))
    with pytest.raises(LoraError, match="use_rslora=1"):
        LoraConfig(rank=4, alpha=3.0, target_modules=("q_proj",), use_rslora=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"rank": 0}, "rank=0"),
        ({"rank": -1}, "rank=-1"),
        ({"rank": 2.0}, "rank=2.0"),
        ({"rank": True}, "rank=True"),
        ({"alpha": 0.0}, "alpha=0.0"),
        ({"alpha": math.nan}, "alpha=nan"),
        ({"alpha": math.inf}, "alpha=inf"),
        ({"target_modules": ()}, "non-empty"),
        ({"target_modules": ["q_proj"]}, "non-empty tuple"),
        ({"target_modules": ("model.layers.0.q_proj",)}, "leaf"),
        ({"target_modules": ("q_proj", "q_proj")}, "repeats"),
    ],
)
def test_bad_config(kwargs: dict[str, Any], words: str) -> None:
    fields: dict[str, Any] = {"rank": 2, "alpha": 4.0, "target_modules": ("q_proj",)} | kwargs
    with pytest.raises(LoraError, match=words):
        LoraConfig(**fields)


def test_adapter_is_checked_and_frozen() -> None:
    given = tensors()
    adapter = LoraAdapter(CONFIG, given)
    assert adapter.modules == (Q, V)
    assert adapter.nbytes() == 4 * (2 * 8 + 6 * 2 + 2 * 8 + 4 * 2)
    given.clear()  # the adapter holds its own mapping
    assert len(adapter.tensors) == 4
    with pytest.raises(TypeError):
        adapter.tensors[f"{Q}.lora_A.weight"] = torch.zeros(2, 8)  # type: ignore[index]


def hostile(change: str) -> dict[str, Any]:
    t = tensors()
    if change == "a without b":
        del t[f"{Q}.lora_B.weight"]
    elif change == "b without a":
        del t[f"{V}.lora_A.weight"]
    elif change == "a rank":
        t[f"{Q}.lora_A.weight"] = torch.randn(3, 8)
    elif change == "b rank":
        t[f"{V}.lora_B.weight"] = torch.randn(4, 3)
    elif change == "1-d":
        t[f"{Q}.lora_A.weight"] = torch.randn(16)
    elif change == "nan":
        t[f"{Q}.lora_B.weight"][1, 1] = math.nan
    elif change == "inf":
        t[f"{V}.lora_A.weight"][0, 0] = math.inf
    elif change == "integer":
        t[f"{Q}.lora_A.weight"] = torch.ones(2, 8, dtype=torch.int64)
    elif change == "float8":
        t[f"{Q}.lora_A.weight"] = torch.randn(2, 8).to(torch.float8_e4m3fn)
    elif change == "not a tensor":
        t[f"{Q}.lora_A.weight"] = [[0.0] * 8] * 2
    elif change == "unknown leaf":
        t["model.layers.0.mlp.up_proj.lora_A.weight"] = torch.randn(2, 8)
        t["model.layers.0.mlp.up_proj.lora_B.weight"] = torch.randn(8, 2)
    elif change == "other name":
        t[f"{Q}.weight"] = torch.randn(6, 8)
    elif change == "empty":
        t.clear()
    return t


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("a without b", "lacks 'model.layers.0.self_attn.q_proj.lora_B.weight'"),
        ("b without a", "lacks 'model.layers.0.self_attn.v_proj.lora_A.weight'"),
        ("a rank", r"lora_A is \(3, 8\).*rank 2"),
        ("b rank", r"lora_B \(4, 3\).*rank 2"),
        ("1-d", "2-D"),
        ("nan", "q_proj.lora_B.weight' has NaN"),
        ("inf", "v_proj.lora_A.weight' has NaN or infinite"),
        ("integer", "floating-point"),
        ("not a tensor", "torch.Tensor"),
        ("float8", r"q_proj.lora_A.weight' is torch.float8_e4m3fn: give float16, bfloat16"),
        ("unknown leaf", "'up_proj' is not in target_modules"),
        ("other name", "must end with"),
        ("empty", "no tensors"),
    ],
)
def test_hostile_adapter(change: str, words: str) -> None:
    with pytest.raises(LoraError, match=words):
        LoraAdapter(CONFIG, hostile(change))


def test_adapter_needs_a_config() -> None:
    with pytest.raises(LoraError, match="not LoraConfig"):
        LoraAdapter({"rank": 2}, tensors())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "form",
    [
        "{module}.lora_{ab}.weight",  # already ours
        "base_model.model.{module}.lora_{ab}.weight",  # get_peft_model_state_dict
        "base_model.model.{module}.lora_{ab}.default.weight",  # model.state_dict()
        "{module}.lora_{ab}.default.weight",
    ],
)
def test_from_peft_state_names(form: str) -> None:
    ours = tensors()
    state = {}
    for key, t in ours.items():
        module, ab = key.removesuffix(".weight").rsplit(".lora_", 1)
        state[form.format(module=module, ab=ab)] = t
    state["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] = torch.ones(6, 8)
    state["base_model.model.model.embed_tokens.weight"] = torch.ones(10, 8)
    adapter = from_peft_state(state, CONFIG)
    assert dict(adapter.tensors) == ours


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({f"base_model.model.{Q}.lora_A.other.weight": torch.randn(2, 8)}, "several adapters"),
        ({"base_model.model.model.embed_tokens.lora_embedding_A.default": 0}, "embedding"),
        ({f"base_model.model.{Q}.lora_magnitude_vector.default.weight": 0}, "DoRA"),
        ({f"base_model.model.{Q}.lora_B.bias": 0}, "bias"),
        ({"base_model.model.score.modules_to_save.default.weight": 0}, "modules_to_save"),
        ({f"base_model.model.{Q}.lora_C.weight": 0}, "not a lora_A/lora_B"),
        ({f"{Q}.lora_A.weight": torch.randn(2, 8)}, "twice"),
    ],
)
def test_from_peft_state_refuses(extra: dict[str, Any], words: str) -> None:
    state = {f"base_model.model.{k.replace('.weight', '.default.weight')}": t
             for k, t in tensors().items()} if "twice" not in words else {
        f"base_model.model.{k}": t for k, t in tensors().items()}  # fmt: skip
    with pytest.raises(LoraError, match=words):
        from_peft_state(state | extra, CONFIG)


@pytest.mark.parametrize(
    "key",
    [
        f"base_model.model.{Q}.base_layer.bias",  # bias="all" / "lora_only", wrapped layer
        f"base_model.model.{Q}.bias",
        "base_model.model.model.layers.0.mlp.up_proj.bias",  # bias="all", a layer not adapted
    ],
)
def test_from_peft_state_refuses_a_trained_bias(key: str) -> None:
    """An adapter-only state (`get_peft_model_state_dict`) holds only what PEFT trained: a
    bias there (`bias="all"` or `"lora_only"`) changes what the adapter computes, and a plain
    LoRA cannot carry it. Skipped, the adapter would serve without it."""
    state = {f"base_model.model.{k}": t for k, t in tensors().items()}
    with pytest.raises(LoraError, match=f"{key}.*trained tensor.*bias"):
        from_peft_state(state | {key: torch.zeros(6)}, CONFIG)


def test_from_peft_state_empty() -> None:
    with pytest.raises(LoraError, match="no lora_A/lora_B"):
        from_peft_state({"model.embed_tokens.weight": torch.ones(2, 2)}, CONFIG)


def test_from_peft_state_checks_the_adapter() -> None:
    state = {f"base_model.model.{k}": t for k, t in tensors().items()}
    state[f"base_model.model.{Q}.lora_A.weight"] = torch.randn(3, 8)
    with pytest.raises(LoraError, match="rank 2"):
        from_peft_state(state, CONFIG)


def test_merged_weights() -> None:
    adapter = LoraAdapter(CONFIG, tensors())
    norm = torch.ones(8)
    base = {
        f"{Q}.weight": torch.randn(6, 8).to(torch.bfloat16),
        f"{V}.weight": torch.randn(4, 8),
        "model.norm.weight": norm,
    }
    merged = merged_weights(base, adapter)
    assert merged["model.norm.weight"] is norm
    for module, dtype in ((Q, torch.bfloat16), (V, torch.float32)):
        a, b = (
            adapter.tensors[f"{module}.lora_A.weight"],
            adapter.tensors[f"{module}.lora_B.weight"],
        )
        expected = (base[f"{module}.weight"].float() + 2.0 * (b @ a)).to(dtype)
        assert merged[f"{module}.weight"].dtype == dtype
        assert torch.equal(merged[f"{module}.weight"], expected)


def test_merged_weights_refuses_a_module_the_model_lacks() -> None:
    adapter = LoraAdapter(CONFIG, tensors())
    with pytest.raises(LoraError, match=r"lack 'model.layers.0.self_attn.v_proj.weight'"):
        merged_weights({f"{Q}.weight": torch.randn(6, 8)}, adapter)
    with pytest.raises(LoraError, match=r"maps 8 -> 6 features.*\(6, 9\)"):
        merged_weights({f"{Q}.weight": torch.randn(6, 9), f"{V}.weight": torch.randn(4, 8)},
                       adapter)  # fmt: skip


def test_write_peft(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    adapter = LoraAdapter(CONFIG, tensors())
    folder = write_peft(adapter, tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (
        2, 4.0, ["q_proj", "v_proj"],
    )  # fmt: skip
    saved = load_file(folder / "adapter_model.safetensors")
    assert from_peft_state(saved, CONFIG).tensors.keys() == adapter.tensors.keys()
    assert all(torch.equal(saved[f"base_model.model.{k}"], t) for k, t in adapter.tensors.items())


def test_vllm_reads_what_write_peft_writes(tmp_path: Path) -> None:
    """vLLM's own config parser and tensor-name parser accept the folder."""
    peft_helper = pytest.importorskip("vllm.lora.peft_helper")
    utils = pytest.importorskip("vllm.lora.utils")

    folder = write_peft(LoraAdapter(CONFIG, tensors()), tmp_path / "adapter")
    helper = peft_helper.PEFTHelper.from_local_dir(str(folder), max_position_embeddings=None)
    assert (helper.r, helper.vllm_lora_scaling_factor) == (2, 2.0)
    assert helper._validate_features() == []
    name, is_a = utils.parse_fine_tuned_lora_name(f"base_model.model.{Q}.lora_A.weight")
    assert (name, is_a) == (Q, True)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_rank": 4}, "max_rank=4: vLLM takes one of"),
        ({"max_rank": 0}, "max_rank=0"),
        ({"slots": 0}, "slots=0"),
        ({"slots": 1.5}, "slots=1.5"),
    ],
)
def test_bad_slots(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(LoraError, match=words):
        LoraSlots(**kwargs)


def test_check_servable() -> None:
    adapter = LoraAdapter(CONFIG, tensors())
    assert check_servable(LoraSlots(max_rank=8), adapter, "E") is adapter
    with pytest.raises(LoraError, match="E was started without LoRA"):
        check_servable(None, adapter, "E")
    with pytest.raises(LoraError, match="rank 2 is above the engine's max_rank 1"):
        check_servable(LoraSlots(max_rank=1), adapter, "E")
    with pytest.raises(LoraError, match="expected a LoraAdapter, got dict"):
        check_servable(LoraSlots(), {}, "E")


def test_adapter_names_are_unique_per_registration() -> None:
    assert adapter_name(3, 1) != adapter_name(3, 2)
    assert adapter_name(3, 1) == "asyncroll-v3-1"


async def test_sim_engine_takes_an_adapter() -> None:
    """A simulation: the adapter is counted and the version stamped, nothing is applied."""
    from asyncroll.engines.sim import SimEngine

    engine = SimEngine()
    await engine.update_weights(LoraAdapter(CONFIG, tensors()), version=4)
    assert (engine.adapter_updates, engine.version) == (1, 4)
    await engine.close()


class Workers:
    """vLLM's `AsyncLLM` as `AdapterSet` sees it: an RPC, once sent, runs in the workers
    whatever its caller does; `asyncroll_add_lora` answers once `answer` is set."""

    def __init__(self) -> None:
        self.sent: list[asyncio.Future[Any]] = []
        self.adding = asyncio.Event()
        self.answer = asyncio.Event()
        self.added: list[int] = []
        self.removed: list[int] = []

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> Any:
        work = asyncio.ensure_future(self._run(method, args))
        self.sent.append(work)
        return await asyncio.shield(work)

    async def _run(self, method: str, args: tuple[Any, ...]) -> list[str]:
        if method == "asyncroll_add_lora":
            self.adding.set()
            await self.answer.wait()
            self.added.append(args[0])
        return [""]

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True


async def test_a_registration_cut_by_its_caller_leaves_no_adapter_in_the_workers(
    tmp_path: Path,
) -> None:
    """vLLM's workers add an adapter once asked, whether the answer is awaited or not. A
    `register` cancelled meanwhile (the producer's update deadline) left an adapter in the
    workers that the engine did not know: it held one of vLLM's `max_loras` slots for good.
    Now the cancelled call waits for the answer and removes what was added, then the
    cancellation goes on; the engine serves what it served before."""
    from asyncroll.engines.vllm.lora import AdapterSet

    async def call(awaitable: Any) -> Any:
        return await awaitable

    workers = Workers()
    adapters = AdapterSet(workers, call, "the engine", tmp_path)
    register = asyncio.ensure_future(adapters.register(LoraAdapter(CONFIG, tensors()), 1, 0))
    await asyncio.wait_for(workers.adding.wait(), 10.0)
    register.cancel()
    workers.answer.set()  # the workers answer after the caller gave up
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(register, 10.0)
    await asyncio.wait_for(asyncio.gather(*workers.sent), 10.0)
    assert workers.added == workers.removed == [1]
    assert adapters.policy is None and os.listdir(tmp_path) == []


def test_the_workers_lora_targets_name_top_level_modules_without_a_dot() -> None:
    """vLLM's LoRA layers by name, a packed one standing for what it packs; a top-level
    module (lm_head) once came out as ".lm_head" and was then "missing" from its own list."""
    from asyncroll.engines.vllm.in_worker import _lora_modules

    modules = {"lm_head": 0, "model.layers.0.self_attn.qkv_proj": 0}
    assert _lora_modules(modules, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}) == {
        "lm_head",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj",
    }
