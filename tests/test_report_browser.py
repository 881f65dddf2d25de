"""The report in a real browser: headless Chromium (Debian's package; `make test` installs it
where it can, tests/browser.py drives it) opens a report from disk and the page shows each
sample as the record holds it: its token count, loss mask, versions, turns and both logprobs,
with no console error. One browser start serves the module (~1-2 s); each check is one
navigation.

`check_sample` takes any run folder: tests/vllm/test_demo_chat.py points it at the chat demo's
run, so the demo's own report is checked in the browser too."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from asyncroll.record.format import GroupLine, Line, TrainLine, read_record
from asyncroll.report import build_report
from tests.browser import SAMPLE_FACTS, Chromium, chromium, find_chromium
from tests.report_records import make_run

CHROMIUM = find_chromium()
pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no chromium on PATH: `make browser` installs Debian's package (as root with "
        "apt-get), or set ASYNCROLL_CHROMIUM to a Chromium or Chrome",
    ),
    pytest.mark.xdist_group("report_browser"),  # one worker, so one browser start
]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Chromium]:
    async with chromium(CHROMIUM) as b:
        yield b


def _url(index: Path, **state: object) -> str:
    return index.resolve().as_uri() + "#" + "&".join(f"{k}={v}" for k, v in state.items())


async def check_sample(
    browser: Chromium, run_dir: Path, lines: list[Line], uid: int, index: int, mode: str = "gap"
) -> dict[str, Any]:
    """Open the report of `run_dir` at sample `index` of group `uid` and assert that the page
    shows it as `lines` (the run's record) hold it; returns what the page showed."""
    report = build_report(run_dir)
    group = next(x for x in lines if isinstance(x, GroupLine) and x.uid == uid)
    sample = group.samples[index]
    train = [x for x in lines if isinstance(x, TrainLine) and (x.uid, x.index) == (uid, index)]
    await browser.open(_url(report, mode=mode, group=uid, sample=index))
    facts: dict[str, Any] = await browser.evaluate(SAMPLE_FACTS)
    n = len(sample.tokens)
    assert facts["title"] == f"Sample {index} of group {uid} ({n} tokens)"
    assert facts["count"] == n
    assert facts["tokens"] == sample.tokens
    assert facts["mask"] == (sample.loss_mask or [1] * n)
    assert facts["bridges"] == facts["mask"].count(0)
    assert facts["versions"] == sample.versions
    assert facts["turn_ends"] == list(range(1, len(sample.turn_ends or []) + 1))  # 1 turn: none
    assert facts["logprobs"] == sample.logprobs  # float32 widened, bit for bit
    assert facts["trainer"] == (train[-1].logprobs if train else None)
    assert facts["page_errors"] == [] and browser.errors == []
    return facts


async def test_the_page_shows_each_sample_as_the_record_holds_it(
    browser: Chromium, tmp_path: Path
) -> None:
    run, lines = make_run(tmp_path / "run", steps=4, groups=2, samples=2, tokens=14)
    report = build_report(run, steps_per_chunk=2)
    await browser.open(_url(report))
    assert await browser.evaluate("document.querySelectorAll('script[src*=chunk]').length") == 0
    assert await browser.evaluate("document.querySelectorAll('#charts .chart svg').length") == 6
    groups = [x for x in lines if isinstance(x, GroupLine)]
    chat = next(g for g in groups if g.task == "chat" and g.step is not None)
    echo = next(g for g in groups if g.task == "echo" and g.step is not None)
    facts = await check_sample(browser, run, lines, chat.uid, 1, mode="mask")
    assert 0 in facts["mask"] and len(facts["turn_ends"]) == 3  # a chat episode's bridge
    assert None in facts["trainer"]  # no trainer logprob at its untrained tokens
    await check_sample(browser, run, lines, echo.uid, 0, mode="version")
    dropped = next(g for g in groups if g.step is None)
    await check_sample(browser, run, lines, dropped.uid, 0, mode="gap")  # not trained: none
    loaded = "[...document.querySelectorAll('script[src*=chunk]')].map(s => s.getAttribute('src'))"
    assert len(await browser.evaluate(loaded)) == 1  # only the chunk of the sample shown
    shot = await browser.screenshot(tmp_path / "report.png")
    assert shot.read_bytes().startswith(PNG)


async def test_the_search_finds_groups_by_prompt_id_and_by_reward(
    browser: Chromium, tmp_path: Path
) -> None:
    run, lines = make_run(tmp_path / "run", steps=6, groups=3, samples=3)
    await browser.open(_url(build_report(run)))
    groups = [x for x in lines if isinstance(x, GroupLine)]

    async def search(prompt: str, low: str, high: str) -> list[int]:
        uids: list[int] = await browser.evaluate(f"""(() => {{
            document.getElementById('q-prompt').value = {prompt!r};
            document.getElementById('q-min').value = {low!r};
            document.getElementById('q-max').value = {high!r};
            document.getElementById('search').requestSubmit();
            return [...document.querySelectorAll('#results tbody tr')].map(r => +r.dataset.uid);
        }})()""")
        return uids

    by_id = [g.uid for g in groups if "p2" in g.prompt_id]
    assert by_id and await search("P2", "", "") == by_id
    scored = [g.uid for g in groups if any(0.5 <= (s.reward or -1) <= 0.75 for s in g.samples)]
    assert 0 < len(scored) < len(groups) and await search("", "0.5", "0.75") == scored
    both = [u for u in scored if u in by_id]
    assert await search("p2", "0.5", "0.75") == both
    assert browser.errors == []


async def test_a_missing_data_file_is_an_error_the_page_and_the_test_see(
    browser: Chromium, tmp_path: Path
) -> None:
    """The check for console errors can fail: a chunk whose file is gone is reported."""
    run, lines = make_run(tmp_path / "run", steps=2)
    report = build_report(run)
    (report.parent / "data" / "chunk-00000.js").unlink()
    uid = next(x.uid for x in lines if isinstance(x, GroupLine))
    await browser.open(_url(report, group=uid, sample=0))
    await browser.evaluate("asyncrollReport.settled()")
    title = await browser.evaluate("document.getElementById('group-title').textContent")
    assert "could not load data/chunk-00000.js" in title
    assert any("chunk-00000.js" in e for e in browser.errors), browser.errors
    assert await browser.evaluate("window.reportErrors.length") >= 1


async def test_a_producers_report_shows_its_samples(browser: Chromium, tmp_path: Path) -> None:
    """The report of a record a real producer wrote (SimEngine, a simulation; multi-turn
    episodes): the page shows a handed-out sample as the producer handed it out."""
    from tests.test_record import producer, run_steps

    p = producer(tmp_path, episodes=True)
    async with p:
        steps = await run_steps(p, 3)
    group = steps[-1][0]
    sample = next(i for i, s in enumerate(group.samples) if s.loss_mask is not None)
    facts = await check_sample(browser, tmp_path, list(read_record(tmp_path)), group.uid, sample)
    handed = group.samples[sample]
    assert facts["tokens"] == handed.tokens.tolist()
    assert facts["mask"] == handed.loss_mask.tolist() and 0 in facts["mask"]
    assert facts["versions"] == handed.versions.tolist()
    assert facts["logprobs"] == handed.logprobs.tolist()
    charts = await browser.evaluate(
        "[...document.querySelectorAll('#charts .chart')].filter(c => c.querySelector('svg'))"
        ".map(c => c.dataset.title)"
    )  # the producer's own metric names find their curves (no evaluation ran)
    assert charts == [
        "reward", "staleness (versions behind)", "dropped groups per step, by reason",
        "generated tokens/s", "trainer's waiting share",
    ]  # fmt: skip
