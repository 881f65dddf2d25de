"""The reaper: a small process that ends an engine's processes once the process that owns the
engine has died, however it died (a SIGKILL included, which nothing in the dying process can
answer). `asyncroll.lifetime` starts it; it is run as a script, by path, so that it
imports only the standard library and psutil (a start costs tens of milliseconds).

    python -I reaper.py OWNER_PID GRACE_S

It reads lines from its stdin, a pipe from the owner:

* `open PID...`: the owner is about to start an engine's processes; the PIDs are its children
  now, which are not the engine's. Until the matching `close PID...` (its children then),
  every other child of the owner is tied (looked for every `POLL_S` meanwhile, so that an
  owner killed inside the window is covered too). vLLM starts its engine core
  and `ServerProcess` its API server as children of the owner; their own children (vLLM's
  workers, a replica's engine core) are found below them when the time comes.
* `bye`: every engine was closed; the reaper exits with nothing to do.

End of file without `bye`, or a new parent (the owner died and the reaper was handed to init or
a subreaper; checked every `POLL_S`, for when a process forked from the owner still holds the
pipe), makes it reap once it has read what the pipe still holds (an owner killed just after
starting an engine may die before this process, still starting, has read a word): SIGTERM to
every tied process still running and all below it (vLLM's engine core, workers and API server
shut down in order on it, and the workers free their shared memory), SIGKILL to those left
after `GRACE_S`. A tied process is remembered with its start time, so a pid reused meanwhile
is left alone (psutil checks it before each signal).
It runs in a session of its own, so that a signal to the owner's process group (torchrun's
SIGKILL, a terminal's Ctrl-C) does not end it before the owner.

Processes are found by their parent rather than marked (an environment variable, say) because
vLLM's processes rename themselves (`setproctitle`), which overwrites what Linux shows of
their environment.
"""

from __future__ import annotations

import os
import select
import signal
import sys

import psutil

POLL_S = 0.5


class Reaper:
    """What the owner has tied: `tied`, settled at the end of its window; `pending`, found
    while a window is open (the owner's list at `close` settles them: a child the owner
    started just after the window is not tied, whenever this process looks)."""

    def __init__(self, owner: psutil.Process | None) -> None:
        self.owner = owner
        self.untied = {os.getpid()}
        self.tied: dict[int, psutil.Process] = {}
        self.pending: dict[int, psutil.Process] = {}
        self.windows = 0

    def message(self, line: str) -> bool:
        """Act on one line from the owner; False on `bye`."""
        word, *listed = line.split()
        pids = {int(pid) for pid in listed}
        if word == "bye":
            return False
        if word == "open":
            if self.windows > 0:  # what an open window started is tied, whatever this lists
                self.adopt()
            self.untied |= pids - self.tied.keys() - self.pending.keys()
            self.windows += 1
        elif word == "close":
            self.windows -= 1
            for pid in pids - self.untied - self.tied.keys() - self.pending.keys():
                try:
                    self.pending[pid] = psutil.Process(pid)
                except psutil.Error:
                    continue  # ended already
            if self.windows == 0:
                self.tied.update((p, proc) for p, proc in self.pending.items() if p in pids)
                self.pending.clear()
        return True

    def adopt(self) -> None:
        """Note the owner's children started inside the open windows."""
        if self.owner is None:
            return  # gone before this process looked: what it wrote is all there is
        try:
            children = self.owner.children()
        except psutil.Error:
            return  # the owner is gone: reaping follows
        for child in children:
            if child.pid not in self.untied and child.pid not in self.tied:
                self.pending.setdefault(child.pid, child)

    def reap(self, grace_s: float) -> None:
        procs = []
        for root in [*self.tied.values(), *self.pending.values()]:
            try:
                procs += [root, *root.children(recursive=True)]
            except psutil.Error:
                continue  # ended already (or its pid was reused)
        for proc in procs:
            try:
                proc.send_signal(signal.SIGTERM)
            except psutil.Error:
                continue
        _gone, alive = psutil.wait_procs(procs, timeout=grace_s)
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                continue


def main(owner_pid: int, grace_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the owner's death ends it
    try:
        owner: psutil.Process | None = psutil.Process(owner_pid)
    except psutil.NoSuchProcess:
        owner = None  # died while this process started: what it wrote is still in the pipe
    reaper = Reaper(owner)
    buffered = b""
    while True:
        orphaned = os.getppid() != owner_pid
        # an orphan only drains the pipe: the owner may have died with its last lines unread
        ready, _, _ = select.select([sys.stdin.buffer], [], [], 0 if orphaned else POLL_S)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                break  # end of file: the owner died (or closed the pipe without a word)
            *lines, rest = (buffered + chunk).split(b"\n")
            buffered = rest
            if not all(reaper.message(line.decode()) for line in lines if line.strip()):
                return
        elif orphaned:
            break
        if reaper.windows > 0:
            reaper.adopt()
    reaper.reap(grace_s)


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
