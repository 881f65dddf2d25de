"""An engine's processes end with the process that owns the engine, however it ends.

vLLM runs in processes of its own: `VLLMEngine`'s engine core (a child of the trainer) and its
workers, `vllm serve` replicas that `ServerProcess.start` launched. vLLM 0.32 ends a worker
when its engine core dies (the worker's death pipe), and an engine core or API server shuts
down in order on SIGTERM; but nothing ends an engine core or a replica whose owner died
without closing it: the default action of SIGTERM and every SIGKILL leave them running, with
the card's memory. Two pieces close that gap; both engines set them up while their processes
start (`tie()`), nothing is to be called for them:

* **SIGTERM is handled as SIGINT.** While an engine is open, a SIGTERM (what `kill`, Slurm,
  Kubernetes, systemd and torchrun send) runs the SIGINT handler of the moment: under
  `asyncio.run` that cancels the main task, so `async with engine:` closes the engine as
  after Ctrl-C; otherwise `KeyboardInterrupt` is raised, and the `finally` blocks run. Set up
  only from the main thread (the only one Python lets set a handler) and only while SIGTERM
  has its default action: a program's own SIGTERM handler is left in place, and it must then
  close the engine itself (or raise `KeyboardInterrupt`). The default comes back when the
  last engine is closed (from the main thread; closed from another, the handler stays).
* **The reaper** (`asyncroll.lifetime.reaper`): a small process, one per owning
  process while an engine is open, that outlives its owner's death, a SIGKILL included, and
  then ends every process the owner's engines started (SIGTERM, then SIGKILL after
  `REAP_GRACE_S`). It needs no thread, handler or main script in the owner: it works the same
  in torchrun's ranks and in processes started by `torch.multiprocessing.spawn`.

Why a reaper and not `PR_SET_PDEATHSIG` in vLLM's processes: vLLM starts them, so asyncroll
has no code there to set it; and the kernel sends that signal when the *thread* that started
the child ends, which would kill an engine built in a worker thread (`asyncio.to_thread`) as
soon as that thread is retired.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import psutil

from asyncroll.launcher_env import without_launcher_variables

__all__ = ["REAP_GRACE_S", "Tie", "tie"]

REAP_GRACE_S = 10.0
"""How long the reaper waits after its SIGTERM before it SIGKILLs what is left: vLLM's own
shutdown of an engine core and its workers takes 1-5 s."""


def _sigterm_as_sigint(signum: int, frame: FrameType | None) -> None:
    """Run the SIGINT handler of the moment (asyncio.run's cancels its main task); when
    SIGINT is ignored or not Python's (a background job of a shell), raise KeyboardInterrupt."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt


def _children() -> str:
    return " ".join(str(child.pid) for child in psutil.Process().children())


class _Owner:
    """This process's reaper, and how many ties hold it."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        script = str(Path(__file__).with_name("reaper.py"))
        self.reaper = subprocess.Popen(
            [sys.executable, "-I", script, str(self.pid), str(REAP_GRACE_S)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a signal to this process's group must not end it
            env=without_launcher_variables(os.environ),  # no rank of the trainer's job either
        )
        self._send = threading.Lock()
        self.ties = 0
        self.sigterm = False  # whether SIGTERM runs `_sigterm_as_sigint` because of us

    def send(self, line: str) -> None:
        """One line to the reaper; one killed by someone else is gone, and so is its help."""
        stdin = self.reaper.stdin
        with self._send, contextlib.suppress(OSError):
            if stdin is not None:
                stdin.write(line.encode() + b"\n")
                stdin.flush()

    def hold(self) -> None:
        self.ties += 1
        on_main = threading.current_thread() is threading.main_thread()
        if on_main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _sigterm_as_sigint)
            self.sigterm = True

    def let_go(self) -> bool:
        """Drop a tie; with the last one, end the reaper (nothing is left to reap) and give
        SIGTERM its default back if it is still ours. True once the owner is done."""
        self.ties -= 1
        if self.ties > 0:
            return False
        self.send("bye")
        with contextlib.suppress(OSError):
            if self.reaper.stdin is not None:
                self.reaper.stdin.close()
        # it exits at once; reaped in a thread, so that no caller (an event loop) waits for it
        threading.Thread(target=self.reaper.wait, name="asyncroll-reaper-wait", daemon=True).start()
        on_main = threading.current_thread() is threading.main_thread()
        if self.sigterm and on_main and signal.getsignal(signal.SIGTERM) is _sigterm_as_sigint:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return True


_lock = threading.Lock()
_owner: _Owner | None = None


class Tie:
    """Processes this process starts inside `starting()` end with it (see the module
    docstring), and so does everything below them. `release()` once they are stopped."""

    def __init__(self, owner: _Owner) -> None:
        self._owner: _Owner | None = owner

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Every child this process starts inside the block (from any thread) is tied."""
        owner = self._owner
        if owner is None:
            raise RuntimeError("this tie was released; take a new one with tie()")
        owner.send("open " + _children())
        try:
            yield
        finally:
            owner.send("close " + _children())

    def release(self) -> None:
        """The tied processes are stopped: with the last tie, the reaper ends too. Idempotent."""
        global _owner
        with _lock:
            owner, self._owner = self._owner, None
            if owner is not None and owner.let_go() and _owner is owner:
                _owner = None


def tie() -> Tie:
    """A tie for processes about to be started (see `Tie`); starts this process's reaper if
    none runs, and handles SIGTERM as SIGINT from here on where it can (module docstring)."""
    global _owner
    with _lock:
        if _owner is None or _owner.pid != os.getpid():  # none yet, or the parent's (a fork)
            _owner = _Owner()
        _owner.hold()
        return Tie(_owner)
