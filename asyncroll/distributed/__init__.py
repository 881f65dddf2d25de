"""A trainer over several ranks (torchrun or torch.multiprocessing; FSDP2 or DDP) beside the
producer: rank 0 owns the rollouts, every rank trains its share of each batch, and the
sharded weights reach rank 0's engine gathered bucket by bucket. Needs torch; never imports
vLLM (the other ranks do not need it). See docs/whole-machine.md.
"""

from asyncroll.distributed.gather import WRAPPER_PREFIXES, GatherStats, engine_name
from asyncroll.distributed.ranks import RankFailed, Ranks

__all__ = ["WRAPPER_PREFIXES", "GatherStats", "RankFailed", "Ranks", "engine_name"]
