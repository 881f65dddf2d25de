"""The run record written by the producer (`asyncroll.record.writer`), read back with
`read_record`, on SimEngine (a simulation: random tokens, no model)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from asyncroll import Producer, SamplingConfig, SimConfig, SimEngine
from asyncroll.episode import Episode
from asyncroll.record import (
    GroupLine,
    RecordConfig,
    RunLine,
    StepLine,
    TrainLine,
    read_record,
    record_files,
)
from asyncroll.types import RolloutGroup

VOCAB = 1000
DEADLINE_S = 30.0


def prompts(n: int) -> list[list[int]]:
    return [[(i * 7 + j) % VOCAB for j in range(3)] for i in range(n)]


async def parity(group: RolloutGroup) -> list[float]:
    """1 for an even first token: random under SimEngine, so some groups are all-equal and the
    `nonzero_std` filter drops them."""
    return [float(s.tokens[0] % 2 == 0) if len(s.tokens) else 0.0 for s in group.samples]


async def tool_agent(episode: Episode) -> None:
    """Policy turn, two environment tokens (a tool's answer: mask 0), policy turn."""
    await episode.generate()
    episode.append([5, 6])
    await episode.generate()


def producer(run: Path | RecordConfig, *, episodes: bool = False, **options: Any) -> Producer:
    more: dict[str, Any] = (
        {"rollout_fn": tool_agent, "max_turns": 2, "max_episode_tokens": 64} if episodes else {}
    )
    return Producer(
        SimEngine(SimConfig(vocab_size=VOCAB, lengths="uniform", seed=1, fail_rate=0.1)),
        prompts(400),
        parity,
        group_size=4,
        batch_size=2,
        sampling=SamplingConfig(max_new_tokens=6),
        filter="nonzero_std",
        record=run,
        **more,
        **options,
    )


async def run_steps(p: Producer, steps: int, attach: bool = True) -> list[list[RolloutGroup]]:
    """`steps` batches; each gets trainer logprobs [rows, L] (to_batch's layout) and
    per-sample advantages attached, and its metrics. Returns the groups of each step."""
    out = []
    rng = np.random.default_rng(0)
    for step in range(1, steps + 1):
        batch = await p.produce_batch(timeout=DEADLINE_S)
        groups = list(batch.groups)
        out.append(groups)
        if attach:
            rows = sum(g.num_samples for g in groups)
            length = max(len(g.prompt_tokens) + len(s.tokens) for g in groups for s in g.samples)
            p.record.attach(
                groups,
                step=step,
                logprobs=-rng.random((rows, length)).astype(np.float32),
                advantages=rng.standard_normal(rows).astype(np.float32),
                extra={"kl": np.arange(rows, dtype=np.float64)},
            )
            p.record.step_metrics(step, {"train/loss": float(step)})
    return out


def lines(run: Path) -> tuple[list[RunLine], list[GroupLine], list[TrainLine], list[StepLine]]:
    kinds: dict[type, list[Any]] = {RunLine: [], GroupLine: [], TrainLine: [], StepLine: []}
    for line in read_record(run):
        kinds[type(line)].append(line)
    return kinds[RunLine], kinds[GroupLine], kinds[TrainLine], kinds[StepLine]


def check_sample(line: Any, sample: Any) -> None:
    """The line holds the sample's arrays token by token, logprobs bit for bit as float32."""
    assert line.tokens == sample.tokens.tolist()
    assert np.array_equal(
        np.array(line.logprobs, dtype=np.float32).view(np.int32), sample.logprobs.view(np.int32)
    )
    assert line.versions == sample.versions.tolist()
    mask = None if sample.loss_mask is None else sample.loss_mask.tolist()
    ends = None if sample.turn_ends is None else sample.turn_ends.tolist()
    assert (line.loss_mask, line.turn_ends) == (mask, ends)
    assert (line.reward, line.status, line.finish_reason) == (
        sample.reward, sample.status.value, sample.finish_reason,
    )  # fmt: skip


@pytest.mark.parametrize("episodes", [False, True], ids=["single_turn", "episodes"])
async def test_the_record_holds_every_handed_out_sample_token_by_token(
    tmp_path: Path, episodes: bool
) -> None:
    p = producer(tmp_path, episodes=episodes)
    async with p:
        steps = await run_steps(p, 4)
    runs, groups, trains, step_lines = lines(tmp_path)
    assert len(runs) == 1 and runs[0].config["group_size"] == 4
    handed = [g for g in groups if g.step is not None]
    assert [(g.step, g.uid) for g in handed] == [
        (step, g.uid) for step, gs in enumerate(steps, 1) for g in gs
    ]
    by_uid = {g.uid: g for gs in steps for g in gs}
    for line in handed:
        group = by_uid[line.uid]
        assert line.prompt_tokens == group.prompt_tokens.tolist()
        assert (line.prompt_id, line.status, line.drop_reason) == (
            group.prompt_id, group.status.value, None,
        )  # fmt: skip
        assert all(s.pieces is None for s in line.samples)  # no tokenizer given
        for sample_line, sample in zip(line.samples, group.samples, strict=True):
            check_sample(sample_line, sample)
    if episodes:  # the tool's tokens are in, untrained, and each sample has its three turns
        masks = [s.loss_mask for g in handed for s in g.samples if s.status == "completed"]
        assert masks and all(m is not None and 0 in m for m in masks)
    # What the trainer attached: its row's response slice, None off the loss mask.
    assert len(trains) == sum(g.num_samples for gs in steps for g in gs)
    rng = np.random.default_rng(0)
    for step, gs in enumerate(steps, 1):
        rows = [(g, i, s) for g in gs for i, s in enumerate(g.samples)]
        length = max(len(g.prompt_tokens) + len(s.tokens) for g, _, s in rows)
        lp = -rng.random((len(rows), length)).astype(np.float32)
        adv = rng.standard_normal(len(rows)).astype(np.float32)
        mine = [t for t in trains if t.step == step]
        for r, ((g, i, s), t) in enumerate(zip(rows, mine, strict=True)):
            assert (t.uid, t.index) == (g.uid, i)
            p0, n = len(g.prompt_tokens), len(s.tokens)
            trained = [True] * n if s.loss_mask is None else s.loss_mask.astype(bool).tolist()
            want = [
                float(v) if k else None for v, k in zip(lp[r, p0 : p0 + n], trained, strict=True)
            ]
            assert t.logprobs == want
            assert t.advantages == [float(adv[r]) if k else None for k in trained]
            assert t.extra == {"kl": float(r)}
    # One step line a step, the producer's metrics merged with the trainer's.
    assert [s.step for s in step_lines] == [1, 2, 3, 4]
    assert all(s.metrics["train/loss"] == s.step for s in step_lines)
    assert all("rollout/batch_groups" in s.metrics for s in step_lines)
    # Dropped groups (failed by the simulation, filtered) carry their reason.
    dropped = [g for g in groups if g.step is None]
    reasons = {g.drop_reason for g in dropped}
    assert "filtered" in reasons and "engine_error" in reasons, reasons
    assert all(g.status in ("failed", "filtered") for g in dropped)


async def test_dropped_groups_are_sampled_per_reason(tmp_path: Path) -> None:
    p = producer(RecordConfig(dir=str(tmp_path), drops_per_reason=2, drop_every=3))
    async with p:
        await run_steps(p, 6, attach=False)
    seen = p.record.stats.drops_seen
    _, groups, _, _ = lines(tmp_path)
    counts: dict[str, int] = {}
    for g in groups:
        if g.step is None:
            assert g.drop_reason is not None
            counts[g.drop_reason] = counts.get(g.drop_reason, 0) + 1
    total = p.progress.counters
    by_reason = {"filtered": total.filtered_groups, **total.failed_groups_by_reason}
    assert seen == sum(by_reason.values())
    for reason, n in by_reason.items():  # the first 2, then one in 3
        assert counts.get(reason, 0) == min(n, 2) + max(0, n - 2) // 3, (reason, n, counts)


class Letters:
    """A tokenizer of one letter a token (at a module's top level: the writer process gets it
    pickled, by reference)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


async def test_pieces_and_prompt_text_come_from_the_tokenizer(tmp_path: Path) -> None:
    p = producer(RecordConfig(dir=str(tmp_path), tokenizer=Letters()))
    async with p:
        await run_steps(p, 1, attach=False)
    _, groups, _, _ = lines(tmp_path)
    g = next(g for g in groups if g.step == 1)
    assert g.prompt_text == Letters().decode(g.prompt_tokens)
    assert all(s.pieces == [Letters().decode([t]) for t in s.tokens] for s in g.samples)


# -- hostile paths --------------------------------------------------------------------------------


def test_a_tokenizer_the_writer_process_cannot_get_is_refused_when_the_producer_is_built(
    tmp_path: Path,
) -> None:
    class Local(Letters):  # a local class: pickle cannot name it
        pass

    with pytest.raises(ValueError, match=r"RecordConfig.tokenizer: .*Local cannot be pickled"):
        producer(RecordConfig(dir=str(tmp_path), tokenizer=Local()))
    Local.__module__ = "__main__"  # as a class of the script being run
    with pytest.raises(ValueError, match=r"defined in the script being run \(__main__\)"):
        producer(RecordConfig(dir=str(tmp_path), tokenizer=Local()))


async def test_a_blocked_writer_never_stalls_the_producer_and_the_lines_left_out_are_counted(
    tmp_path: Path,
) -> None:
    # A writer that does not move (a disk that stopped answering): the process is stopped.
    p = producer(RecordConfig(dir=str(tmp_path), max_pending_tokens=200))
    async with p:
        pid = p.record.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # after its run line (the entry waits for that)
        try:
            await run_steps(p, 40)
            assert p.record.stats.groups == 0
            stats = p.record.stats
            assert stats.dropped_pending > 0
            assert p.record._pending_tokens <= 200
        finally:
            os.kill(pid, signal.SIGCONT)
    _, groups, _, step_lines = lines(tmp_path)
    assert 0 < len([g for g in groups if g.step is not None]) < 80
    assert step_lines and step_lines[-1].metrics["record/dropped_pending"] > 0


async def test_the_budget_holds_on_disk_and_every_step_line_is_kept(tmp_path: Path) -> None:
    # Unbounded, the 30 steps write ~295 kB: ~135 kB of step lines, the rest groups and
    # train lines, which get the 50 kB the steps leave.
    budget = 200_000
    config = RecordConfig(
        dir=str(tmp_path), max_bytes=budget, step_bytes=150_000, file_bytes=40_000
    )
    p = producer(config)
    async with p:
        await run_steps(p, 30)
    files = record_files(tmp_path)
    assert len(files) > 3
    assert all(f.stat().st_size <= 40_000 for f in files)
    assert sum(f.stat().st_size for f in files) <= budget
    _, groups, _, step_lines = lines(tmp_path)
    assert p.record.stats.skipped_budget > 0
    assert [s.step for s in step_lines] == list(range(1, 31))
    assert len([g for g in groups if g.step is not None]) < 60


KILLED_RUN = """
import asyncio, sys
import anyio
from tests.test_record import producer, run_steps

async def main():
    p = producer(sys.argv[1])
    async with p:
        await run_steps(p, 3)
        await p.pause()  # no more groups land: nothing pushes the lines out but the flush
        p.record.step_metrics(4, {"eval/accuracy": 0.5})  # a short line, last before the kill
        await anyio.to_thread.run_sync(p.record.flush, 30.0)
        print("flushed", p.record.pid, flush=True)
        await anyio.sleep(60)  # killed in here: what the writer flushed is on disk

asyncio.run(main())
"""


def test_a_killed_run_leaves_a_readable_record(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, str(tmp_path)],
        cwd=root, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    try:
        assert child.stdout is not None
        said, writer = child.stdout.readline().split()
        assert said == "flushed"
    finally:
        child.kill()
        child.wait(DEADLINE_S)
    # The writer process ends with its producer: the pipe's end of file is its exit.
    assert exits_within(int(writer), DEADLINE_S)
    _, groups, trains, step_lines = lines(tmp_path)
    assert [s.step for s in step_lines] == [1, 2, 3, 4]  # all flushed, the short one too
    assert {1, 2, 3} <= {g.step for g in groups}
    assert len([t for t in trains if t.step <= 3]) == 3 * 2 * 4
    # A line cut anywhere (the kill came in the middle of a write) costs that line alone.
    before = len(list(read_record(tmp_path)))
    last = record_files(tmp_path)[-1]
    data = last.read_bytes()
    data = data[: data.rfind(b"\n") + 1]  # its whole lines (the kill may have cut one)
    start = data.rfind(b"\n", 0, len(data) - 1) + 1  # the last whole line, cut in two
    last.write_bytes(data[: (start + len(data)) // 2])
    assert len(list(read_record(tmp_path))) == before - 1


def exits_within(pid: int, timeout: float) -> bool:
    """Whether process `pid` (not a child of ours) has ended or ends within `timeout`."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


class Unreadable(Letters):
    """A tokenizer that pickles but does not load (a library the writer cannot import)."""

    def __init__(self) -> None:
        self.vocabulary = "elsewhere"  # a state: unpickling calls __setstate__

    def __setstate__(self, state: object) -> None:
        raise RuntimeError("this tokenizer's vocabulary is not here")


async def test_a_writer_that_cannot_start_stops_the_entry_with_its_cause(tmp_path: Path) -> None:
    p = producer(RecordConfig(dir=str(tmp_path), tokenizer=Unreadable()))
    with pytest.raises(RuntimeError, match=r"writer process did not start: RuntimeError: this "):
        async with p:
            pass
    assert p.record.pid is None


async def test_a_writer_that_dies_costs_the_record_not_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    p = producer(tmp_path)
    async with p:
        await run_steps(p, 2)
        assert await anyio.to_thread.run_sync(p.record.flush, DEADLINE_S)
        pid = p.record.pid
        assert pid is not None
        written = p.record.stats.groups
        os.kill(pid, signal.SIGKILL)
        await anyio.to_thread.run_sync(p.record._threads[1].join, DEADLINE_S)  # heard it end
        await run_steps(p, 3)  # the run goes on
        assert not await anyio.to_thread.run_sync(p.record.flush, DEADLINE_S)
    assert p.record.stats.dropped_closed > 0
    assert p.record.stats.groups == written
    assert "the run record's writer failed: it exited before the run's end" in caplog.text
    _, groups, _, _ = lines(tmp_path)
    assert {g.step for g in groups if g.step is not None} == {1, 2}


def test_a_folder_that_cannot_be_written_is_refused_when_the_producer_is_built(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=r"record=.*cannot be written to .*give a folder"):
        producer(blocker / "run")


async def test_a_new_run_refuses_a_folder_with_a_record_and_a_resumed_one_appends(
    tmp_path: Path,
) -> None:
    p = producer(tmp_path)
    async with p:
        await run_steps(p, 1)
        await p.pause()
        await p.save(tmp_path / "ckpt")
        await p.resume()
    again = producer(tmp_path)
    with pytest.raises(ValueError, match="already holds a run's record"):
        async with again:
            pass
    resumed = producer(tmp_path)
    resumed.load(tmp_path / "ckpt", weights=None)
    resumed.record.steps = 1  # the trainer names the step it resumes at
    async with resumed:
        await run_steps(resumed, 1, attach=False)
    runs, groups, _, step_lines = lines(tmp_path)
    assert [s.step for s in step_lines] == [1, 2]
    assert len(runs) == 2 and len(record_files(tmp_path)) == 2
    assert [r.first_step for r in runs] == [1, 2]  # the resumed run's lines replace from 2 on
    assert sorted({g.step for g in groups if g.step is not None}) == [1, 2]
