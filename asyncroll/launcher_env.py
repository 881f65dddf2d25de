"""The variables a process launcher (torchrun, torch.distributed.elastic, accelerate, Slurm's
MPI glue) sets for the trainer's ranks, which vLLM's own processes must not inherit.

vLLM reads several of them itself: `RANK`, `LOCAL_RANK` and `WORLD_SIZE` make its workers
believe they are one rank of an external launcher's job, and `MASTER_ADDR` / `MASTER_PORT`
point its process group at the trainer's store. A vLLM engine started in rank 0 of a torchrun
job thus joined or waited on the trainer's rendezvous. Both engines build their processes'
environment through `without_launcher_variables`, so a trainer's job and vLLM's never share a
rank, a world or a port.
"""

from __future__ import annotations

from collections.abc import Mapping

LAUNCHER_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
    }
)
"""Set by torchrun for each rank (torch.distributed.elastic's `_set_worker_env`), by
accelerate's launcher, or by the trainer's own `init_process_group(init_method="env://")`."""

LAUNCHER_PREFIXES = ("TORCHELASTIC_",)


def launcher_variables(environ: Mapping[str, str]) -> list[str]:
    """The names in `environ` that belong to the trainer's launcher, sorted."""
    return sorted(
        name for name in environ if name in LAUNCHER_VARIABLES or name.startswith(LAUNCHER_PREFIXES)
    )


def without_launcher_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of `environ` without the launcher's variables."""
    hidden = set(launcher_variables(environ))
    return {name: value for name, value in environ.items() if name not in hidden}
