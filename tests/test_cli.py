"""The command line: --version, --help that says what each command does, and the demo's quiet
terminal (engine output to a file, the bar and summary to the terminal)."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import asyncroll
from asyncroll.app import cli, demo_chat, demo_tool
from asyncroll.app.demo import DemoConfig, run_demo


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"asyncroll {asyncroll.__version__}"
    assert asyncroll.__version__ and asyncroll.__version__ != "0+unknown"


def test_help_says_what_each_command_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top = capsys.readouterr().out
    assert "demo" in top and "GRPO" in top and "simulate" in top and "SimEngine" in top
    assert "report" in top and "HTML" in top
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    demo = capsys.readouterr().out
    assert "engine.log" in demo and "--verbose" in demo and "echo" in demo


def test_a_demo_flag_out_of_its_choices_is_refused_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    refused = [("--credit", "token"), ("--task", "maze"), ("--filter", "std")]
    refused += [("--entropy-on", "some"), ("--push-on", "all")]
    for flag, value in refused:
        with pytest.raises(SystemExit) as exit_:
            cli.main(["demo", flag, value])
        assert exit_.value.code == 2
        assert f"{flag} must be one of" in capsys.readouterr().err


def test_tool_echo_takes_its_own_defaults_and_a_given_flag_wins() -> None:
    """`asyncroll demo --task tool_echo` runs with `demo_tool.DEFAULTS` (4-token turns: with the
    echo task's 8, seed 1 stalled near 0.84); a flag given on the command line wins, and the
    echo task keeps `DemoConfig`'s defaults."""
    parser = cli._parser()

    def config(*flags: str) -> DemoConfig:
        return cli._demo_config(parser.parse_args(["demo", *flags]))

    assert config() == DemoConfig()
    tool = config("--task", "tool_echo")
    assert (tool.task, tool.max_new_tokens, tool.steps) == ("tool_echo", 4, 200)
    assert (tool.filter, tool.entropy, tool.entropy_on) == ("none", 0.03, "all")
    assert config("--task", "tool_echo", "--entropy-on", "failed").entropy_on == "failed"
    assert (tool.blind_push, tool.push_on) == (1.0, "failed")
    assert config("--task", "tool_echo", "--push-on", "blind").push_on == "blind"
    assert {k: getattr(tool, k) for k in demo_tool.DEFAULTS} == demo_tool.DEFAULTS
    assert config("--task", "tool_echo", "--max-new-tokens", "8").max_new_tokens == 8
    assert config("--max-new-tokens", "3").max_new_tokens == 3
    assert "(default 8; tool_echo: 4; chat: 4)" in " ".join(_demo_help(parser).split())


def test_chat_takes_its_own_defaults_and_evaluates_only_with_a_held_out_set() -> None:
    parser = cli._parser()

    def config(*flags: str) -> DemoConfig:
        return cli._demo_config(parser.parse_args(["demo", *flags]))

    chat = config("--task", "chat")
    assert {k: getattr(chat, k) for k in demo_chat.DEFAULTS} == demo_chat.DEFAULTS
    assert chat.eval_every == 10 and config("--task", "chat", "--eval-every", "5").eval_every == 5
    assert config().eval_every == 0
    with pytest.raises(ValueError, match="only --task chat has one"):
        config("--eval-every", "3")


def test_the_demo_filter_is_an_option_and_a_task_default() -> None:
    """`--filter none` trains on every group, zero-variance ones included (their only gradient
    is the entropy bonus's); the echo task keeps DAPO's `nonzero_std`. Not given, tool_echo's
    own default applies (the flag must not fill in `DemoConfig`'s over it)."""
    parser = cli._parser()

    def config(*flags: str) -> DemoConfig:
        return cli._demo_config(parser.parse_args(["demo", *flags]))

    assert config().filter == "nonzero_std"
    assert config("--filter", "none").filter == "none"
    tool = demo_tool.DEFAULTS.get("filter", "nonzero_std")
    assert config("--task", "tool_echo").filter == tool
    assert config("--task", "tool_echo", "--filter", "nonzero_std").filter == "nonzero_std"
    with pytest.raises(ValueError, match="--filter must be one of nonzero_std, none"):
        DemoConfig(filter="std")


def _demo_help(parser: argparse.ArgumentParser) -> str:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["demo"].format_help()


def test_every_option_has_help() -> None:
    parser = cli._parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        assert sub.description, name
        for action in sub._actions:
            assert action.help, (name, action.dest)


def test_py_typed_and_the_reports_page_ship_with_the_package() -> None:
    package = Path(asyncroll.__file__).parent
    assert (package / "py.typed").exists()
    assert (package / "report" / "assets" / "report.js").exists()
    pyproject = (package.parent / "pyproject.toml").read_text()
    assert 'asyncroll = ["py.typed", "report/assets/*"]' in pyproject


CHILD = "import sys; print('child stdout'); print('child stderr', file=sys.stderr)"


def test_engine_output_goes_to_the_file_and_the_console_to_the_terminal(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A process started inside (as vLLM's engine and workers are) writes to the log file, and
    so do the library's log records; the console stays the terminal, and the terminal comes
    back afterwards. (This process's own sys.stdout is pytest's here; `asyncroll demo` in
    tests/vllm/test_demo_cli.py checks it.)"""
    path = tmp_path / "run" / "engine.log"
    with cli.engine_output(path, verbose=False) as console:
        subprocess.run([sys.executable, "-c", CHILD], check=True)
        logging.getLogger("asyncroll.producer").warning("library warning")
        logging.getLogger("asyncroll.producer").debug("library debug")
        print("the bar", file=console)
    print("after")
    out, err = capfd.readouterr()
    log = path.read_text()
    for line in ("child stdout", "child stderr", "library warning"):
        assert line in log and line not in out + err, line
    assert "library debug" not in log  # INFO and above in the file
    assert "the bar" in out and "after" in out and str(path) in out
    assert logging.getLogger("asyncroll").level == logging.NOTSET  # put back


def test_engine_output_gives_the_terminal_back_on_an_exception(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(RuntimeError), cli.engine_output(tmp_path / "e.log", verbose=False):
        raise RuntimeError("boom")
    print("visible")
    assert "visible" in capfd.readouterr().out


def test_verbose_redirects_nothing(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    with cli.engine_output(tmp_path / "e.log", verbose=True) as console:
        subprocess.run([sys.executable, "-c", CHILD], check=True)
        assert console is sys.stdout
    out, err = capfd.readouterr()
    assert "child stdout" in out and "child stderr" in err
    assert not (tmp_path / "e.log").exists()


async def test_run_demo_refuses_a_given_engine_past_version_0(tmp_path: Path) -> None:
    """An engine given to `run_demo` (the tests share one) must serve the demo's model at
    version 0, as a fresh engine does: one left at another version is refused by name."""

    class Used:
        version = 3

    used: Any = Used()
    with pytest.raises(ValueError, match="the engine given serves version 3: give it at 0"):
        await run_demo(DemoConfig(steps=1, out=str(tmp_path)), progress=False, engine=used)
