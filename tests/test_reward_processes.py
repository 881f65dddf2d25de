"""Sync rewards in worker processes (`reward_executor="process"`): a verifier that hangs (in
Python or in a C call), segfaults, exits, forks, prints megabytes or returns the wrong type
fails its own group with a readable reason, the run goes on, and no process is left. The
engine is SimEngine (a simulation: the executor, not generation, is under test); the
verifiers are `tests/verifiers.py`, which each worker imports."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncroll import (
    DropRecord,
    Producer,
    Prompt,
    RolloutGroup,
    RolloutState,
    SamplingConfig,
    SimEngine,
)  # fmt: skip
from asyncroll._core import reward_processes
from asyncroll._core.reward_processes import ProcessPool, RewardDeadline
from asyncroll.chat.rewards import text_reward
from asyncroll.evaluation import Evaluator
from asyncroll.types import Status
from tests.verifiers import count_words, hostile

VOCAB = 64
GUARD_S = 120.0  # only against hangs: worker starts take ~1 s each on a loaded machine
DEADLINE_S = 1.0

HOSTILE = ["loop", "sleep", "regex", "segfault", "os_exit", "sys_exit", "fork", "print",
           "wrong_type", "raise"]  # fmt: skip
REASONS = {
    "loop": "took longer than reward_timeout_s=1.0: its worker process was killed",
    "sleep": "took longer than reward_timeout_s=1.0: its worker process was killed",
    "regex": "took longer than reward_timeout_s=1.0: its worker process was killed",
    "segfault": "crashed its worker process: it was killed by SIGSEGV",
    "os_exit": "crashed its worker process: it exited with code 3",
    "sys_exit": "crashed its worker process: it exited with code 4",
    "wrong_type": "reward function returned a dict, not ",
    "raise": "raised KeyError: 'answer' (at verifiers.py:",
}


def hostile_prompts(pidfile: Path, healthy: int) -> list[Prompt]:
    """Each hostile verifier once, with `healthy` prompts between them."""
    return [
        Prompt(tokens=[3, 4, 5 + i], prompt_id=do if do != "ok" else f"ok/{i}",
               metadata={"do": do, "pidfile": str(pidfile)})
        for i, do in enumerate([*HOSTILE, *["ok"] * healthy])
    ]  # fmt: skip


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_hostile_verifiers_fail_only_their_groups_and_leave_no_process(
    tmp_path: Path,
) -> None:
    pidfile = tmp_path / "forked.pid"
    drops: list[DropRecord] = []
    producer = Producer(
        SimEngine(vocab_size=VOCAB), hostile_prompts(pidfile, healthy=6), hostile,
        group_size=2, sampling=SamplingConfig(max_new_tokens=4), reward_executor="process",
        reward_timeout_s=DEADLINE_S, reward_workers=3, on_drop=drops.append,
    )  # fmt: skip
    pool = producer._rewards.pool
    assert pool is not None
    seen: set[int] = set()
    async with producer:
        scored = []
        async for batch in producer.batches(4):
            scored += [g.prompt_id for g in batch.groups]
            seen.update(pool.pids())
    failed = {d.prompt_id: d.error or "" for d in drops}
    assert sorted(failed) == sorted(set(REASONS)), failed
    for do, reason in REASONS.items():
        assert reason in failed[do], (do, failed[do])
        assert "reward function 'hostile'" in failed[do]
    # the rest scored: the healthy prompts, and the verifiers that fork or print megabytes
    assert sorted(scored) == sorted(["fork", "print", *[f"ok/{i}" for i in range(10, 16)]])
    # replaced: one worker per death (3 deadlines, 3 crashes) beyond the first ones
    assert pool.started >= 3 + 6
    assert pool.alive == 0
    forked = int(pidfile.read_text())
    assert not any(alive(pid) for pid in [*seen, forked]), [p for p in seen if alive(p)]


def test_a_reward_that_cannot_be_pickled_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"reward function '.*<lambda>'.*cannot be pickled"):
        Producer(SimEngine(vocab_size=VOCAB), [[1, 2]], lambda g: [1.0], reward_executor="process")


def test_a_text_reward_that_cannot_be_pickled_names_the_function() -> None:
    class Tokenizer:  # what text_reward needs of one; never sent
        def batch_decode(self, ids: Any, **kwargs: Any) -> list[str]:
            return ["a b"] * len(ids)

    def local(completions: list[str]) -> list[float]:
        return [1.0] * len(completions)

    reward = text_reward([count_words, local], Tokenizer())
    with pytest.raises(ValueError, match=r"text_reward's function '.*local'.*not the tokenizer"):
        Producer(SimEngine(vocab_size=VOCAB), [[1, 2]], reward, reward_executor="process")


async def test_a_text_reward_sends_text_and_the_tokenizer_stays() -> None:
    lock = threading.Lock()  # unpicklable: sending the tokenizer would fail

    class Tokenizer:
        def __init__(self) -> None:
            self.lock = lock

        def batch_decode(self, ids: Any, **kwargs: Any) -> list[str]:
            return [" ".join(["w"] * len(x)) for x in ids]

    reward = text_reward(count_words, Tokenizer())
    producer = Producer(
        SimEngine(vocab_size=VOCAB), [[1, 2], [3, 4]], reward, group_size=2,
        sampling=SamplingConfig(max_new_tokens=4), reward_executor="process", reward_workers=1,
    )  # fmt: skip
    async with producer:
        batch = await producer.produce_batch(2, timeout=GUARD_S)
    for group in batch.groups:
        assert [s.reward for s in group.samples] == [float(len(s.tokens)) for s in group.samples]


@pytest.mark.parametrize(("option", "value"), [("reward_worker_max_calls", 2),
                                               ("reward_worker_max_mib", 32.0)])  # fmt: skip
async def test_a_worker_is_recycled_after_n_calls_or_past_its_memory(
    option: str, value: Any
) -> None:
    """Four calls on one worker: recycled every second call, or after each call of a verifier
    that leaks 64 MiB a call under a 32 MiB bound."""
    prompts = [Prompt(tokens=[1, 2 + i], metadata={"do": "leak"}) for i in range(4)]
    producer = Producer(
        SimEngine(vocab_size=VOCAB), prompts, hostile, group_size=2, reward_workers=1,
        max_inflight_groups=1, sampling=SamplingConfig(max_new_tokens=4),
        reward_executor="process", **{option: value},
    )  # fmt: skip
    pool = producer._rewards.pool
    assert pool is not None
    async with producer:
        groups = [g async for b in producer.batches(4) for g in b.groups]
    assert len(groups) == 4
    assert pool.recycled == (2 if option == "reward_worker_max_calls" else 4)


def test_the_process_executor_refuses_inline_rewards() -> None:
    with pytest.raises(ValueError, match="reward_in_thread=False"):
        Producer(
            SimEngine(vocab_size=VOCAB), [[1, 2]], hostile, reward_executor="process",
            reward_in_thread=False,
        )  # fmt: skip


async def test_the_evaluator_scores_around_hostile_verifiers(tmp_path: Path) -> None:
    """A hang in a C call, a segfault and an exception (the rest is the producer's test)."""
    few = {"regex", "segfault", "raise"}
    prompts = [p for p in hostile_prompts(tmp_path / "pid", healthy=4) if p.metadata["do"]
               in few | {"ok"}]  # fmt: skip
    producer = Producer(
        SimEngine(vocab_size=VOCAB), [[1, 2]], hostile, group_size=2,
        sampling=SamplingConfig(max_new_tokens=4), reward_timeout_s=DEADLINE_S, reward_workers=3,
    )  # fmt: skip
    evaluator = Evaluator(producer, prompts, hostile, reward_executor="process", timeout_s=GUARD_S)
    pool = evaluator._rewards.pool
    assert pool is not None
    async with producer:
        result = await evaluator.run()
    assert result.error is None, result.error
    assert sorted(result.failed) == sorted(few), result.failed
    for do in few:
        assert REASONS[do] in result.failed[do], (do, result.failed[do])
    assert result.scores.prompts == 4
    assert pool.alive == 0


async def test_a_hung_thread_verifier_does_not_stall_the_evaluator() -> None:
    """Threads cannot be killed: with as many hung calls as reward workers, the prompts
    queued behind them waited until the evaluation's own timeout_s, and every later run()
    scored nothing. Now they fail at once with the reason, and run() says it."""
    release = threading.Event()

    def judge(group: Any) -> list[float]:
        if group.metadata["do"] == "hang":
            release.wait(60)  # a hung judge; released at the end so its thread can exit
        return [1.0] * group.num_samples

    prompts = [Prompt(tokens=[1, 2 + i], prompt_id=f"p{i}", metadata={"do": "hang" if i < 2
               else "ok"}) for i in range(12)]  # fmt: skip
    producer = Producer(
        SimEngine(vocab_size=VOCAB), [[1, 2]], hostile, group_size=2, reward_workers=2,
        reward_timeout_s=0.2, sampling=SamplingConfig(max_new_tokens=4),
    )  # fmt: skip
    evaluator = Evaluator(producer, prompts, judge, concurrency=12, timeout_s=GUARD_S)
    try:
        async with producer:
            first = await evaluator.run()
            second = await evaluator.run()
    finally:
        release.set()
    for result in (first, second):
        assert result.error is not None and "every reward worker (2) is stuck" in result.error
        assert "did not finish within timeout_s" not in result.error
        assert result.incomplete == 0
    assert "reward_timeout_s=0.2" in first.failed["p0"]
    stuck = [r for r in first.failed.values() if "every reward worker is stuck" in r]
    assert len(first.failed) + first.scores.prompts == 12 and stuck
    assert len(second.failed) == 12  # nothing can be scored: said at once, not at timeout_s


SIGNALLED = textwrap.dedent(
    """
    import asyncio, faulthandler, sys
    from asyncroll import Producer, Prompt, SamplingConfig, SimEngine

    faulthandler.enable(all_threads=True)  # a SIGABRT from the test prints every thread
    from tests.verifiers import hostile

    async def main(busy):
        do = "announce" if busy else "ok"  # "announce": a worker prints its pid, then hangs
        prompts = [Prompt(tokens=[1, 2 + i], metadata={"do": do}) for i in range(4)]
        producer = Producer(
            SimEngine(vocab_size=64), prompts, hostile, group_size=2, reward_workers=2,
            reward_timeout_s=600, sampling=SamplingConfig(max_new_tokens=4),
            reward_executor="process",
        )
        async with producer:
            if busy:
                await producer.produce_batch(1, timeout=600)
            await producer.produce_batch(4, timeout=600)
            print(*producer._rewards.pool.pids(), sep="\\n", flush=True)  # idle workers
            await asyncio.Event().wait()

    if __name__ == "__main__":
        asyncio.run(main(sys.argv[1] == "busy"))
    """
)


@pytest.mark.parametrize(
    ("sig", "busy"),
    [(signal.SIGINT, False), (signal.SIGTERM, True), (signal.SIGKILL, True)],
    ids=["SIGINT-idle", "SIGTERM-busy", "SIGKILL-busy"],
)
def test_no_worker_outlives_a_trainer_stopped_by_a_signal(
    tmp_path: Path, sig: int, busy: bool
) -> None:
    """SIGINT stops the run, whose exit kills its workers (busy ones too, once the groups
    being scored had their deadline: the stop lets them finish); SIGTERM and SIGKILL end the
    trainer at once, and the kernel kills its workers in their calls (PR_SET_PDEATHSIG)."""
    script = tmp_path / "trainer.py"
    script.write_text(SIGNALLED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), *sys.path])}
    stderr = tmp_path / "stderr"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), "busy" if busy else "idle"], stdout=subprocess.PIPE,
            stderr=err, text=True, env=env, cwd=Path.cwd(),
        )  # fmt: skip
    try:
        assert proc.stdout is not None
        pids = [int(proc.stdout.readline()) for _ in range(2)]
        assert all(alive(p) for p in pids)
        proc.send_signal(sig)
        try:
            proc.wait(timeout=GUARD_S)
        except subprocess.TimeoutExpired:  # where it hangs, for the failure's message
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=GUARD_S)
            pytest.fail(
                f"the trainer did not exit within {GUARD_S} s of {signal.Signals(sig).name}; "
                f"its stderr ends:\n{stderr.read_text()[-8000:]}"
            )
    finally:
        proc.kill()
        proc.wait()
    for _ in range(200):  # the kernel delivers PR_SET_PDEATHSIG as the trainer exits
        if not any(alive(p) for p in pids):
            break
        threading.Event().wait(0.05)
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]


PRELOADED = textwrap.dedent(
    """
    import asyncio
    from asyncroll import Producer, Prompt, SamplingConfig, SimEngine

    async def main():
        from tests.verifiers import preloaded  # not the script's: its own module

        producer = Producer(
            SimEngine(vocab_size=64), [Prompt(tokens=[1, 2])], preloaded, group_size=2,
            sampling=SamplingConfig(max_new_tokens=4), reward_executor="process",
            reward_workers=1,
        )
        async with producer:
            batch = await producer.produce_batch(1, timeout=600)
        print([s.reward for s in batch.groups[0].samples])

    if __name__ == "__main__":
        asyncio.run(main())
    """
)


def test_the_fork_server_preloads_the_reward_functions_module(tmp_path: Path) -> None:
    """A worker forks from a server that imported the function's module already: it does
    not import it (and what it imports) again on every start, replacement and evaluation. In
    a fresh interpreter: the session's fork server started long ago, with what the first pool
    asked for."""
    script = tmp_path / "trainer.py"
    script.write_text(PRELOADED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env,
        cwd=Path.cwd(), timeout=GUARD_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "[1.0, 1.0]", done.stdout[-500:]


def hostile_group(do: str) -> RolloutGroup:
    state = RolloutState(
        tokens=np.array([5], np.int32), logprobs=np.zeros(1, np.float32),
        versions=np.zeros(1, np.int32), status=Status.COMPLETED, finish_reason="stop",
    )  # fmt: skip
    return RolloutGroup(
        uid=0, prompt_id=do, task="default", prompt_tokens=np.array([1], np.int32),
        samples=(state,), metadata={"do": do},
    )  # fmt: skip


async def test_reaping_a_killed_worker_waits_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reap waits for the dying worker (and the fork server's report of it), which a
    loaded machine may not schedule for a while: on the loop, every kill stalled the run's
    generation (a simulated run with 10% of its calls hanging kept 0.3 of its throughput
    under load, not 0.77). The caller hears of the deadline before the reap ends."""
    pool = ProcessPool(hostile, "hostile", workers=1, max_calls=None, max_rss_mib=None)
    order: list[str] = []
    release = threading.Event()
    join = BaseProcess.join

    def slow_join(self: BaseProcess, timeout: float | None = None) -> None:
        release.wait(10.0)  # bounded: on the loop, the call below would wait this out first
        order.append("reaped")
        join(self, timeout)

    try:
        assert await pool.call(hostile_group("ok"), 1, GUARD_S) == [1.0]  # a started worker
        monkeypatch.setattr(BaseProcess, "join", slow_join)
        with pytest.raises(RewardDeadline):
            await pool.call(hostile_group("sleep"), 1, 0.2)
        order.append("heard")
    finally:
        release.set()
        monkeypatch.undo()
        pool.close()
    assert order[0] == "heard", order


async def test_starting_a_worker_waits_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A start waits for the fork server (its preload the first time, then its fork), which
    a loaded machine may not schedule for a while: the loop goes on meanwhile."""
    pool = ProcessPool(hostile, "hostile", workers=1, max_calls=None, max_rss_mib=None)
    order: list[str] = []
    starting, release = threading.Event(), threading.Event()
    start = BaseProcess.start

    def slow_start(self: BaseProcess) -> None:
        if self.name.startswith("asyncroll-reward-") and not release.is_set():
            starting.set()
            release.wait(10.0)  # bounded: on the loop, the wait below would wait this out
            order.append("started")
        start(self)

    monkeypatch.setattr(BaseProcess, "start", slow_start)
    call = asyncio.ensure_future(pool.call(hostile_group("ok"), 1, GUARD_S))
    try:
        assert await asyncio.to_thread(starting.wait, GUARD_S)
        order.append("loop ran")
    finally:
        release.set()
    try:
        assert await call == [1.0]
    finally:
        pool.close()
    assert order == ["loop ran", "started"], order


def test_closing_waits_until_what_a_verifier_forked_has_died(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SIGKILLed group's members die when next scheduled: under load a verifier's forked
    child was seen alive after close() returned. Here the group's member ends only when the
    wait first sleeps (deterministic: the sleep ends it), so close() must look again; and a
    group of zombies only is not waited for."""
    member = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    slept: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:  # time.sleep itself: Popen.wait's too
        if slept or not member.stdin:
            return real_sleep(seconds)
        slept.append(seconds)
        member.stdin.close()
        member.wait(timeout=30)  # reaped: its group is empty now
        return None

    monkeypatch.setattr(reward_processes.time, "sleep", sleep)
    reward_processes._wait_groups_gone([member.pid], timeout_s=60.0)
    assert slept and member.returncode == 0

    zombie = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # ended, left unreaped
    slept.clear()
    reward_processes._wait_groups_gone([zombie.pid], timeout_s=60.0)
    assert slept == []  # dead, not yet reaped: nothing runs
    zombie.wait()
