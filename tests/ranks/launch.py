"""torchrun for the CPU jobs of tests/test_ranks.py, with the jobs' imports made once a job.

`python tests/ranks/launch.py --nproc-per-node N --standalone tests/ranks/job.py ARGS` runs
torchrun's own `main` (`torch.distributed.run`: the same elastic agent, rendezvous, failure
handling and SIGTERM forwarding) with `--run-path --start-method=fork`: the ranks are forked
from this process, which has already imported torch and asyncroll (and, for the train
scenario, transformers' Llama), and run the script with `runpy` there. Each rank would
otherwise import them itself (~4 CPU-s a rank on 2 cores). The job script is unchanged:
`runpy` runs it as `__main__` with `sys.argv` set to the script and its arguments, as
torchrun's exec would.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed.fsdp
import torch.distributed.tensor
import torch.nn.parallel  # noqa: F401
from torch.distributed.run import main

import tests.ranks.job  # noqa: F401  (torch.distributed and asyncroll's modules)

if __name__ == "__main__":
    if "train" in sys.argv[1:]:  # the one scenario on transformers' Llama (its import: ~2 s)
        from transformers import LlamaForCausalLM  # noqa: F401
    main(["--run-path", "--start-method=fork", *sys.argv[1:]])
