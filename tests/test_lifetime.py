"""`asyncroll.lifetime` without vLLM: SIGTERM is handled as SIGINT only where the
program left it at its default, and the reaper ends the tied processes of an owner killed
with SIGKILL (stand-ins here: plain Python processes, one of which ignores SIGTERM; the real
engines are in tests/vllm/test_killed_trainer.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import FrameType

import psutil
import pytest

from asyncroll import lifetime

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 60.0


def python(code: str, **kwargs: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, **kwargs,
    )  # fmt: skip


def test_sigterm_runs_the_sigint_handler_while_tied_and_its_default_after() -> None:
    """While tied: SIGTERM runs the SIGINT handler; after the last tie: the default, and the
    reaper has exited. In a fresh process: the test runner's own engines (the session's) hold
    ties of this one, so "after the last tie" is only ever seen in a process of its own."""
    process = multiprocessing.get_context("spawn").Process(target=_sigterm_while_tied)
    process.start()
    process.join(DEADLINE_S)
    if process.exitcode is None:  # still running: end it, and say so
        process.kill()
        process.join()
        pytest.fail(f"the tied process did not end within {DEADLINE_S} s")
    assert process.exitcode == 0, "the tied process failed: its traceback is in the stderr above"


def _sigterm_while_tied() -> None:
    seen: list[int] = []
    outer = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the test runner set
    try:
        tie = lifetime.tie()
        try:
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
            previous = signal.signal(signal.SIGINT, lambda signum, _frame: seen.append(signum))
            try:
                signal.raise_signal(signal.SIGTERM)
            finally:
                signal.signal(signal.SIGINT, previous)
            assert seen == [signal.SIGINT]
            children = psutil.Process().children()
            reapers = [p for p in children if "reaper.py" in " ".join(p.cmdline())]
            assert len(reapers) == 1
        finally:
            tie.release()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        _gone, alive = psutil.wait_procs(reapers, timeout=DEADLINE_S)  # the last tie ends it
        assert not alive
    finally:
        signal.signal(signal.SIGTERM, outer)


def test_a_programs_own_sigterm_handler_is_left_in_place() -> None:
    def own(_signum: int, _frame: FrameType | None) -> None:
        pass

    previous = signal.signal(signal.SIGTERM, own)
    try:
        tie = lifetime.tie()
        assert signal.getsignal(signal.SIGTERM) is own
        tie.release()
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_closes_what_asyncio_run_runs() -> None:
    """Under `asyncio.run`, SIGTERM cancels the main task as Ctrl-C does: its `finally` runs."""
    owner = python("""
        import asyncio
        from asyncroll import lifetime

        async def main():
            tie = lifetime.tie()
            try:
                print("ready", flush=True)
                await asyncio.Event().wait()
            finally:
                tie.release()
                print("closed", flush=True)

        asyncio.run(main())
    """)
    assert owner.stdout is not None
    assert owner.stdout.readline() == "ready\n"
    owner.send_signal(signal.SIGTERM)
    out, _ = owner.communicate(timeout=DEADLINE_S)
    assert out == "closed\n"
    assert owner.returncode == -signal.SIGINT  # as after Ctrl-C


def test_reaper_ends_tied_processes_of_a_killed_owner() -> None:
    """The owner is SIGKILLed: its tied child and the child's own child end (the one that
    ignores SIGTERM by SIGKILL after the grace), and so does the reaper; a child started
    before the tie and one started after its window are left alone."""
    owner = python("""
        import subprocess, sys
        from asyncroll import lifetime

        lifetime.REAP_GRACE_S = 1.0
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
        before = subprocess.Popen(sleeper)
        tie = lifetime.tie()
        stubborn = (
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        )
        with tie.starting():
            tied = subprocess.Popen([sys.executable, "-c", (
                "import subprocess, sys, time; "
                f"print(subprocess.Popen([sys.executable, '-c', {stubborn!r}]).pid, flush=True); "
                "time.sleep(600)"
            )], stdout=subprocess.PIPE, text=True)
        after = subprocess.Popen(sleeper)
        print(tied.pid, tied.stdout.readline().strip(), before.pid, after.pid, flush=True)
        input()
    """, stdin=subprocess.PIPE)  # fmt: skip
    assert owner.stdout is not None
    pids = [int(x) for x in owner.stdout.readline().split()]
    tied, stubborn, before, after = (psutil.Process(pid) for pid in pids)
    try:
        below = psutil.Process(owner.pid).children(recursive=True)
        reapers = [p for p in below if "reaper.py" in " ".join(p.cmdline())]
        assert len(reapers) == 1, [p.cmdline() for p in below]
        owner.kill()
        owner.wait(timeout=DEADLINE_S)
        _gone, alive = psutil.wait_procs([tied, stubborn, reapers[0]], timeout=DEADLINE_S)
        assert not alive, [p.cmdline() for p in alive]
        assert before.is_running() and after.is_running()
    finally:
        for proc in (tied, stubborn, before, after):
            if proc.is_running():
                proc.kill()


def test_reaper_reaps_for_an_owner_dead_before_it_read_a_word() -> None:
    """The owner ties a child and dies at once, before its reaper (a Python process still
    starting) has read the lines naming that child: the reaper reads what the pipe still holds
    and ends the child all the same."""
    owner = python("""
        import os, subprocess, sys
        import psutil
        from asyncroll import lifetime

        lifetime.REAP_GRACE_S = 1.0
        tie = lifetime.tie()
        with tie.starting():
            tied = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        below = psutil.Process().children()
        reapers = [p.pid for p in below if "reaper.py" in " ".join(p.cmdline())]
        print(tied.pid, *reapers, flush=True)
        os._exit(0)
    """)  # fmt: skip
    assert owner.stdout is not None
    pids = [int(x) for x in owner.stdout.readline().split()]
    owner.wait(timeout=DEADLINE_S)
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue  # ended already
    try:
        _gone, alive = psutil.wait_procs(procs, timeout=DEADLINE_S)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        for proc in procs:
            if proc.is_running():
                proc.kill()


@pytest.mark.parametrize("how", ["bye", "eof"])
def test_reaper_ends_with_its_owner_done(how: str) -> None:
    """Closed with "bye" (every tie released) it reaps nothing; end of file alone (the owner
    died) makes it reap: here nothing is tied, and either way it exits."""
    script = Path(lifetime.__file__).with_name("reaper.py")
    reaper = subprocess.Popen(
        [sys.executable, "-I", str(script), str(os.getpid()), "1"],
        stdin=subprocess.PIPE,
    )
    assert reaper.stdin is not None
    if how == "bye":
        reaper.stdin.write(b"bye")
    reaper.stdin.close()
    assert reaper.wait(timeout=DEADLINE_S) == 0
