"""The main function of a reward worker process (`asyncroll._core.reward_processes` starts it).

It receives the pickled reward function as its first message (not as an argument of the
process, which the parent would write while the child starts), loads it, says it is ready,
then scores one call at a time: each message is ``(n, payload)``, each answer ``("ok",
rewards, rss_bytes)`` (the rewards already checked as n finite floats, so nothing large or
unpicklable comes back), ``("invalid", why, rss_bytes)`` for a result that is not n numbers,
or ``("raised", "KeyError: 'x' (at f.py:3 in g)", rss_bytes)``. Anything else (a segfault,
`os._exit`, `sys.exit`) ends the process, and the parent reads the end of its pipe.

The worker dies with the process that started it (`PR_SET_PDEATHSIG` on Linux: its parent is
multiprocessing's fork server, which exits with the trainer, so a trainer killed by any signal
leaves no worker behind), leads a process group of its own (so the parent
can kill what a verifier forked along with it, and a Ctrl-C in the terminal reaches only the
trainer, which stops its workers itself), and ignores SIGINT for the same reason.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

_PR_SET_PDEATHSIG = 1


def main(conn: Connection) -> None:
    _die_with_parent()
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from asyncroll._core.causes import described
    from asyncroll._core.rollout import RolloutError, check_rewards

    try:
        fn_bytes = conn.recv_bytes()
    except (EOFError, OSError):
        return
    try:
        fn = pickle.loads(fn_bytes)
    except BaseException as exc:
        conn.send(("load_error", described(exc)))
        return
    del fn_bytes
    conn.send(("ready", os.getpid()))
    while True:
        try:
            n, payload = conn.recv()
        except (EOFError, OSError):  # the parent closed the pool (or died)
            return
        try:
            value = fn(payload)
            if inspect.isawaitable(value):
                if inspect.iscoroutine(value):
                    value.close()
                raise RolloutError(
                    "reward function returned an awaitable: a worker process cannot await it; "
                    "write it as async def (async rewards run on the event loop)"
                )
            answer: tuple[Any, ...] = ("ok", check_rewards(value, n))
        except RolloutError as exc:
            answer = ("invalid", str(exc))
        except Exception as exc:
            answer = ("raised", described(exc))
        del payload
        value = None
        conn.send((*answer, _rss_bytes()))


def _die_with_parent() -> None:
    """Ask the kernel to kill this process when its parent (the fork server, which exits with
    the trainer) dies (Linux), and exit at once if it already has (before the request took
    effect: the process was handed to init).

    The fork server exits once no process holds its "alive" pipe, and multiprocessing gives
    each child a copy: kept, the workers would keep the server alive after the trainer died,
    and it them. A worker starts no processes of its own through it, so it closes its copy."""
    with contextlib.suppress(ImportError, AttributeError, OSError, TypeError):
        from multiprocessing import forkserver

        server: Any = forkserver._forkserver
        alive = server._forkserver_alive_fd
        if alive is not None:
            os.close(alive)
            server._forkserver_alive_fd = None
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:
        os._exit(0)


def _rss_bytes() -> int:
    """This process's resident memory now (Linux), or its peak where /proc is missing."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
