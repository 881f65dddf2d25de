"""The report's data, without a browser: what its files hold is the record, array by array;
its index and its chunks agree; bad records get errors that name the folder.
(tests/test_report_browser.py checks the page itself in headless Chromium.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from asyncroll.app.cli import main
from asyncroll.record.format import GroupLine, RecordError, StepLine, TrainLine
from asyncroll.report import build_report, decode_floats, encode_floats
from tests.report_records import make_run, record_lines, write_record


def read_script(path: Path, call: str) -> list[Any]:
    """The arguments of a data file's one call (`asyncrollReport.<call>(...)`), as JSON."""
    text = path.read_text(encoding="utf-8")
    head = f"asyncrollReport.{call}("
    assert text.startswith(head) and text.endswith(");\n"), f"{path} is not one {head}...) call"
    return list(json.loads("[" + text[len(head) : -3] + "]"))


def summary(index: Path) -> dict[str, Any]:
    (data,) = read_script(index.parent / "data" / "run.js", "run")
    return dict(data)


def chunks(index: Path) -> dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    out = {}
    for c in summary(index)["chunks"]:
        n, groups, train = read_script(index.parent / c["file"], "chunk")
        assert n == c["chunk"]
        out[n] = (groups, train)
    return out


def test_a_chunk_holds_exactly_the_records_arrays(tmp_path: Path) -> None:
    run, lines = make_run(tmp_path / "run", steps=4, groups=3, samples=3)
    index = build_report(run, steps_per_chunk=2)
    assert index == run / "report" / "index.html"
    data = chunks(index)
    by_uid = {g["uid"]: g for groups, _ in data.values() for g in groups}
    train = {(t["uid"], t["index"]): t for _, ts in data.values() for t in ts}
    record_groups = [x for x in lines if isinstance(x, GroupLine)]
    assert sorted(by_uid) == sorted(g.uid for g in record_groups)
    compared = 0
    for group in record_groups:
        shown = by_uid[group.uid]
        assert shown["prompt_text"] == group.prompt_text
        assert shown["prompt_tokens"] == group.prompt_tokens
        assert (shown["step"], shown["drop_reason"]) == (group.step, group.drop_reason)
        for sample, page in zip(group.samples, shown["samples"], strict=True):
            for name in ("tokens", "pieces", "versions", "loss_mask", "turn_ends", "reward"):
                assert page[name] == getattr(sample, name), name
            assert decode_floats(page["logprobs"]) == sample.logprobs  # bit for bit
            assert page["logprobs"].startswith("f4:")
            compared += len(sample.tokens)
    assert compared > 200
    for t in (x for x in lines if isinstance(x, TrainLine)):
        assert decode_floats(train[t.uid, t.index]["logprobs"]) == t.logprobs
        assert decode_floats(train[t.uid, t.index]["advantages"]) == t.advantages
    assert any(None in t.logprobs for t in lines if isinstance(t, TrainLine) and t.logprobs)


def test_floats_that_are_not_float32_are_kept_as_float64() -> None:
    values = [0.1, None, -2.5]  # 0.1 is no float32
    text = encode_floats(values)
    assert text is not None and text.startswith("f8:")
    assert decode_floats(text) == values
    assert decode_floats(encode_floats([float(np.float32(0.1)), None])) == [
        float(np.float32(0.1)),
        None,
    ]
    assert encode_floats(None) is None


def test_the_index_holds_what_the_search_and_the_step_table_read(tmp_path: Path) -> None:
    run, lines = make_run(tmp_path / "run", steps=4, groups=2, samples=3)
    index = build_report(run, steps_per_chunk=3)
    s = summary(index)
    g = s["groups"]
    groups = [x for x in lines if isinstance(x, GroupLine)]
    assert g["uid"] == [x.uid for x in groups]
    assert g["prompt_id"] == [x.prompt_id for x in groups]
    assert g["rewards"] == [[y.reward for y in x.samples] for x in groups]
    assert g["tokens"] == [sum(len(y.tokens) for y in x.samples) for x in groups]
    data = chunks(index)
    for uid, chunk in zip(g["uid"], g["chunk"], strict=True):  # the index points at its file
        assert uid in {x["uid"] for x in data[chunk][0]}
    steps = [x for x in lines if isinstance(x, StepLine)]
    assert s["steps"]["step"] == [x.step for x in steps]
    for key in {k for x in steps for k in x.metrics}:
        assert s["steps"]["metrics"][key] == [x.metrics.get(key) for x in steps]
    assert None in s["steps"]["metrics"]["eval/pass@1"]  # a metric some steps lack


def test_paging_puts_each_step_and_each_dropped_group_in_its_chunk(tmp_path: Path) -> None:
    run, lines = make_run(tmp_path / "run", steps=5, first_step=1, dropped_every=2)
    index = build_report(run, steps_per_chunk=2)
    info = summary(index)["chunks"]
    assert [(c["chunk"], c["first_step"], c["last_step"]) for c in info] == [
        (0, 0, 1), (1, 2, 3), (2, 4, 5),
    ]  # fmt: skip
    data = chunks(index)
    steps_of = {n: sorted({g["near"] for g in groups}) for n, (groups, _) in data.items()}
    assert steps_of == {0: [1], 1: [2, 3], 2: [4, 5]}
    near_of = {g["uid"]: g["near"] for gs, _ in data.values() for g in gs}
    last_step = None  # a dropped group belongs to the last step written before it
    for line in lines:
        if isinstance(line, GroupLine):
            if line.step is None:
                assert near_of[line.uid] == last_step, line.uid
            else:
                last_step = line.step
        elif isinstance(line, StepLine):
            last_step = line.step
    dropped = [g for gs, _ in data.values() for g in gs if g["step"] is None]
    assert len(dropped) == 2 and all(g["drop_reason"] == "engine_error" for g in dropped)
    for n, (groups, train) in data.items():  # the trainer's lines travel with their groups
        assert {t["uid"] for t in train} <= {g["uid"] for g in groups}, n


def test_a_cut_last_line_is_left_out_and_the_rest_is_reported(tmp_path: Path) -> None:
    lines = record_lines(steps=3)
    run = write_record(tmp_path / "run", lines, files=1)
    path = run / "record" / "rollouts-000000.jsonl"
    raw = path.read_bytes()
    path.write_bytes(raw[: raw.rindex(b"\n", 0, len(raw) - 1) + 40])  # the last line, cut
    s = summary(build_report(run))
    assert isinstance(lines[-1], StepLine)
    assert s["steps"]["step"] == [x.step for x in lines[:-1] if isinstance(x, StepLine)]
    assert s["lines"] == len(lines) - 1


def test_a_bad_line_inside_the_record_names_its_file_and_line(tmp_path: Path) -> None:
    run = write_record(tmp_path / "run", record_lines(steps=2), files=1)
    path = run / "record" / "rollouts-000000.jsonl"
    text = path.read_text().splitlines(keepends=True)
    text[2] = text[2][:30] + "\n"
    path.write_text("".join(text))
    with pytest.raises(RecordError, match=r"rollouts-000000\.jsonl:3:"):
        build_report(run)


def test_a_missing_or_empty_record_names_the_folder(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match=f"no record in {tmp_path / 'none' / 'record'}"):
        build_report(tmp_path / "none")
    (tmp_path / "empty" / "record").mkdir(parents=True)
    (tmp_path / "empty" / "record" / "rollouts-000000.jsonl").write_bytes(b"")
    with pytest.raises(RecordError, match=f"record in {tmp_path / 'empty'} holds no lines"):
        build_report(tmp_path / "empty")
    assert not (tmp_path / "empty" / "report").exists()


def test_a_rebuild_replaces_the_previous_chunks(tmp_path: Path) -> None:
    run, _ = make_run(tmp_path / "run", steps=6)
    build_report(run, steps_per_chunk=1)
    index = build_report(run, steps_per_chunk=3)
    files = sorted(p.name for p in (index.parent / "data").iterdir())
    assert files == ["chunk-00000.js", "chunk-00001.js", "chunk-00002.js", "run.js"]


def test_the_page_needs_no_network(tmp_path: Path) -> None:
    run, _ = make_run(tmp_path / "run")
    out = build_report(run, tmp_path / "elsewhere").parent
    assert out == tmp_path / "elsewhere"
    for path in out.rglob("*"):
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            assert "http://" not in text.replace("http://www.w3.org/2000/svg", ""), path
            assert "https://" not in text and "fetch(" not in text, path
    assert '<script src="report.js">' in (out / "index.html").read_text()


def test_the_report_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, _ = make_run(tmp_path / "run")
    main(["report", str(run), "--out", str(tmp_path / "r"), "--steps-per-chunk", "2"])
    out = capsys.readouterr().out
    assert f"{tmp_path / 'r' / 'index.html'}" in out
    assert summary(tmp_path / "r" / "index.html")["steps_per_chunk"] == 2
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(tmp_path / "nothing")])
    assert exit_.value.code == 1
    assert f"no record in {tmp_path / 'nothing' / 'record'}" in capsys.readouterr().err


async def test_a_producers_record_is_reported_as_the_groups_it_handed_out(tmp_path: Path) -> None:
    """A real producer's record (on SimEngine, a simulation; multi-turn episodes whose tool
    tokens are untrained): the report's arrays are the handed-out groups', token by token."""
    from tests.test_record import producer, run_steps

    p = producer(tmp_path, episodes=True)
    async with p:
        steps = await run_steps(p, 4)
    data = chunks(build_report(tmp_path, steps_per_chunk=2))
    by_uid = {g["uid"]: g for groups, _ in data.values() for g in groups}
    compared = 0
    for step, groups in enumerate(steps, 1):
        for group in groups:
            shown = by_uid[group.uid]
            assert (shown["step"], shown["near"]) == (step, step)
            for sample, page in zip(group.samples, shown["samples"], strict=True):
                assert page["tokens"] == sample.tokens.tolist()
                assert decode_floats(page["logprobs"]) == sample.logprobs.tolist()
                assert page["versions"] == sample.versions.tolist()
                mask = None if sample.loss_mask is None else sample.loss_mask.tolist()
                assert page["loss_mask"] == mask
                compared += len(sample.tokens)
    assert compared > 0
    assert any(0 in (s["loss_mask"] or []) for g in by_uid.values() for s in g["samples"])


def test_a_resumed_run_replaces_the_steps_it_ran_again(tmp_path: Path) -> None:
    """The first run recorded steps 1-4 and died; its checkpoint was of step 2, so the resumed
    run (its `RunLine.first_step` 3) ran steps 3-5 again. The report holds steps 1-2 of the
    first run and 3-5 of the second, each group and trainer line once; a dropped group goes
    with the step written before it."""
    first = record_lines(steps=4, first_step=1, dropped_every=2, seed=0)
    again = [
        msgspec.structs.replace(line, uid=line.uid + 1000)
        if isinstance(line, GroupLine | TrainLine)
        else line
        for line in record_lines(steps=3, first_step=3, dropped_every=2, seed=1)
    ]
    again[0] = msgspec.structs.replace(again[0], first_step=3)
    run = write_record(tmp_path / "run", first + again, files=2)
    index = build_report(run, steps_per_chunk=2)

    near, kept_uids = 0, []
    for line in first:
        if isinstance(line, GroupLine | StepLine):
            near = line.step if line.step is not None else near
        if isinstance(line, GroupLine) and near < 3:
            kept_uids.append(line.uid)
    expected = kept_uids + [x.uid for x in again if isinstance(x, GroupLine)]
    s = summary(index)
    assert s["groups"]["uid"] == expected
    data = chunks(index)
    assert sorted(g["uid"] for groups, _ in data.values() for g in groups) == sorted(expected)
    trained = [(t.uid, t.index) for t in first if isinstance(t, TrainLine) and t.step < 3]
    trained += [(t.uid, t.index) for t in again if isinstance(t, TrainLine)]
    assert sorted((t["uid"], t["index"]) for _, train in data.values() for t in train) == sorted(
        trained
    )
    steps = [x for x in first if isinstance(x, StepLine) and x.step < 3]
    steps += [x for x in again if isinstance(x, StepLine)]
    assert s["steps"]["step"] == [1, 2, 3, 4, 5]
    assert s["steps"]["metrics"]["rollout/reward_mean"] == [
        x.metrics["rollout/reward_mean"] for x in steps
    ]
