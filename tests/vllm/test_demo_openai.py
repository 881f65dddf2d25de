"""`asyncroll demo --task openai_echo` for real, short: tool_echo run by a plain openai-client
agent through the agent endpoint, on the session's vLLM engine, trained by the demo's trainer.
Every trained episode is exactly what the engine sampled (prefixes, ids, logprobs, versions),
the loss mask is 1 on exactly the sampled ids and the rest is tool_echo's answers (after the
template's end of turn where a turn was cut), and what the agent scored is the text of those
ids."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncroll.app import demo, demo_openai, demo_tool
from asyncroll.app.demo import demo_config, run_demo
from asyncroll.engines import VLLMEngine
from asyncroll.engines.base import GenerateRequest, SampleOutput
from asyncroll.types import RolloutGroup
from tests.vllm.test_demo import demo_engine, load_demo_model

pytest.importorskip("openai")
__all__ = ["demo_engine"]  # the fixture, shared with the other demo tests

EOS = 1


class Recorder:
    """The engine, with every request, its outputs and how long it took recorded."""

    def __init__(self, engine: VLLMEngine) -> None:
        self._engine = engine
        self.seen: list[tuple[GenerateRequest, Sequence[SampleOutput]]] = []
        self.took: dict[str, float] = {}  # request id: seconds in the engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        start = time.perf_counter()
        outputs = await self._engine.generate(request)
        self.took[request.request_id] = time.perf_counter() - start
        self.seen.append((request, outputs))
        return outputs


def check_episode(
    group: RolloutGroup, index: int, recorder: Recorder, tokenizer: Any
) -> list[tuple[float, float]]:
    """Sample `index` of `group` against the engine's requests for its episode; each turn's
    (call's wall time as the agent saw it, time in the engine)."""
    seen = recorder.seen
    sample = group.samples[index]
    assert sample.loss_mask is not None and sample.turn_ends is not None
    session = re.compile(rf"-{group.uid}-\d+-s{index}$")
    mine = [(r, o) for r, o in seen if r.session is not None and session.search(r.session)]
    assert mine, "no engine request of this episode was recorded"
    tokens, mask = sample.tokens, sample.loss_mask.astype(bool)
    sampled = np.zeros(len(tokens), dtype=bool)
    for request, (out,) in mine:
        assert request.prompt_tokens.tolist() == group.prompt_tokens.tolist()
        start = len(request.samples[0].prefix)
        end = start + len(out.tokens)
        assert request.samples[0].prefix.tolist() == tokens[:start].tolist()
        assert tokens[start:end].tolist() == out.tokens.tolist()
        assert sample.logprobs[start:end].tolist() == out.logprobs.tolist()
        assert sample.versions[start:end].tolist() == out.versions.tolist()
        sampled[start:end] = True
    assert (mask == sampled).all()  # trained: exactly the engine's ids
    # The rest is tool_echo's answers, in order, each after the template's <|eos|> where
    # the policy turn before it did not end with one (cut by the token limit).
    turns = demo_tool.split_turns(sample)
    policy = [t.tolist() for is_policy, t in turns if is_policy]
    answers = [t.tolist() for is_policy, t in turns if not is_policy]
    want = group.metadata["answers"][: len(answers)]
    assert answers == [[EOS] * (p[-1] != EOS) + a for p, a in zip(policy, want, strict=False)]
    # What the agent scored is tool_echo's score of those ids, from their text.
    letters = group.metadata["letters"]
    for k, ids in enumerate(policy):
        ended = ids[-1] == EOS
        text = tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        want_score = demo_openai.turn_score(text, letters[k], len(ids))
        assert sample.extra["turn_scores"][k] == pytest.approx(want_score)
    assert sample.reward == pytest.approx(np.mean(sample.extra["turn_scores"]))
    starts = [0, *sample.turn_ends.tolist()][0::2]  # where each policy turn starts
    engine_s = [0.0] * len(policy)
    for request, _ in mine:
        turn = sum(1 for s in starts[1:] if len(request.samples[0].prefix) >= s)
        engine_s[turn] += recorder.took[request.request_id]
    return list(zip(sample.extra["call_s"], engine_s, strict=True))


async def test_openai_echo_records_what_the_engine_sampled_and_trains_on_it(
    tmp_path: Path, demo_engine: VLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    config = demo_config(
        task="openai_echo", seed=1, steps=6, batch_groups=8, lr=1e-2, out=str(tmp_path),
        solved_reward=0.0, batch_timeout_s=60.0,
    )  # fmt: skip
    trained: list[list[RolloutGroup]] = []
    step = demo.Trainer.step

    def recording_step(self: Any, groups: list[RolloutGroup], version: int) -> Any:
        trained.append(groups)
        return step(self, groups, version)

    monkeypatch.setattr(demo.Trainer, "step", recording_step)
    recorder = Recorder(await load_demo_model(demo_engine, config))
    records = await run_demo(config, progress=False, engine=recorder)  # type: ignore[arg-type]
    assert len(records) == config.steps and records[-1].failed_groups == 0
    tokenizer = AutoTokenizer.from_pretrained(str(demo.demo_model(config)))
    turns = [
        turn
        for groups in trained
        for group in groups
        for i in range(group.num_samples)
        for turn in check_episode(group, i, recorder, tokenizer)
    ]
    # The proxy's own cost per call (the call's wall time less the engine's, parked time in
    # a weight update included): printed for the record (-s), never asserted (a timing).
    call = np.array([c for c, _ in turns])
    own = call - np.array([e for _, e in turns])
    print(
        f"\nopenai_echo, {len(turns)} calls: call median {1e3 * np.median(call):.1f} ms, "
        f"proxy's own cost median {1e3 * np.median(own):.2f} ms "
        f"({np.median(own / call):.1%} of the call), mean {1e3 * own.mean():.2f} ms"
    )
    # The trainer stepped on each batch once, a full batch each time, in version order.
    assert [len(groups) for groups in trained] == [config.batch_groups] * config.steps
    assert [r.version for r in records] == list(range(config.steps))
