"""A trainer killed with SIGTERM (what `kill`, Slurm, Kubernetes, systemd and torchrun send)
or SIGKILL (an OOM kill, torchrun 30 s after its SIGTERM) leaves no process behind: not
vLLM's engine core, not its workers, not the multiprocessing resource tracker.

Its own engine: a killed trainer must own its engine, so it is a fresh vLLM start in a trainer
process of its own, the only way to see what outlives the process that owned it. This module
sends SIGTERM; the SIGKILL of a process owning a real engine is tests/vllm/test_ranks_vllm.py's
(its rank 0 is killed with its engine running), which saves a second engine start.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

import psutil

from tests.vllm import trainer_to_kill

START_DEADLINE_S = 600.0  # a vLLM start on 2 loaded cores
GONE_DEADLINE_S = 60.0  # SIGTERM: the engine's close


def test_killed_trainer_leaves_no_process(tiny_model: object) -> None:
    ctx = multiprocessing.get_context("spawn")
    trainers = {}
    for sig in (signal.SIGTERM,):
        ours, theirs = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=trainer_to_kill.run, args=(str(tiny_model), theirs))
        proc.start()
        theirs.close()
        trainers[sig] = (proc, ours)
    below: dict[signal.Signals, list[tuple[psutil.Process, str]]] = {}
    try:
        for sig, (_proc, conn) in trainers.items():
            assert conn.poll(START_DEADLINE_S), f"trainer for {sig.name} never served"
            below[sig] = [(psutil.Process(pid), line) for pid, line in conn.recv()]
            assert any("EngineCore" in line for _, line in below[sig]), below[sig]
        for sig, (proc, _conn) in trainers.items():
            os.kill(proc.pid, sig)
        for sig, (proc, _conn) in trainers.items():
            proc.join(GONE_DEADLINE_S)
            assert proc.exitcode is not None, f"trainer still running after {sig.name}"
            _gone, alive = psutil.wait_procs([p for p, _ in below[sig]], GONE_DEADLINE_S)
            left = [line for p, line in below[sig] if p in alive]
            assert not left, f"after {sig.name} of the trainer, still running: {left}"
        closed = trainers[signal.SIGTERM][1]
        assert closed.poll(0) and closed.recv() == "closed", "SIGTERM did not close the engine"
    finally:
        for proc, _conn in trainers.values():
            proc.kill()
        for sig in below:
            for p, _ in below[sig]:
                if p.is_running():
                    p.kill()
