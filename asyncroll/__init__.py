"""asyncroll: an async, single-node RL rollout engine for LLM post-training, without Ray.

A `Producer` drives an `Engine` (vLLM in this process, or the `SimEngine` simulation) from
asyncio tasks and keeps a bounded `RolloutBuffer` of encoded `RolloutGroup`s that the trainer
takes with `produce_batch`. Failed, filtered and expired groups are dropped on arrival and
counted on the producer (`ProduceProgress`).
"""

from importlib import metadata as _metadata

from asyncroll import codec, filters
from asyncroll._core.causes import FailureCause
from asyncroll._core.progress import ProduceBatchResult, ProduceProgress, ProgressCounters
from asyncroll._core.state import CheckpointError, ProducerState
from asyncroll.buffer import BufferStats, PutOutcome, RolloutBuffer
from asyncroll.config import ProducerConfig
from asyncroll.engines import (
    Engine,
    EngineDeadError,
    EngineDefaults,
    SamplingConfig,
    SimConfig,
    SimEngine,
)
from asyncroll.episode import Episode, EpisodeError, RolloutFn, Turn, single_turn
from asyncroll.evaluation import EvalResult, Evaluator
from asyncroll.producer import (
    DropRecord,
    Ledger,
    LedgerError,
    Producer,
    ProducerError,
    ProducerExhausted,
    RewardFn,
    StalledError,
)
from asyncroll.prompts import TaskMix
from asyncroll.types import Prompt, RolloutGroup, RolloutState, Status, group_status

try:
    __version__ = _metadata.version("asyncroll")
except _metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH, not installed
    __version__ = "0+unknown"

__all__ = [
    "BufferStats",
    "CheckpointError",
    "DropRecord",
    "Engine",
    "EngineDeadError",
    "EngineDefaults",
    "Episode",
    "EpisodeError",
    "EvalResult",
    "Evaluator",
    "FailureCause",
    "Ledger",
    "LedgerError",
    "ProduceBatchResult",
    "ProduceProgress",
    "Producer",
    "ProducerConfig",
    "ProducerError",
    "ProducerExhausted",
    "ProducerState",
    "ProgressCounters",
    "Prompt",
    "PutOutcome",
    "RewardFn",
    "RolloutBuffer",
    "RolloutFn",
    "RolloutGroup",
    "RolloutState",
    "SamplingConfig",
    "SimConfig",
    "SimEngine",
    "StalledError",
    "Status",
    "TaskMix",
    "Turn",
    "__version__",
    "codec",
    "filters",
    "group_status",
    "single_turn",
]
