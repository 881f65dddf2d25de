"""`weight_check.check`: how a worker's reload report is judged in the trainer's process (the
reports are fabricated here; tests/vllm/test_verify_weights.py has real workers)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from asyncroll.engines.vllm import weight_check  # noqa: E402
from asyncroll.engines.vllm.weight_check import WeightMismatchError  # noqa: E402

SENT = [("a.weight", torch.arange(6.0).reshape(2, 3)), ("b.bias", torch.ones(3))]


def report(**changes: Any) -> dict[str, Any]:
    good = {
        "expected": ["RotaryEmbedding"],
        "unloaded": [],
        "missing": [],
        "received": weight_check.digests(SENT),
        "mismatched": [],
        "unchecked": [],
    }
    return {**good, **changes}


def test_a_report_of_what_was_sent_passes() -> None:
    weight_check.check([report(), report()], weight_check.digests(SENT), "replica X")


def test_a_digest_is_of_the_bytes() -> None:
    same, other = weight_check.digest(torch.ones(3)), weight_check.digest(torch.ones(3) * 1.0001)
    assert same == weight_check.digest(torch.ones(3)) != other
    assert weight_check.digest(torch.ones(3)) != weight_check.digest(torch.ones(3).double())


def test_a_bfloat16_tensor_has_a_digest() -> None:
    """A GPU model serves bfloat16, which numpy has no type for: the digest raised TypeError
    ("Got unsupported ScalarType BFloat16"), in the trainer's process and in the worker."""
    one = torch.ones(3, dtype=torch.bfloat16)
    assert weight_check.digest(one) == weight_check.digest(one.clone())
    assert weight_check.digest(one) != weight_check.digest(one * 2)
    assert weight_check.digest(one) != weight_check.digest(one.half())


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (
            {"received": {"a.weight": weight_check.digests(SENT)["a.weight"]}},
            "not received: b.bias",
        ),
        ({"received": {**weight_check.digests(SENT), "b.bias": "0" * 64}}, "other bytes: b.bias"),
        ({"missing": ["c.weight"]}, "missing from the update: c.weight"),
        ({"unloaded": ["RowParallelLinear"]}, "no tensor reached layer(s): RowParallelLinear"),
        ({"mismatched": ["a.weight (output off by 1e-01)"]}, "not served as sent: a.weight"),
    ],
)
def test_each_problem_names_the_replica_and_the_tensor(changes: dict[str, Any], named: str) -> None:
    """A stub worker that misses a tensor, reports another checksum, or serves other values."""
    with pytest.raises(WeightMismatchError, match="replica X: ") as caught:
        weight_check.check([report(**changes)], weight_check.digests(SENT), "replica X")
    assert named in str(caught.value)


def test_reports_without_digests_or_not_reports_fail() -> None:
    bare = {k: v for k, v in report().items() if k != "received"}
    with pytest.raises(WeightMismatchError, match="no digests"):
        weight_check.check([bare], weight_check.digests(SENT), "e")
    with pytest.raises(WeightMismatchError, match="not a reload report"):
        weight_check.check(["oops"], None, "e")
    with pytest.raises(WeightMismatchError, match="no worker reported"):
        weight_check.check([], None, "e")
    weight_check.check([bare], None, "e")  # not verifying: coverage only


def test_long_lists_are_cut() -> None:
    names = [f"t{i}" for i in range(20)]
    with pytest.raises(WeightMismatchError, match="and 12 more"):
        weight_check.check([report(missing=names)], None, "e")


def served_layout(tmp_path: Any) -> dict[str, weight_check.Layout]:
    from safetensors.torch import save_file

    save_file(
        {"q.weight": torch.zeros(4, 3), "norm.weight": torch.zeros(3, dtype=torch.bfloat16)},
        str(tmp_path / "model.safetensors"),
    )
    layout = weight_check.checkpoint_layout(str(tmp_path))
    assert layout == {"q.weight": ((4, 3), "F32"), "norm.weight": ((3,), "BF16")}
    return layout


def test_an_update_of_the_served_shapes_and_float_dtypes_passes(tmp_path: Any) -> None:
    """Any 16-64-bit float goes (vLLM casts it to the served dtype); names the checkpoint
    lacks are not its business (a tied head a state_dict lists, say)."""
    named = [
        ("q.weight", torch.zeros(4, 3, dtype=torch.float64)),
        ("norm.weight", torch.zeros(3)),
        ("lm_head.weight", torch.zeros(9, 3)),
    ]
    weight_check.check_layout(named, served_layout(tmp_path), "engine X")
    weight_check.check_layout(named, None, "engine X")  # a hub id: nothing to check against


@pytest.mark.parametrize(
    ("tensor", "words"),
    [
        (torch.zeros(3, 4), r"q.weight has shape \(3, 4\); the served checkpoint's is \(4, 3\)"),
        (torch.zeros(4), r"q.weight has shape \(4,\)"),
        (torch.zeros(4, 3, dtype=torch.int64), "q.weight is torch.int64; the served .* F32"),
        (torch.zeros(4, 3).to(torch.float8_e4m3fn), "q.weight is torch.float8_e4m3fn"),
    ],
)
def test_an_update_the_model_cannot_take_is_refused_naming_the_tensor(
    tmp_path: Any, tensor: Any, words: str
) -> None:
    """A wrong shape reaching vLLM's reload resizes the parameter and fails every later
    update too: refused before anything is sent, every bad tensor named."""
    named = [("norm.weight", torch.zeros(5)), ("q.weight", tensor)]
    with pytest.raises(weight_check.WeightLayoutError, match=words) as refused:
        weight_check.check_layout(named, served_layout(tmp_path), "engine X")
    assert str(refused.value).startswith("engine X: ")
    assert r"norm.weight has shape (5,)" in str(refused.value)
    assert "nothing was loaded" in str(refused.value)


def test_the_reload_report_catches_unloaded_layers_whatever_vllms_log_level() -> None:
    """Importing trl sets VLLM_LOGGING_LEVEL=ERROR, and the workers vLLM spawns afterwards drop
    the "<Layer>: Failed to load weights" warnings before any filter sees them: an update that
    left a layer without weights passed the coverage check in the full suite (and the DEBUG
    report of expected layers was empty). Caught now at any level, the level set back after."""
    import logging

    from asyncroll.engines.vllm import in_worker

    logger = logging.getLogger(in_worker._LAYERWISE_LOGGER)
    saved = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with in_worker._unloaded_layers() as caught:
            logger.warning("%s: Failed to load weights", "RowParallelLinear")
            logger.warning("unrelated")
        assert caught.layers == ["RowParallelLinear"]
        assert logger.level == logging.ERROR and not logger.filters
    finally:
        logger.setLevel(saved)


def mistral_folder(tmp_path: Any, *, index: bool) -> Any:
    """A model folder laid out as Mistral's repos are: the Hugging Face tensors (sharded, with
    `model.safetensors.index.json`, or one file) and a second copy of them under Mistral's own
    names in `consolidated.safetensors`. vLLM loads one copy, never both."""
    import json

    from safetensors.torch import save_file

    hf = {"model.embed_tokens.weight": torch.zeros(8, 3), "model.norm.weight": torch.zeros(3)}
    if index:
        save_file({"model.embed_tokens.weight": hf["model.embed_tokens.weight"]},
                  str(tmp_path / "model-00001-of-00002.safetensors"))  # fmt: skip
        save_file({"model.norm.weight": hf["model.norm.weight"]},
                  str(tmp_path / "model-00002-of-00002.safetensors"))  # fmt: skip
        weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                      "model.norm.weight": "model-00002-of-00002.safetensors"}  # fmt: skip
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": weight_map})
        )
        save_file({"stale.weight": torch.zeros(1)}, str(tmp_path / "model-old.safetensors"))
    else:
        save_file(hf, str(tmp_path / "model.safetensors"))
    save_file({"tok_embeddings.weight": torch.zeros(8, 3), "norm.weight": torch.zeros(3)},
              str(tmp_path / "consolidated.safetensors"))  # fmt: skip
    return tmp_path


@pytest.mark.parametrize("index", [True, False], ids=["sharded-with-index", "one-file"])
def test_a_mistral_layout_requires_the_copy_the_update_names(tmp_path: Any, index: bool) -> None:
    """Coverage asked for the tensors of every *.safetensors file: both copies (and, with an
    index, a file the index does not name), so an update of the served weights themselves
    could never pass. It is the one copy in the names an update carries."""
    folder = str(mistral_folder(tmp_path, index=index))
    want = {"model.embed_tokens.weight", "model.norm.weight"}
    assert weight_check.checkpoint_names(folder) == want
    layout = weight_check.checkpoint_layout(folder)
    assert layout is not None and set(layout) == want


def test_a_consolidated_only_folder_is_its_own_copy(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    save_file({"norm.weight": torch.zeros(3)}, str(tmp_path / "consolidated.safetensors"))
    assert weight_check.checkpoint_names(str(tmp_path)) == {"norm.weight"}


@pytest.mark.parametrize("prefix", ["_orig_mod.", "module.", "module._orig_mod."])
def test_an_update_whose_names_all_miss_is_refused_naming_the_prefix(
    tmp_path: Any, prefix: str
) -> None:
    """`torch.compile` (`_orig_mod.`) or DDP (`module.`) put a prefix on every name: nothing of
    the update would load, and the engine would refuse to generate after it. Refused before
    anything is sent, naming the prefix to strip."""
    named = [(prefix + "q.weight", torch.zeros(4, 3)), (prefix + "norm.weight", torch.zeros(3))]
    with pytest.raises(weight_check.WeightLayoutError) as refused:
        weight_check.check_layout(named, served_layout(tmp_path), "engine X")
    message = str(refused.value)
    assert message.startswith("engine X: ") and "nothing was loaded" in message
    assert f"start with {prefix!r}" in message and "'q.weight'" in message, message


def test_names_that_miss_with_no_common_prefix_are_refused_too(tmp_path: Any) -> None:
    named = [("encoder.q.weight", torch.zeros(4, 3)), ("other", torch.zeros(3))]
    with pytest.raises(weight_check.WeightLayoutError, match="none of the 2 tensors"):
        weight_check.check_layout(named, served_layout(tmp_path), "engine X")


class _Watched(torch.Tensor):  # type: ignore[misc]
    """A received tensor that records the largest float32 tensor any operation on it (or on
    what was made from it) produced: the served-value probe's scratch."""

    largest = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            _Watched.largest = max(_Watched.largest, out.nelement() * 4)
        return out


class _Linear(torch.nn.Module):
    """A served linear layer whose kernel (`quant_method.apply`) computes with `served`."""

    def __init__(self, served: Any) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(served, requires_grad=False)
        self.quant_method = self

    def apply(self, layer: Any, x: Any, bias: Any) -> Any:
        return torch.nn.functional.linear(x, self.weight)


def test_the_probe_holds_a_bounded_block_of_float32_weight_not_the_whole_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.34 caps torch's GPU memory beside its extensible KV cache, and the check runs
    after the reload, under the cap: it made a float32 copy of each probed layer, 4 bytes per
    parameter (twice that while the shards were joined), 2.2 GB for a 7B model's output
    head. Now the reference runs a block of rows at a time, within `PROBE_SCRATCH_BYTES`, and
    still tells a served layer that computes what was sent from one that does not."""
    monkeypatch.setattr(weight_check, "PROBE_SCRATCH_BYTES", 4 * 64 * 8, raising=False)  # 8 rows
    generator = torch.Generator().manual_seed(1)
    shards = [torch.randn(rows, 64, generator=generator).bfloat16() for rows in (40, 24)]
    served = torch.cat(shards).float()
    watched = [s.as_subclass(_Watched) for s in shards]
    _Watched.largest = 0
    ok = weight_check._probe(_Linear(served), watched, [], torch.float32, torch.Generator())
    assert ok is None
    assert _Watched.largest <= 4 * 64 * 8, _Watched.largest  # a block, not 4 * 64 * 64 bytes
    stale = served.clone()
    stale[30] += 0.05  # one row a training step off
    off = weight_check._probe(_Linear(stale), watched, [], torch.float32, torch.Generator())
    assert off is not None and off.startswith("output off by")


def test_a_parameter_is_compared_after_a_cast_on_the_host() -> None:
    """The received tensor is cast to the served dtype on the host, not beside the model."""
    model = torch.nn.Linear(4, 3, bias=False).to(torch.bfloat16)
    sent = model.weight.detach().float().as_subclass(_Watched)
    _Watched.largest = 0
    casts: list[str] = []
    original = _Watched.to

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        casts.append(str(args[0] if args else kwargs))
        return original(self, *args, **kwargs)

    _Watched.to = to  # type: ignore[method-assign]
    try:
        mismatched, _ = weight_check.served_mismatches(
            model, {"weight": sent}.get, {"weight"}, {}, 2
        )
    finally:
        _Watched.to = original  # type: ignore[method-assign]
    assert mismatched == [] and casts[0] == "cpu"
