"""Hostile verifiers for the process executor's tests (`tests/test_reward_processes.py`), in a
module of their own that imports little: each worker process imports it to load them.

Each is chosen by its group's metadata ``do``: a verifier that hangs in a pure-Python loop, in
a C call (a blocking sleep, a regex that backtracks for ages while holding the GIL), segfaults,
exits, forks a child that would outlive it, prints megabytes, returns the wrong type or leaks.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import time
from typing import Any

from asyncroll.types import RolloutGroup

_LEAK: list[bytes] = []
IMPORTED_BY = os.getpid()  # the process that imported this module


def hostile(group: RolloutGroup) -> Any:
    do = group.metadata.get("do", "ok")
    n = group.num_samples
    if do == "loop":
        while True:
            pass
    if do == "sleep":
        time.sleep(3600)
    if do == "announce":  # says that it runs, and where, then hangs
        # one write(2) of the whole line: print() writes the pid and its newline apart under
        # PYTHONUNBUFFERED, and two workers announcing at once interleaved ("pidpid\n\n")
        os.write(sys.stdout.fileno(), f"{os.getpid()}\n".encode())
        time.sleep(3600)
    if do == "regex":  # catastrophic backtracking: one C call, the GIL held throughout
        re.match(r"(a+)+$", "a" * 64 + "b")
    if do == "segfault":
        ctypes.string_at(0)
    if do == "os_exit":
        os._exit(3)
    if do == "sys_exit":
        sys.exit(4)
    if do == "fork":  # a child that would live on; its pid for the test to check
        pid = os.fork()
        if pid == 0:
            time.sleep(3600)
            os._exit(0)
        with open(group.metadata["pidfile"], "w") as f:
            f.write(str(pid))
    if do == "print":
        sys.stdout.write("x" * (8 << 20) + "\n")
        sys.stdout.flush()
    if do == "wrong_type":
        return {"reward": 1.0}
    if do == "leak":
        _LEAK.append(b"x" * (64 << 20))
    if do == "raise":
        raise KeyError("answer")
    return [1.0] * n


def preloaded(group: RolloutGroup) -> list[float]:
    """1.0 per sample when a process before this worker (its fork server) had imported this
    module, 0.0 when the worker had to import it to load the function."""
    return [float(os.getpid() != IMPORTED_BY)] * group.num_samples


def count_words(completions: list[str], **kwargs: Any) -> list[float]:
    """A text reward: the words of each completion."""
    return [float(len(c.split())) if isinstance(c, str) else 0.0 for c in completions]


class CharTokenizer:
    """Token ids as characters (`chr`): a group's samples decode to the texts their ids spell,
    so a test writes completions as text. Module-level, as the workers need nothing of it."""

    def batch_decode(self, sequences: Any, **kwargs: Any) -> list[str]:
        return ["".join(chr(int(i)) for i in ids) for ids in sequences]
