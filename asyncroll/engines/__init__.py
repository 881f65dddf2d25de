"""Generation backends. `VLLMEngine` and `VLLMServerEngine` are imported on first use:
importing vLLM takes seconds, and the server engine needs aiohttp (the `server` extra)."""

from typing import TYPE_CHECKING, Any

from asyncroll.engines.base import (
    Engine,
    EngineDeadError,
    EngineDefaults,
    GenerateRequest,
    SampleOutput,
    SampleRequest,
    SamplingConfig,
    Weights,
)
from asyncroll.engines.sim import SimConfig, SimEngine, SimEngineError
from asyncroll.engines.vllm.refusals import EnginePausedError

if TYPE_CHECKING:
    from asyncroll.engines.server.engine import VLLMServerEngine
    from asyncroll.engines.server.replicas import ReplicaError
    from asyncroll.engines.vllm.engine import VLLMEngine

__all__ = [
    "Engine",
    "EngineDeadError",
    "EngineDefaults",
    "EnginePausedError",
    "GenerateRequest",
    "ReplicaError",
    "SampleOutput",
    "SampleRequest",
    "SamplingConfig",
    "SimConfig",
    "SimEngine",
    "SimEngineError",
    "VLLMEngine",
    "VLLMServerEngine",
    "Weights",
]


def __getattr__(name: str) -> Any:
    if name == "VLLMEngine":
        from asyncroll.engines.vllm.engine import VLLMEngine

        return VLLMEngine
    if name == "VLLMServerEngine":
        from asyncroll.engines.server.engine import VLLMServerEngine

        return VLLMServerEngine
    if name == "ReplicaError":
        from asyncroll.engines.server.replicas import ReplicaError

        return ReplicaError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
