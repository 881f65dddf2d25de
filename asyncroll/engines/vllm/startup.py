"""What `VLLMEngine` starts vLLM with: the caller's engine arguments checked (refused with what
to set instead) and completed with the defaults the engine relies on, the vLLM version it
needs, and the environment of the processes vLLM starts. Kept apart from the engine because it
all happens once, before anything runs, and none of it touches a running engine.
"""

from __future__ import annotations

import contextlib
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from asyncroll.launcher_env import launcher_variables
from asyncroll.lora import LoraSlots

EXTENSION = "asyncroll.engines.vllm.in_worker.WeightLoaderExtension"
LORA_ARGS = frozenset({"enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"})

Transfer = Literal["auto", "file", "cuda_ipc"]


def engine_arguments(
    engine_args: dict[str, Any],
    *,
    stream_interval: int | None,
    transfer: Transfer,
    generate_timeout_s: float,
    control_timeout_s: float,
    lora: LoraSlots | None,
    on_cpu: bool,
) -> dict[str, Any]:
    """Check the engine's own options and the caller's `engine_args` (`ValueError` naming
    what to change) and return `engine_args` (changed in place) with the engine's defaults
    filled in (see `VLLMEngine`)."""
    if stream_interval is not None and stream_interval < 1:
        raise ValueError(f"stream_interval={stream_interval}: must be >= 1 (or None)")
    if transfer not in ("auto", "file", "cuda_ipc"):
        raise ValueError(f"transfer={transfer!r}: use 'auto', 'file' or 'cuda_ipc'")
    if generate_timeout_s <= 0 or control_timeout_s <= 0:
        raise ValueError("generate_timeout_s and control_timeout_s must be > 0")
    if lora is not None and not isinstance(lora, LoraSlots):
        raise ValueError(f"lora={lora!r}: give a LoraSlots(max_rank=..., slots=...) or None")
    given = sorted(LORA_ARGS & engine_args.keys())
    if given:
        raise ValueError(f"{', '.join(given)}: set LoRA with lora=LoraSlots(...) instead")
    if lora is not None:
        engine_args.update(
            enable_lora=True,
            max_lora_rank=lora.max_rank,
            max_loras=lora.slots,
            max_cpu_loras=lora.slots,  # the engine unloads adapters itself
        )
    extension = engine_args.setdefault("worker_extension_cls", EXTENSION)
    if extension != EXTENSION:
        raise ValueError(
            f"worker_extension_cls={extension!r}: VLLMEngine loads weights through "
            f"{EXTENSION}; leave worker_extension_cls unset"
        )
    engine_args.setdefault("skip_tokenizer_init", True)
    # The sampled token's logprob under the distribution that sampled it (temperature, top-k,
    # top-p applied), not vLLM's default raw model logprob: the behaviour policy of
    # importance weighting. The trainer matches it with `token_logprobs(temperature=...)`.
    engine_args.setdefault("logprobs_mode", "processed_logprobs")
    engine_args.setdefault("disable_log_stats", True)
    if on_cpu:
        engine_args.setdefault("enforce_eager", True)
        # vLLM's CPU "auto" dtype turns float32 checkpoints into bfloat16, whose AMX kernels
        # die with SIGILL on VMs that do not grant AMX state (seen on this project's machines).
        engine_args.setdefault("dtype", "float32")
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            engine_args.setdefault("kv_cache_memory_bytes", 128 << 20)
    return engine_args


def visible_devices(
    devices: Sequence[int | str] | None, engine_args: dict[str, Any], *, on_cpu: bool
) -> str | None:
    """`CUDA_VISIBLE_DEVICES` for vLLM's processes from the engine's `devices` (None: they see
    what this process sees), refused when it cannot be what the caller meant: on a CPU build,
    an id twice, fewer GPUs than the engine's parallelism needs, or the GPU this process's own
    torch uses (a trainer's rank and vLLM on one GPU compete for its memory: give the engine
    the others, or leave `devices` unset and set `trainer_headroom_bytes`)."""
    if devices is None:
        return None
    if isinstance(devices, (str, int)):
        raise ValueError(f"devices={devices!r}: give a list of GPU ids, e.g. devices=[4, 5]")
    names = [str(d).strip() for d in devices]
    if on_cpu:
        raise ValueError(
            f"devices={list(devices)}: GPU ids, and this vLLM runs on the CPU; leave devices unset"
        )
    bad = [n for n in names if not (n.isdigit() or n.startswith(("GPU-", "MIG-")))]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(
            f"devices={list(devices)}: give distinct GPU indices as the machine numbers them "
            "(nvidia-smi), or GPU-/MIG- UUIDs"
        )
    needed = int(engine_args.get("tensor_parallel_size", 1)) * int(
        engine_args.get("pipeline_parallel_size", 1)
    )
    if len(names) < needed:
        raise ValueError(
            f"devices={list(devices)}: {len(names)} GPU(s) for tensor_parallel_size x "
            f"pipeline_parallel_size = {needed}; give {needed}"
        )
    own = own_device()
    if own is not None and own in names:
        raise ValueError(
            f"devices={list(devices)}: GPU {own} is the one this process's torch uses (its "
            "trainer's); give vLLM the GPUs the trainer does not use"
        )
    return ",".join(names)


def own_device() -> str | None:
    """The machine's id of the GPU this process's torch works on, once it has started CUDA
    (a trainer rank's `torch.cuda.set_device`); None before, or without CUDA."""
    import torch

    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    index = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    return ids[index] if index < len(ids) else None


def require_vllm(version: str) -> None:
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) < (0, 32):
        raise RuntimeError(
            f"VLLMEngine needs vllm >= 0.32 (weight version spans, keep-mode pause); "
            f"found {version}"
        )


def experts_row_bytes(config: Any) -> int:
    """Bytes of routed experts per generated token: layers x top-k expert ids, one byte each
    up to 256 experts, two above."""
    model = config.model_config
    experts = int(model.get_num_experts())
    per_token = int(model.get_total_num_hidden_layers()) * int(model.get_num_experts_per_tok())
    return per_token * (1 if experts <= 256 else 2)


@contextlib.contextmanager
def child_environment(on_cpu: bool, devices: str | None = None) -> Iterator[None]:
    """Environment for the processes vLLM starts while the engine is built, restored after.

    The workers import `asyncroll.engines.vllm.in_worker`. An installed asyncroll is found by any
    Python of the same environment; for a source checkout (found through `sys.path` or
    PYTHONPATH) the folder holding the package is put first on PYTHONPATH. Processes started
    by multiprocessing (vLLM's default) would get this process's `sys.path` anyway; the
    variable covers workers started any other way. On CPU, TORCH_COMPILE_DISABLE=1 skips the
    8-17 s gcc compile vLLM's logprobs op would do on its first request, at no measurable speed
    cost. Neither variable is left changed in this process.

    A launcher's variables (`launcher_env`: torchrun's RANK, WORLD_SIZE, MASTER_PORT, ...) are
    taken out while vLLM starts its processes and put back afterwards: vLLM would read them as
    its own rank and rendezvous. `devices` (from `visible_devices`) becomes their
    `CUDA_VISIBLE_DEVICES`: vLLM's checks in this process read it there too.
    """
    root = str(Path(__file__).resolve().parents[3])
    installed = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    hidden = launcher_variables(os.environ)
    names = ("PYTHONPATH", "TORCH_COMPILE_DISABLE", "CUDA_VISIBLE_DEVICES", *hidden)
    saved = {k: os.environ.get(k) for k in names}
    for name in hidden:
        del os.environ[name]
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    paths = [p for p in (saved["PYTHONPATH"] or "").split(os.pathsep) if p]
    if root not in paths and root not in installed:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    if on_cpu:
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
