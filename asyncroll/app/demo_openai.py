"""The demo's OpenAI-client task, "openai_echo": tool_echo (`asyncroll.app.demo_tool`) with its
agent written as plain `openai`-client code against the episode's endpoint (`asyncroll.agents`).

The prompts are tool_echo's ("q:", a letter and a colon) and so are the turns, the tool's
answers and the budget. The agent calls `client.chat.completions.create` on the episode's
`base_url` with the task's one tool, `say`; the tiny model's reply is a call of `say` with the
reply's text once it ends its turn (`<|eos|>`); the agent runs the tool, which scores what was
said against the letter just given and answers with the next letter, sends that back as the
tool's message and asks again, for tool_echo's `TURNS` turns. The agent returns the episode's
reward (the mean of its turns' scores) and leaves each turn's score in `episode.extra`, which
the demo's trainer gives each turn its own GRPO advantage from, as it does for tool_echo.

What differs from the token-level task, and why:

* A chat turn must end with its end-of-turn token for the conversation to go on: the endpoint
  refuses to continue a reply cut by the token limit (there is no end of turn to continue
  from). So the policy learns to end its turns too: a turn that did not (no tool call)
  scores 0 and ends its episode (its later turns score 0 too); see `turn_score`.
* The agent sees text, not token ids: a turn scores the letter's occurrences in what was
  said (up to 3, the room a 4-token turn has before its `<|eos|>`) and 0.2 for ending with
  something said.
* The task's chat template renders exactly tool_echo's stream: a user or tool message as its
  text and a colon, an assistant turn as what was sampled and `<|eos|>`. It writes no tool
  specs into the prompt (a 361k-parameter random-weight model gains nothing from reading
  JSON); the tool-call syntax is the reply itself (`SayParser`).

The trainer, its loss, the defaults (`demo_tool.DEFAULTS`) and the demo's loop are tool_echo's:
a change to how tool_echo trains is a change to this task too. The runs so far learn to end
their turns, then the letters slowly: not solved yet (benchmarks/results/openai_echo.md).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from asyncroll.agents import AgentEndpoint, agent_reward
from asyncroll.app import demo_tool
from asyncroll.chat.parse import Reply, ToolCall
from asyncroll.chat.template import ChatFormat
from asyncroll.engines.base import SamplingConfig
from asyncroll.episode import Episode
from asyncroll.types import Prompt, RolloutGroup

TURNS = demo_tool.TURNS
CALL_TIMEOUT_S = 600.0
"""Every phase of a call, connecting included (the client's default gives a connection 5 s:
on a loaded machine the endpoint, on the trainer's event loop, accepted later, and the
group failed with `APITimeoutError`); the group's episode deadline bounds it anyway."""
ENDED = 0.2
"""Of a turn's score, what ending it (a `say` call) with something said earns, whatever was
said; the rest is the text's share of the letter. See `turn_score`."""
DEFAULTS: Final = demo_tool.DEFAULTS
"""tool_echo's defaults, whatever they are: the same training path."""

TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ message['content'] }}{{ eos_token }}"
    "{%- else -%}{{ message['content'] }}:{%- endif -%}"
    "{%- endfor -%}"
)
"""The task's chat template: [user "q"] renders to tool_echo's prompt "<|bos|>q:", a reply
and a tool message "c" to the sampled ids, `<|eos|>` and "c:" (tool_echo's answer)."""

TOOLS: Final = [
    {
        "type": "function",
        "function": {
            "name": "say",
            "description": "Say the letter you were given; the answer is the next letter.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
            },
        },
    }
]


class SayParser:
    """The tiny format's tool calls: a reply that ends its turn (`<|eos|>`) is a call of
    `say` with the reply's text; one cut by the token limit is text, and no call."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.end = int(tokenizer.eos_token_id)

    def parse(self, ids: Sequence[int], *, prompt_ids: Sequence[int]) -> Reply:
        ids = tuple(int(i) for i in ids)
        ended = bool(ids) and ids[-1] == self.end
        text = str(self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False))
        if not ended:
            return Reply(text, None, (), ids, "length")
        call = ToolCall(name="say", arguments={"text": text}, raw=text)
        return Reply("", None, (call,), ids, "stop")


def score(text: str, letter: str) -> float:
    """The share of `text`'s characters that are `letter` (0 for no text)."""
    return text.count(letter) / len(text) if text else 0.0


def turn_score(text: str, letter: str, *, ended: bool, slots: int = 3) -> float:
    """A turn's score: 0 unless it ended (a `say` call); then `ENDED` for saying something and
    the rest for how many of the turn's `slots` (the letters a 4-token turn has room for
    before its `<|eos|>`) hold the letter: "ccc<|eos|>" 1, "c<|eos|>" 0.47, "x<|eos|>" 0.2,
    "<|eos|>" 0, "cccc" cut by the token limit 0.

    Designs measured first (benchmarks/results/openai_echo.md): a cut turn scoring half its
    text's share of the letter, with nothing for ending, let the policy grow certain of
    four-letter turns before any sample ended one (0.06 at step 100, no episode past its first
    turn); 0.2 for ending and the share of what was said made replies short ("x<|eos|>"),
    with one letter to explore per turn (0.35-0.41 at steps 74-97, entropy ~0); counting
    slots but scoring a cut turn's letters made "cccc" (0.8) beat ending ("cc<|eos|>" 0.73):
    0.65-0.79 on the first turn, no episode past it."""
    if not ended:
        return 0.0
    hits = min(text.count(letter), slots) / slots
    return (1 - ENDED) * hits + ENDED * bool(text)


async def openai_echo_agent(client: Any, episode: Episode, model: str) -> float:
    """The agent: plain OpenAI-client code. `client` is an `openai.AsyncOpenAI` on the
    episode's URL. Each turn's score goes to `episode.extra["turn_scores"]`, each call's wall
    time to `episode.extra["call_s"]`; the result is the episode's reward."""
    letters = episode.metadata["letters"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": letters[0]}]
    scores = [0.0] * TURNS
    calls: list[float] = []
    for turn in range(TURNS):
        start = time.perf_counter()
        response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        calls.append(time.perf_counter() - start)
        message = response.choices[0].message
        if not message.tool_calls:  # cut by the token limit: the conversation cannot go on
            scores[turn] = turn_score(message.content or "", letters[turn], ended=False)
            break
        messages.append(message.model_dump(exclude_none=True))
        (call,) = message.tool_calls
        said = call.function.arguments  # the tool: score what was said, answer the next letter
        scores[turn] = turn_score(_text(said), letters[turn], ended=True)
        if turn + 1 < TURNS:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": letters[turn + 1]})
    episode.extra["turn_scores"] = scores
    episode.extra["call_s"] = calls
    return float(np.mean(scores))


def _text(arguments: str) -> str:
    import json

    value = json.loads(arguments)
    return str(value.get("text", "")) if isinstance(value, dict) else ""


def turn_scores(group: RolloutGroup) -> npt.NDArray[np.float64]:
    """[samples, TURNS]: each turn's score as the agent gave it (0 for a turn not reached)."""
    return np.array([s.extra["turn_scores"] for s in group.samples], dtype=np.float64)


def turn_rewards(group: RolloutGroup) -> npt.NDArray[np.float64]:
    """[samples, TURNS]: the trainer's per-turn rewards, each turn's score less `ENDED`. The
    same shift for every sample leaves GRPO's advantages as they are, and a turn's reward is
    then <= 0 exactly when it said no letter, what the trainer's "failed problem" (every
    sample <= 0: `asyncroll.train.failed_tokens`) means in tool_echo; unshifted, a group that
    ends its turns with a wrong letter (0.2 each) would never count as failed."""
    return turn_scores(group) - ENDED


def step_metrics(groups: list[RolloutGroup]) -> dict[str, float]:
    """Per batch: each turn's mean score and the share of episodes that reached it (every
    earlier turn ended with a tool call), and the mean proxy call time in ms."""
    scores = np.stack([turn_scores(g) for g in groups])  # [groups, samples, turns]
    samples = [s for g in groups for s in g.samples]
    reached = np.zeros(TURNS)
    for s in samples:
        reached[: len(s.extra["call_s"])] += 1
    out = {f"turn{k}": float(scores[:, :, k].mean()) for k in range(TURNS)}
    out |= {f"reached{k}": float(reached[k] / len(samples)) for k in range(TURNS)}
    calls = [t for s in samples for t in s.extra["call_s"]]
    out["call_ms"] = 1e3 * float(np.mean(calls))
    return out


class OpenAIEchoTask:
    """What the demo needs of openai_echo: tool_echo's prompts, the endpoint the agents call
    (`serving()`, entered around the producer's run), the producer's episode settings and
    reward, and the per-turn rewards."""

    def __init__(
        self, model_dir: Path, raw_tokenizer: Any, seed: int, sampling: SamplingConfig
    ) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        tokenizer.chat_template = TEMPLATE
        self.fmt = ChatFormat(tokenizer, tools=TOOLS)
        parser = SayParser(tokenizer)
        self.endpoint = AgentEndpoint(self.fmt, lambda tools: parser, sampling=sampling)
        bos = raw_tokenizer.token_to_id("<|bos|>")
        for letter in demo_tool.LETTERS:  # the first call's message renders to the prompt
            ids = self.fmt.prompt_ids([{"role": "user", "content": letter}])
            if ids != [bos, *raw_tokenizer.encode(f"{letter}:").ids]:
                raise ValueError(f"the template renders {letter!r} to {ids}, not tool_echo's")
        self.raw_tokenizer = raw_tokenizer
        self.seed = seed
        self.max_new_tokens = sampling.max_new_tokens
        self._client: Any = None  # an openai.AsyncOpenAI while serving
        self.reward = agent_reward
        self.turn_rewards = turn_rewards

    def prompts(self) -> Iterator[Prompt]:
        """tool_echo's prompts (the first call's message renders to each one's tokens)."""
        return demo_tool.tool_echo_prompts(self.raw_tokenizer, self.seed)

    def episodes(self) -> dict[str, Any]:
        """The producer's episode arguments: the agent behind the endpoint, tool_echo's
        turns and budget."""
        return {
            "rollout_fn": self.endpoint.rollout(self._agent),
            "max_turns": TURNS,
            "max_episode_tokens": demo_tool.episode_tokens(self.max_new_tokens),
        }

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[OpenAIEchoTask]:
        """The endpoint's server and one HTTP client the agents share (an `AsyncOpenAI` with
        its own HTTP client costs ~20 ms to make; with a shared one, ~40 µs)."""
        try:
            import openai
        except ImportError as exc:
            raise RuntimeError(
                "--task openai_echo runs an OpenAI-client agent: pip install openai "
                "(or asyncroll[agents])"
            ) from exc
        async with openai.DefaultAsyncHttpxClient() as http, self.endpoint:
            self._client = openai.AsyncOpenAI(
                base_url="http://unused/v1",
                api_key="unused",
                http_client=http,
                max_retries=0,
                timeout=CALL_TIMEOUT_S,
            )
            try:
                yield self
            finally:
                self._client = None

    async def _agent(self, base_url: str, episode: Episode) -> float:
        if self._client is None:
            raise RuntimeError("the openai_echo task is not serving: enter task.serving()")
        client = self._client.with_options(base_url=base_url)
        return await openai_echo_agent(client, episode, self.endpoint.model)
