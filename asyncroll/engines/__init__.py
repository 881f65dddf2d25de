"""Generation backends. `VLLMEngine` is imported on first use: importing vLLM takes seconds."""

from typing import TYPE_CHECKING, Any

from asyncroll.engines.base import (
    Engine,
    EngineDeadError,
    GenerateRequest,
    SampleOutput,
    SampleRequest,
    SamplingConfig,
    Weights,
)
from asyncroll.engines.sim import SimConfig, SimEngine, SimEngineError

if TYPE_CHECKING:
    from asyncroll.engines.vllm import VLLMEngine

__all__ = [
    "Engine",
    "EngineDeadError",
    "GenerateRequest",
    "SampleOutput",
    "SampleRequest",
    "SamplingConfig",
    "SimConfig",
    "SimEngine",
    "SimEngineError",
    "VLLMEngine",
    "Weights",
]


def __getattr__(name: str) -> Any:
    if name == "VLLMEngine":
        from asyncroll.engines.vllm import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
