"""Chat episodes on a random-weight Qwen3-architecture model with the real 151k Qwen3
tokenizer and chat template, served by vLLM in process and by `vllm serve`: each turn stops at
`<|im_end|>`, the next turn continues the exact sampled stream, every trained token's logprob
is the trainer's recomputation on the same ids, and the loss mask is 1 exactly on sampled ids."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch

from asyncroll import Episode, Producer, SamplingConfig
from asyncroll.chat.episode import ChatEpisode
from asyncroll.chat.parse import RenderersParser
from asyncroll.chat.template import ChatFormat
from asyncroll.engines.base import Engine
from asyncroll.train import token_logprobs
from asyncroll.types import RolloutGroup
from tests.test_record import check_sample
from tests.test_record import lines as record_lines
from tests.vllm.conftest import QWEN3_MAX_LEN

pytestmark = pytest.mark.vllm

VOCAB = 151936
MAX_LEN = QWEN3_MAX_LEN
DEADLINE_S = 300.0
SAMPLING = SamplingConfig(max_new_tokens=64, temperature=1.0, seed=0)
FIRST = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def chat(qwen3_model: Path) -> tuple[ChatFormat, RenderersParser]:
    import renderers
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(qwen3_model))
    return ChatFormat(tok), RenderersParser(tok, renderers.Qwen3RendererConfig())


@pytest.fixture(scope="module")
def server(qwen3_model: Path) -> Iterator[Any]:
    from asyncroll.engines.server.launch import ServerProcess

    proc = ServerProcess.start(qwen3_model, max_model_len=MAX_LEN)
    try:
        yield proc
    finally:
        proc.stop()


@pytest_asyncio.fixture
async def qwen3_server_engine(server: Any) -> AsyncIterator[Engine]:
    from asyncroll.engines import VLLMServerEngine

    eng = VLLMServerEngine(
        server.url, vocab_size=VOCAB, max_model_len=MAX_LEN, request_timeout_s=DEADLINE_S,
        control_timeout_s=60.0, connect_timeout_s=60.0,
    )  # fmt: skip
    try:
        yield eng
    finally:
        await asyncio.wait_for(eng.close(), 60.0)


@pytest.fixture(params=["inproc", "serve"])
def engine(request: pytest.FixtureRequest) -> Engine:
    """The session's in-process engine (tests/vllm/conftest.py) or one on this module's server
    (a sync fixture: an async one cannot start the session's engine from its running loop)."""
    name = "qwen3_engine" if request.param == "inproc" else "qwen3_server_engine"
    engine: Engine = request.getfixturevalue(name)
    return engine


async def test_chat_episodes_train_exactly_the_sampled_ids(
    engine: Engine, qwen3_model: Path, chat: tuple[ChatFormat, RenderersParser], tmp_path: Path
) -> None:
    import transformers

    fmt, parser = chat
    added: dict[int, list[list[int]]] = {}

    async def agent(episode: Episode) -> None:
        conv = ChatEpisode(episode, fmt, parser, messages=FIRST, sampling=SAMPLING)
        for t in range(3):
            reply = await conv.reply()
            if reply.truncated:
                break
            assert reply.ids[-1] == fmt.stop_token_ids[0]
            bridge = conv.add([{"role": "user", "content": f"turn {t}: go on"}])
            added.setdefault(episode.index, []).append(bridge)
        episode.extra["messages"] = len(conv.messages)

    async def reward(group: RolloutGroup) -> list[float]:
        return [0.0] * len(group.samples)

    prompt = fmt.prompt_ids(FIRST)
    producer = Producer(
        engine, [prompt], reward, rollout_fn=agent, group_size=2, batch_size=1,
        sampling=SAMPLING, max_turns=3, max_episode_tokens=1024, record=tmp_path,
    )  # fmt: skip
    async with asyncio.timeout(DEADLINE_S), producer:
        batch = await producer.produce_batch(1, timeout=DEADLINE_S)
    (group,) = batch.groups
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen3_model, dtype=torch.float32)
    turns_seen = 0
    for i, sample in enumerate(group.samples):
        assert sample.loss_mask is not None and sample.turn_ends is not None
        mask = sample.loss_mask.astype(bool)
        tokens = sample.tokens
        # Environment tokens are exactly the bridges ChatEpisode appended; all else sampled.
        env = tokens[~mask].tolist()
        assert env == [t for b in added.get(i, []) for t in b]
        bridge_text = fmt.tokenizer.decode(added[i][0]) if added.get(i) else ""
        if bridge_text:
            assert (
                bridge_text
                == "\n<|im_start|>user\nturn 0: go on<|im_end|>\n<|im_start|>assistant\n"
            )
        turns_seen += sample.num_turns
        ids = torch.tensor(np.concatenate([prompt, tokens])[None].astype(np.int64))
        with torch.no_grad():
            ours = token_logprobs(model(input_ids=ids).logits, ids)[0, len(prompt) :]
        gap = (ours[torch.from_numpy(mask)] - torch.from_numpy(sample.logprobs[mask])).abs()
        assert gap.max() < 1e-3, gap.max()
        print(f"sample {i}: {sample.num_turns} turns, {int(mask.sum())} trained tokens, "
              f"max logprob gap {float(gap.max()):.2e}")  # fmt: skip
        assert (sample.logprobs[~mask] == 0).all()
    assert turns_seen >= 4  # some episode got past its first turn: the bridge ran
    # The run record holds the episodes token by token: bridges unmasked, turns as sampled.
    _, lines_, _, _ = record_lines(tmp_path)
    (line,) = [g for g in lines_ if g.step == 1]
    assert line.uid == group.uid and line.prompt_tokens == [int(t) for t in prompt]
    for sample_line, sample in zip(line.samples, group.samples, strict=True):
        check_sample(sample_line, sample)
