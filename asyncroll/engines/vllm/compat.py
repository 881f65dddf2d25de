"""What differs between the vLLM releases `VLLMEngine` supports, settled before vLLM starts.

Each rule here answers one change in vLLM that would otherwise break a guarantee silently
(`benchmarks/vllm_compat.py` checks every supported release's sources for them):

* `VLLM_RELOAD_MODE` (0.34): "direct" reloads weights without vLLM's per-layer bookkeeping,
  so it never logs "<Layer>: Failed to load weights", which the worker extension's
  unloaded-layer check reads: an update that missed a layer would pass. Refused.
* `VLLM_USE_V2_MODEL_RUNNER` (0.32, 0.33: opt-in on CPU; 0.34 removed Model Runner V1 and
  raises on any value but 1): left to vLLM, which says what to change.
* In-process data parallelism (`data_parallel_size > 1`): vLLM's `collective_rpc` answers
  with the first engine core's reports only (`DPLBAsyncMPClient.call_utility_async`), so the
  weight-report check would vouch for engine cores it never heard from. Refused: run one
  `vllm serve` replica per data-parallel rank with `VLLMServerEngine` instead.
* GPU memory (0.34 on CUDA): unless `kv_cache_memory_bytes` is set, vLLM sizes an
  "extensible" KV cache from all memory free after warm-up (`gpu_memory_utilization`
  defaults to 1.0 then) and caps its own torch allocations, and `reload_weights` refuses when
  less than the largest layer is free beside the cache (a paused engine keeps its cache
  unless the pause clears it). A trainer on the same GPU then competes for what vLLM took.
  `gpu_memory` sets `gpu_memory_utilization` from the trainer's and the reload's headroom,
  which every supported release honours.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

DEFAULT_RELOAD_HEADROOM_BYTES = 1 << 30
"""Device memory kept free for `reload_weights` beside vLLM's share when the caller gives no
`reload_headroom_bytes`: room for the largest layer of a 7-8B model in bfloat16 (its
embedding, 152k x 3584 x 2 bytes = 1.1 GB, is the largest tensor; give more above that)."""


def check_environment(env: Mapping[str, str] = os.environ) -> None:
    """Refuse a vLLM environment that would silence a check `VLLMEngine` relies on."""
    mode = env.get("VLLM_RELOAD_MODE", "layerwise")
    if mode == "direct":
        raise ValueError(
            "VLLM_RELOAD_MODE=direct: vLLM's direct reload does not report the layers an "
            "update left unloaded, which VLLMEngine checks on every update; unset "
            "VLLM_RELOAD_MODE (or set it to 'layerwise')"
        )


def refuse_data_parallel(engine_args: Mapping[str, Any]) -> None:
    """Refuse `data_parallel_size > 1` in process (see the module docstring)."""
    size = engine_args.get("data_parallel_size", 1)
    if size is not None and int(size) > 1:
        raise ValueError(
            f"data_parallel_size={size}: in process, vLLM returns the weight reports of its "
            "first engine core only, so VLLMEngine could not check that every data-parallel "
            "rank loaded an update; run one `vllm serve` replica per rank with "
            "VLLMServerEngine (asyncroll.engines.server) instead"
        )


def gpu_memory(
    engine_args: dict[str, Any],
    *,
    total_bytes: int,
    trainer_headroom_bytes: int,
    reload_headroom_bytes: int | None,
) -> dict[str, Any]:
    """Fill `gpu_memory_utilization` (in place) so that vLLM leaves `trainer_headroom_bytes`
    for the trainer's process on the same GPU and `reload_headroom_bytes` (None:
    `DEFAULT_RELOAD_HEADROOM_BYTES`) free for `reload_weights`, out of the device's
    `total_bytes`. A caller's own `gpu_memory_utilization` or `kv_cache_memory_bytes` is kept
    (together with a headroom it is refused: one of the two would be ignored)."""
    if trainer_headroom_bytes < 0 or (reload_headroom_bytes or 0) < 0:
        raise ValueError("trainer_headroom_bytes and reload_headroom_bytes must be >= 0")
    reload = (
        DEFAULT_RELOAD_HEADROOM_BYTES if reload_headroom_bytes is None else reload_headroom_bytes
    )
    own = sorted({"gpu_memory_utilization", "kv_cache_memory_bytes"} & engine_args.keys())
    if own:
        if trainer_headroom_bytes or reload_headroom_bytes is not None:
            raise ValueError(
                f"{', '.join(own)} and trainer_headroom_bytes/reload_headroom_bytes: give "
                "either vLLM's own memory setting or the headrooms, not both"
            )
        return engine_args
    share = 1.0 - (trainer_headroom_bytes + reload) / total_bytes
    if share < 0.05:
        raise ValueError(
            f"trainer_headroom_bytes={trainer_headroom_bytes} + reload_headroom_bytes="
            f"{reload} leave vLLM {max(share, 0):.1%} of this GPU's {total_bytes} bytes: "
            "lower them, or give the trainer another GPU"
        )
    engine_args["gpu_memory_utilization"] = round(share, 4)
    return engine_args
