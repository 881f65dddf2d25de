"""vLLM worker extension: loads new weights inside each vLLM worker process.

Runs inside vLLM's worker processes (spawned by vLLM: the in-process engine's, and each
`vllm serve` replica's), never in the trainer's process; the trainer only names it.

vLLM mixes this class into its worker class (`worker_extension_cls`; `vllm serve
--worker-extension-cls`), so its methods run in the worker processes and are called with
`collective_rpc` (over HTTP: `/collective_rpc`). Both engines load weights through it. It
must stay importable without vLLM running in this process and must not import anything heavy
at module level: every worker imports it at start-up.

Weights are loaded with the worker's `reload_weights(weights_iterator=...)`, not with
`model.load_weights`: after start-up the CPU backend has repacked its linear weights for its
kernels (their parameters have shape 0), and `reload_weights` is the path that re-runs the
loader's processing. It is the same call on GPU.

vLLM warns "<Layer>: Failed to load weights" for every layer that received no tensor during a
reload (and keeps its previous weights). Two such layers are expected on every update and say
nothing: layers with buffers but no parameters (RotaryEmbedding's cos/sin cache, computed from
the config, in no checkpoint) and an output layer tied to the input embedding (it gets no tensor
of its own; `_asyncroll_refresh_tied_head` repacks it from the reloaded embedding). Those two are
silenced; any other layer is reported back to the engine, which fails the update naming it
(the trainer's weights lack that layer or name it differently), as it does for a tensor of the
served checkpoint the update lacked (a layer loaded in part is no "Failed" layer). What is
checked, and what `verify` adds, is in `asyncroll.engines.vllm.weight_check`.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_PROCESS = uuid.uuid4().hex
"""This process's identity, new with every start (each worker imports this module once):
`VLLMServerEngine` reads it before a replica loads weights and after it labels them, and a
replica whose identity changed in between (restarted) serves its own weights, not the ones
the label names."""

_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_FAILED = ": Failed to load weights"


class _UnloadedLayers(logging.Filter):
    """Catches vLLM's "<Layer>: Failed to load weights" records during one reload."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.endswith(_FAILED):
            self.layers.append(message.removesuffix(_FAILED))
            return False
        return True


@contextlib.contextmanager
def _unloaded_layers() -> Iterator[_UnloadedLayers]:
    """Catch vLLM's unloaded-layer warnings during one reload, whatever vLLM's log level: a
    process that imported trl, say, starts vLLM with VLLM_LOGGING_LEVEL=ERROR, and a warning
    below the logger's level never reaches a filter. The level is set back afterwards."""
    caught = _UnloadedLayers()
    logger = logging.getLogger(_LAYERWISE_LOGGER)
    level = logger.level
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    logger.addFilter(caught)
    try:
        yield caught
    finally:
        logger.removeFilter(caught)
        logger.setLevel(level)


class WeightLoaderExtension:
    """Methods vLLM adds to its worker. Names carry an `asyncroll_` prefix because vLLM refuses
    an extension attribute that the worker class already has."""

    def asyncroll_process(self) -> str:
        """This worker process's identity (`_PROCESS`): a restarted replica answers another."""
        return _PROCESS

    def asyncroll_load_path(self, path: str, verify: bool = False) -> dict[str, Any]:
        """Load every tensor of a safetensors file, or of every *.safetensors file in a
        folder: `VLLMEngine` writes one file to /dev/shm (reading it is a memory copy, not
        disk I/O), `VLLMServerEngine` a folder every replica reads (`/collective_rpc`, whose
        JSON kwargs arrive here as they were sent). Returns `_asyncroll_reload`'s report."""
        from asyncroll.engines.vllm.weight_check import SafetensorsSource

        source = SafetensorsSource(Path(path))
        return self._asyncroll_reload(source.items(), source.get if verify else None)

    def asyncroll_load_cuda_ipc(self, payload: bytes, verify: bool = False) -> dict[str, Any]:
        """Load tensors the trainer's process shared with CUDA IPC: `payload` pickles the
        names and `reduce_tensor` arguments of each (pickled by us, in the trainer's process,
        because vLLM's RPC encoding does not carry classes and dtypes). The device index in
        each handle is the sender's; it is replaced by this worker's device, which must be the
        same physical GPU."""
        import pickle

        import torch
        from torch.multiprocessing import reductions

        rebuild_cuda_tensor: Any = reductions.rebuild_cuda_tensor
        names, handles = pickle.loads(payload)
        device = torch.cuda.current_device()

        tensors = {}
        for name, args in zip(names, handles, strict=True):
            fixed = list(args)
            fixed[6] = device  # position of the device index in reduce_tensor's args
            tensors[name] = rebuild_cuda_tensor(*fixed)  # a view of the sender's memory
        report = self._asyncroll_reload(iter(tensors.items()), tensors.get if verify else None)
        torch.cuda.synchronize()
        return report

    def _asyncroll_reload(
        self, weights: Iterator[tuple[str, Any]], fetch: Callable[[str], Any] | None
    ) -> dict[str, Any]:
        """Reload, refresh a tied head, and report (see `asyncroll.engines.vllm.weight_check`):
        the layers vLLM loaded nothing into, split into `expected` (see the module docstring)
        and `unloaded` (a problem); the served checkpoint's tensors the update lacked
        (`missing`); with `fetch` (verification on: it reads a received tensor again by
        name), the digest of each tensor as received and the tensors the model does not serve
        as received (`mismatched`)."""
        from asyncroll.engines.vllm import weight_check

        received: dict[str, str] = {}

        def recorded() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                received[name] = weight_check.digest(tensor) if fetch is not None else ""
                yield name, tensor

        with _unloaded_layers() as caught:
            self.reload_weights(weights_iterator=recorded())  # type: ignore[attr-defined]
        tied = self._asyncroll_refresh_tied_head()
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        computed = {
            type(m).__name__
            for m in model.modules()
            if not any(p is not None for p in m._parameters.values())
            and any(b is not None for b in m._buffers.values())
        }
        expected = computed | ({tied} if tied else set())
        served = weight_check.required_names(
            self.model_runner.get_model(),  # type: ignore[attr-defined]
            self.model_config.model,  # type: ignore[attr-defined]
        )
        report: dict[str, Any] = {
            "expected": sorted({n for n in caught.layers if n in expected}),
            "unloaded": sorted({n for n in caught.layers if n not in expected}),
            "missing": sorted(served - received.keys()) if served is not None else [],
        }
        if fetch is not None:
            report.update(received=received, **self._asyncroll_served(set(received), fetch))
        return report

    def asyncroll_verify_path(self, path: str) -> dict[str, Any]:
        """Check, without loading anything, that the model serves the tensors of a
        safetensors file or folder: the served-value check of a verified reload, for weights
        that came some other way (vLLM's own `reload_weights`, a restart)."""
        from asyncroll.engines.vllm import weight_check

        source = weight_check.SafetensorsSource(Path(path))
        received = {name: weight_check.digest(t) for name, t in source.items()}
        served = weight_check.required_names(
            self.model_runner.get_model(),  # type: ignore[attr-defined]
            self.model_config.model,  # type: ignore[attr-defined]
        )
        return {
            "missing": sorted(served - received.keys()) if served is not None else [],
            "received": received,
            **self._asyncroll_served(set(received), source.get),
        }

    def _asyncroll_served(self, names: set[str], fetch: Callable[[str], Any]) -> dict[str, Any]:
        from asyncroll.engines.vllm import weight_check

        mismatched, unchecked = weight_check.served_mismatches(
            self.model_runner.get_model(),  # type: ignore[attr-defined]
            fetch,
            names,
            getattr(self.model_runner.get_model(), "packed_modules_mapping", {}),  # type: ignore[attr-defined]
            int(self.parallel_config.tensor_parallel_size),  # type: ignore[attr-defined]
        )
        return {"mismatched": mismatched, "unchecked": unchecked}

    def asyncroll_lora_problem(self, modules: dict[str, list[int]], config: dict[str, Any]) -> str:
        """What keeps an adapter of `config` over `modules` (Hugging Face module path ->
        [out_features, in_features]) from being served here, or "": a rank or feature vLLM
        refuses, a module the model has no LoRA layer for (vLLM's loader would ignore it
        silently, serving another policy), or one whose shape is not the checkpoint's (it
        would fail inside vLLM's step, killing the engine)."""
        from vllm.lora.peft_helper import PEFTHelper

        from asyncroll.engines.vllm import weight_check

        manager = self.model_runner.lora_manager  # type: ignore[attr-defined]
        adapters = manager._adapter_manager
        helper = PEFTHelper.from_dict(
            dict(config, vllm_max_position_embeddings=manager.max_position_embeddings)
        )
        try:
            helper.validate_legal(manager.lora_config)
        except ValueError as exc:
            return str(exc)
        mapper = _rename_mapper(adapters.model)
        served = _lora_modules(adapters.modules, adapters.packed_modules_mapping)
        named = {(mapper._map_name(m) if mapper is not None else m) or m for m in modules}
        unknown = sorted(named - served)
        if unknown:
            leaves = sorted({m.rsplit(".", 1)[-1] for m in served})
            return f"the model has no LoRA layer {', '.join(unknown)} (its targets: {leaves})"
        embeddings = sorted(named & _embedding_modules(adapters.modules))
        if embeddings:
            return (
                f"the adapter targets {', '.join(embeddings)}, an embedding or the output "
                "head: asyncroll serves LoRA on linear layers only (vLLM would read such an "
                "adapter in another format and fail in its step); drop it from target_modules"
            )
        layout = weight_check.checkpoint_layout(self.model_config.model) or {}  # type: ignore[attr-defined]
        for module, shape in sorted(modules.items()):
            weight = layout.get(f"{module}.weight", (None,))[0]
            if weight is not None and list(weight) != list(shape):
                return (
                    f"the adapter's {module} maps {shape[1]} -> {shape[0]} features, but the "
                    f"model's {module}.weight has shape {tuple(weight)}"
                )
        return ""

    def asyncroll_add_lora(self, lora_id: int, path: str, config: dict[str, Any]) -> str:
        """Register a LoRA adapter under `lora_id`, for requests whose `LoRARequest` carries
        that id: `path` is a safetensors file of its tensors (PEFT's names; `VLLMEngine`
        writes it to /dev/shm, so reading it is a memory copy), `config` its
        adapter_config.json. vLLM's worker looks an adapter up by id before it would load one
        from the request's path, so no adapter folder is needed. A file, not safetensors bytes
        as an RPC argument: vLLM copies such bytes at each hop (msgpack to the engine core,
        pickle through its message queue to the worker, a socket for messages over 16 MiB),
        and 36.5 MiB took 0.3-1.8 s to arrive with ~180 MiB more RSS (benchmarks/README.md,
        lora_update.py). Returns "" once it is registered, else why not
        (`asyncroll_lora_problem`; nothing is registered then)."""
        from safetensors.torch import load_file
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.utils import parse_fine_tuned_lora_name

        tensors = load_file(path)
        modules: dict[str, list[int]] = {}
        for name, tensor in tensors.items():
            module, is_a = parse_fine_tuned_lora_name(name)
            modules.setdefault(module, [0, 0])[1 if is_a else 0] = int(tensor.shape[is_a])
        problem = self.asyncroll_lora_problem(modules, config)
        if problem:
            return problem
        manager = self.model_runner.lora_manager  # type: ignore[attr-defined]
        adapters = manager._adapter_manager
        if len(adapters.list_adapters()) >= adapters.capacity:  # it would evict one in use
            return f"all {adapters.capacity} adapter slots are taken"
        helper = PEFTHelper.from_dict(
            dict(config, vllm_max_position_embeddings=manager.max_position_embeddings)
        )
        lora = LoRAModel.from_lora_tensors(
            lora_id,
            tensors,
            helper,
            device="cpu",  # as vLLM's own loader: moved to the device when activated
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=_rename_mapper(adapters.model),
        )
        adapters.add_adapter(lora)
        return ""

    def asyncroll_lora_ids(self) -> list[int]:
        """The adapter ids registered in this worker (what the engine has not unloaded)."""
        return sorted(self.model_runner.lora_manager.list_adapters())  # type: ignore[attr-defined]

    def _asyncroll_refresh_tied_head(self) -> str | None:
        """Re-run the output layer's weight processing when it shares the input embedding.

        A tied `lm_head` receives no tensor of its own, so `reload_weights` leaves it alone;
        on CPU its processing made a packed copy of the weight for the GEMM kernel, which would
        keep serving the old embedding (vLLM 0.32: greedy tokens then differ from the new
        weights'). Processing it again repacks from the shared, now reloaded, weight; on GPU
        it is a no-op. Returns the head's class name when it is tied.
        """
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None)
        if head is None or weight is None:
            return None
        tied = any(m is not head and getattr(m, "weight", None) is weight for m in model.modules())
        if not tied:
            return None
        head.quant_method.process_weights_after_loading(head)
        return type(head).__name__


def _lora_modules(modules: dict[str, Any], packed: dict[str, list[str]]) -> set[str]:
    """The Hugging Face names of the modules an adapter can target: vLLM's LoRA layers, with
    a packed one (qkv_proj) standing for the modules it packs (q_proj, k_proj, v_proj)."""
    names: set[str] = set()
    for name in modules:
        parent, _, leaf = name.rpartition(".")
        names.update(f"{parent}.{sub}" if parent else sub for sub in packed.get(leaf, [leaf]))
    return names


def _rename_mapper(model: Any) -> Any:
    """The module renames vLLM's own adapter loader applies for `model` (None: none)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return None if mapper is None else mapper.get_rename_mapper()


def _embedding_modules(modules: dict[str, Any]) -> set[str]:
    """The names of vLLM's LoRA layers over an embedding or the output head (vLLM wraps them
    for PEFT's lora_embedding_A/B layout, which asyncroll's adapters are not)."""
    from vllm.lora.layers import LogitsProcessorWithLoRA
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return {
        name
        for name, module in modules.items()
        if isinstance(module, LogitsProcessorWithLoRA)
        or isinstance(getattr(module, "base_layer", None), VocabParallelEmbedding)
    }
