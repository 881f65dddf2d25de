"""The openai_echo demo task (`asyncroll.app.demo_openai`) with a scripted engine (a simulation:
it returns the ids the test gives it): the openai-client agent gets each reply that ends its
turn as a `say` tool call and each reply cut by the token limit as text, answers either with
tool_echo's next letter and scores the text it was given as tool_echo scores the ids; the
stream is tool_echo's but for the end of turn after a cut turn. The real engine runs it in
tests/vllm/test_demo_openai.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import numpy as np
import pytest

from asyncroll import Producer, SamplingConfig
from asyncroll.app import demo_openai, demo_tool
from asyncroll.app.demo import demo_config
from asyncroll.app.models import build_tiny_model
from tests.test_chat_episodes import ScriptEngine
from tests.test_cli import _demo_help

pytest.importorskip("openai")
pytest.importorskip("aiohttp")

SAMPLING = SamplingConfig(max_new_tokens=4)
EOS = 1


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_model()


def tokenizer(model_dir: Path) -> object:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


async def run_one(model_dir: Path, script: list[tuple[list[int], str]]) -> tuple[object, object]:
    """One episode (a group of one) of the task's first prompt on `script`; (the group, the
    engine)."""
    raw = tokenizer(model_dir)
    task = demo_openai.OpenAIEchoTask(model_dir, raw, seed=3, sampling=SAMPLING)
    prompt = next(task.prompts())
    engine = ScriptEngine(script)
    producer = Producer(
        engine, [prompt], task.reward, group_size=1, batch_size=1, sampling=SAMPLING,
        filter=None, **task.episodes(),
    )  # fmt: skip
    async with task.serving(), producer:
        batch = await asyncio.wait_for(producer.produce_batch(1, timeout=60), 60)
    (group,) = batch.groups
    return group, engine


def letter_ids(model_dir: Path, letters: str) -> list[int]:
    raw = tokenizer(model_dir)
    return [raw.token_to_id(c) for c in letters]  # type: ignore[attr-defined]


async def test_ended_and_cut_turns_are_answered_with_the_next_letter_and_scored_as_tool_echo(
    model_dir: Path,
) -> None:
    raw = tokenizer(model_dir)
    letters = next(demo_tool.tool_echo_prompts(raw, 3)).metadata["letters"]
    a, b, c = letters
    other = next(x for x in demo_tool.LETTERS if x != b)
    episode = [
        ([*letter_ids(model_dir, a * 3), EOS], "stop"),  # ended, 3 of 4 tokens right
        (letter_ids(model_dir, b + other + b + b), "length"),  # cut, 3 of 4 right
        (letter_ids(model_dir, c * 4), "length"),  # cut, all right
    ]
    group, engine = await run_one(model_dir, episode)
    answers = group.metadata["answers"]
    (sample,) = group.samples
    assert sample.extra["turn_scores"] == pytest.approx([0.75, 0.75, 1.0])
    assert sample.reward == pytest.approx(2.5 / 3)
    assert len(sample.extra["call_s"]) == 3
    # The stream is tool_echo's, the template's <|eos|> after the cut turn (untrained) added.
    want = [*episode[0][0], *answers[0], *episode[1][0], EOS, *answers[1], *episode[2][0]]
    assert sample.tokens.tolist() == want
    assert sample.loss_mask is not None
    assert sample.loss_mask.tolist() == [1] * 4 + [0] * 2 + [1] * 4 + [0] * 3 + [1] * 4
    # The scores are tool_echo's of the same ids; they are the trainer's per-turn rewards.
    with_ids = msgspec.structs.replace(group, metadata={**group.metadata, "targets": [
        raw.token_to_id(x) for x in letters]})  # fmt: skip
    want_scores = demo_tool.turn_rewards(with_ids)[0].tolist()
    assert demo_openai.turn_scores(group)[0].tolist() == pytest.approx(want_scores)
    # Each call's prompt is the last one's stream plus the reply and the answer.
    assert [len(r.samples[0].prefix) for r in engine.requests] == [0, 6, 13]
    metrics = demo_openai.step_metrics([group])
    assert metrics["ended"] == pytest.approx(1 / 3) and metrics["reached2"] == 1.0


def test_the_parser_and_the_score() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tiny_model()))
    parser = demo_openai.SayParser(tok)
    ids = [*tok.encode("cc", add_special_tokens=False), EOS]
    reply = parser.parse(ids, prompt_ids=[])
    assert reply.finish_reason == "stop" and reply.content == ""
    (call,) = reply.tool_calls
    assert (call.name, call.arguments, call.ok) == ("say", {"text": "cc"}, True)
    cut = parser.parse(ids[:-1], prompt_ids=[])
    assert (cut.content, cut.tool_calls, cut.finish_reason) == ("cc", (), "length")
    turn = demo_openai.turn_score
    assert [turn("cccc", "c", 4), turn("cc", "c", 3), turn("cxc", "c", 4)] == [1, 2 / 3, 0.5]
    assert [turn("", "c", 1), turn("", "c", 0), turn("dddd", "c", 4)] == [0, 0, 0]
    assert turn("cccc", "c", 2) == 1.0  # never more than one per token


def test_the_task_takes_tool_echos_defaults() -> None:
    """`asyncroll demo --task openai_echo` trains as tool_echo does (its defaults); a flag
    given wins."""
    from asyncroll.app import cli

    parser = cli._parser()
    config = cli._demo_config(parser.parse_args(["demo", "--task", "openai_echo"]))
    assert config == demo_config(task="openai_echo") and config.task == "openai_echo"
    for name, value in demo_tool.DEFAULTS.items():
        assert getattr(config, name) == value, name
    flags = ["demo", "--task", "openai_echo", "--max-new-tokens", "6"]
    assert cli._demo_config(parser.parse_args(flags)).max_new_tokens == 6
    assert "openai_echo (tool_echo by an OpenAI-client agent" in " ".join(
        _demo_help(parser).split()
    )
    with pytest.raises(ValueError, match="--task must be one of"):
        demo_config(task="openai")


def test_the_first_calls_message_renders_to_tool_echos_prompt(model_dir: Path) -> None:
    raw = tokenizer(model_dir)
    task = demo_openai.OpenAIEchoTask(model_dir, raw, seed=0, sampling=SAMPLING)
    for prompt in [next(task.prompts()) for _ in range(3)]:
        first = [{"role": "user", "content": prompt.metadata["letters"][0]}]
        assert task.fmt.prompt_ids(first) == list(prompt.tokens)
        assert np.array_equal(task.fmt.bridge({"role": "assistant", "content": ""}, [
            {"role": "tool", "content": prompt.metadata["letters"][1], "tool_call_id": "x"}
        ]), prompt.metadata["answers"][0])  # fmt: skip
