"""The agent endpoint on real vLLM: a random-weight Qwen3-architecture model with the real
Qwen3 tokenizer and template, driven by the official `openai` client, streaming and not. Every
recorded episode is exactly the tokens the engine saw and sampled (prefixes, ids, logprobs,
versions), what the agent got back is the parse of those ids with their logprobs, and the
trainer's recomputation matches the behaviour logprobs."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asyncroll import Episode, Producer, SamplingConfig
from asyncroll.agents import AgentEndpoint, agent_reward
from asyncroll.chat.parse import RenderersParser
from asyncroll.chat.template import ChatFormat
from asyncroll.engines.base import GenerateRequest, SampleOutput
from asyncroll.train import token_logprobs
from tests.vllm.conftest import QWEN3_MAX_LEN

pytestmark = pytest.mark.vllm
openai = pytest.importorskip("openai")

MAX_LEN = QWEN3_MAX_LEN
DEADLINE_S = 300.0
SAMPLING = SamplingConfig(max_new_tokens=48, temperature=1.0, seed=0)
FIRST = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
MODEL = "asyncroll-policy"


class Recorder:
    """The engine, with every request and its outputs recorded."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.seen: list[tuple[GenerateRequest, Sequence[SampleOutput]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, request: GenerateRequest) -> Sequence[SampleOutput]:
        outputs = await self._engine.generate(request)
        self.seen.append((request, outputs))
        return outputs


@pytest.fixture
def engine(qwen3_engine: Any) -> Any:
    return qwen3_engine  # the session's (tests/vllm/conftest.py)


async def agent_loop(base_url: str, episode: Episode, stream: bool, got: dict[int, Any]) -> float:
    """Plain OpenAI-client code: three turns, a user message after each finished one."""
    c = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120.0)
    messages: list[dict[str, Any]] = [dict(m) for m in FIRST]
    replies = got.setdefault(episode.index, [])
    for t in range(3):
        kw: dict[str, Any] = {"model": MODEL, "messages": messages, "logprobs": True}
        if stream:
            content, lps, finish = "", [], ""
            async for chunk in await c.chat.completions.create(**kw, stream=True):
                choice = chunk.choices[0]
                content += choice.delta.content or ""
                lps += [x.logprob for x in (choice.logprobs.content if choice.logprobs else [])]
                finish = choice.finish_reason or finish
        else:
            r = await c.chat.completions.create(**kw)
            choice = r.choices[0]
            content, finish = choice.message.content or "", choice.finish_reason
            lps = [x.logprob for x in choice.logprobs.content]
        replies.append((content, lps))
        if finish != "stop":
            break
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": f"turn {t}: go on"},
        ]
    return float(len(replies))


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_agents_on_vllm_record_exactly_what_the_engine_sampled(
    engine: Any, qwen3_model: Path, stream: bool
) -> None:
    import renderers
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(qwen3_model))
    fmt = ChatFormat(tok)

    def parser(tools: Sequence[dict[str, Any]] | None) -> RenderersParser:
        return RenderersParser(tok, renderers.Qwen3RendererConfig(), tools=tools)

    rec = Recorder(engine)
    got: dict[int, Any] = {}
    prompt = fmt.prompt_ids(FIRST)
    async with AgentEndpoint(fmt, parser, sampling=SAMPLING) as endpoint:

        async def agent(base_url: str, episode: Episode) -> float:
            return await agent_loop(base_url, episode, stream, got)

        producer = Producer(
            rec, [prompt], agent_reward, rollout_fn=endpoint.rollout(agent), group_size=2,
            batch_size=1, sampling=SAMPLING, max_turns=3, max_episode_tokens=1024,
        )  # fmt: skip
        async with asyncio.timeout(DEADLINE_S), producer:
            batch = await producer.produce_batch(1, timeout=DEADLINE_S)
    (group,) = batch.groups
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen3_model, dtype=torch.float32)
    p = RenderersParser(tok, renderers.Qwen3RendererConfig())
    for i, sample in enumerate(group.samples):
        assert sample.loss_mask is not None and sample.turn_ends is not None
        mask = sample.loss_mask.astype(bool)
        tokens = sample.tokens
        # The engine's requests for this episode, in order: each prefix is the stream so far.
        mine = [
            (r, o) for r, o in rec.seen if r.session is not None and r.session.endswith(f"-s{i}")
        ]
        sampled = []
        for request, (out,) in mine:
            assert request.prompt_tokens.tolist() == prompt
            start = len(request.samples[0].prefix)
            assert request.samples[0].prefix.tolist() == tokens[:start].tolist()
            assert tokens[start : start + len(out.tokens)].tolist() == out.tokens.tolist()
            assert (
                sample.logprobs[start : start + len(out.tokens)].tolist() == out.logprobs.tolist()
            )
            assert (
                sample.versions[start : start + len(out.tokens)].tolist() == out.versions.tolist()
            )
            sampled += out.tokens.tolist()
        assert tokens[mask].tolist() == sampled  # trained: exactly the engine's ids
        # What the agent got: the parse of those ids, with their logprobs.
        replies = got[i]
        assert len(replies) == sample.num_turns - (sample.num_turns - 1) // 2
        ends = [0, *sample.turn_ends.tolist()]
        policy = [(a, b) for a, b in itertools.pairwise(ends) if mask[a:b].all()]
        for (content, lps), (a, b) in zip(replies, policy, strict=True):
            assert lps == sample.logprobs[a:b].tolist()
            ids = tokens[a:b].tolist()
            assert content == p.parse(ids, prompt_ids=prompt + tokens[:a].tolist()).content
        ids_t = torch.tensor(np.concatenate([prompt, tokens])[None].astype(np.int64))
        with torch.no_grad():
            ours = token_logprobs(model(input_ids=ids_t).logits, ids_t)[0, len(prompt) :]
        gap = (ours[torch.from_numpy(mask)] - torch.from_numpy(sample.logprobs[mask])).abs()
        assert gap.max() < 1e-3, gap.max()
