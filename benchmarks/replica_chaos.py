"""Replica chaos run: a `Producer` on a `VLLMServerEngine` whose HTTP replicas misbehave.

Why: the scale-out path meets, in a long run, replicas that answer garbage, wedge while their
`/health` still answers, flap, slow down, get SIGKILLed and come back with other weights, and
weight updates cut off half-way. The producer's guarantees must hold through all of it, and one
bad replica must not stop a run while another one serves (issue #24, item 6).

The replicas are FAKES (`_fake_replica.py`, a simulation: small aiohttp processes answering
vLLM's routes with vLLM's shapes), because real `vllm serve` processes cost 2.6 GiB and ~40 s a
start here. Each token a fake samples encodes the weights it holds at that moment, so every
token handed to the trainer is checked against the weights that sampled it. Only the public
APIs of `Producer` and `VLLMServerEngine` are used.

Scenarios (each on fresh replicas, a fresh engine and producer; one replica misbehaves in
episodes, the others serve; the chaos task updates the weights every `update_every_s`, also
while a replica is bad):

- `slow`: per-token latency x25 during an episode.
- `sigkill`: SIGKILL, restarted at once on the same port (vLLM's label "default", weights 0).
- `flap`: SIGSTOP (answers nothing, connections hang), SIGCONT after the episode.
- `stalled_probe`: SIGKILL, restarted at once, but the first re-sync call it gets (the cache
  reset) hangs while `/health` answers: the engine's re-sync of it waits, the updates too.
- `wedged`: generate never progresses while `/health` and the control routes answer.
- `garbage`: the port answers bytes that are not HTTP (a wrong service behind it, a broken
  proxy); afterwards it answers HTTP again.
- `cut_pause`, `cut_load`, `cut_reset`, `cut_label`, `cut_resume`: an update whose call to one
  replica stalls at that step (`/pause`, `/collective_rpc`, `/reset_prefix_cache`,
  `/update_weight_version`, `/resume`) is cancelled there by the caller; the replica then
  completes the step late, as a real one does.
- `all`: episodes of every kind above, drawn at random, on a random replica.

Checks per scenario (`CHECKS`): every prompt ends exactly once (the soak's journal of
endings: handed out, or dropped as failed or filtered; lost and duplicated counted after the
run drains), every token's label names the weights that sampled it, the run is never stopped
and always drains, every update not deliberately cut succeeds while a replica serves, and a
wedged or garbage replica gets no new group once the engine had time to see it fail.

Prints Markdown tables and writes `replica_chaos.{png,json,md}`. Exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
from _chaos import ChaosPrompts
from _common import DEFAULT_OUT, info_line, new_figure, print_section, run_info
from _common import save_outputs as save_report
from _fake_replica import TOKEN_STRIDE, WEIGHTS_TENSOR
from safetensors.numpy import save_file

from asyncroll import (
    DropRecord,
    Producer,
    ProducerError,
    ProducerExhausted,
    PutOutcome,
    RolloutGroup,
    SamplingConfig,
    StalledError,
)
from asyncroll.engines import VLLMServerEngine
from asyncroll.producer import LedgerError, UpdateWeightsError

VOCAB = 1 << 16
FAKE = Path(__file__).resolve().parent / "_fake_replica.py"
MODES = ("slow", "sigkill", "flap", "stalled_probe", "wedged", "garbage")
CUTS = {
    "cut_pause": "/pause",
    "cut_load": "/collective_rpc",
    "cut_reset": "/reset_prefix_cache",
    "cut_label": "/update_weight_version",
    "cut_resume": "/resume",
}
SCENARIOS = (*MODES, *CUTS, "all")
EPISODE_SHARE = {
    "slow": 1.0, "sigkill": 0.2, "flap": 0.3, "stalled_probe": 0.4, "wedged": 1.0, "garbage": 1.0,
}  # fmt: skip
"""Of `episode_s`: a wedged or garbage episode outlasts `detect_bound_s` (removal is checked
after it), a SIGKILL is over at once (the updates right after it are the hostile part)."""
NEVER_ROUTED = ("wedged", "garbage")
"""Modes in which a replica must leave the rotation: it takes requests and never serves them."""

CHECKS = {
    "ledger": "the producer's ledger identity after every batch",
    "exactly_once": "every prompt ends exactly once (lost 0, duplicated 0)",
    "labels": "every token's version label names the weights that sampled it",
    "not_stopped": "the producer never stops, and the run drains",
    "updates": "every update not deliberately cut succeeds while a replica serves",
    "removed": "a wedged or garbage replica gets no new group once seen failing",
    "harness": "the scenario ran (its fake replicas started in time)",
}


class ChaosConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One scenario's shape; the deadlines are short so that a fault costs seconds."""

    chaos_s: float
    drain_s: float
    episode_s: float  # how long a replica stays bad
    seed: int = 0
    replicas: int = 3
    group_size: int = 4
    batch_size: int = 4
    max_new_tokens: int = 16
    max_inflight: int = 12
    token_latency_s: float = 0.002
    slow_latency_s: float = 0.05
    gap_s: float = 0.5  # calm between episodes
    update_every_s: float = 0.4
    generate_timeout_s: float = 1.5
    control_timeout_s: float = 2.0
    health_timeout_s: float = 0.5
    health_interval_s: float = 0.3
    abort_timeout_s: float = 1.0
    update_timeout_s: float = 5.0
    pause_timeout_s: float = 0.3  # the engine's pause bound (2x) stays under abort_timeout_s
    liveness_timeout_s: float = 1.0  # a one-token generate on a fake takes milliseconds
    pause_mode: str = "keep"
    op_bound_s: float = 15.0  # any single call into the producer, the fleet or a fake

    @property
    def detect_bound_s(self) -> float:
        """How long an engine may take to see a replica fail: a request's deadline, the abort
        that follows, a health probe, and a second of slack for a loaded machine."""
        return self.generate_timeout_s + self.control_timeout_s + self.health_interval_s + 1.0


START_BOUND_S = 60.0


class HarnessError(RuntimeError):
    """The harness could not run a scenario (a fake replica did not start): no verdict."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Fleet:
    """The fake replicas' processes, one per port; killed, stopped and restarted here."""

    def __init__(self, cfg: ChaosConfig, workdir: Path, http: aiohttp.ClientSession) -> None:
        self.cfg = cfg
        self.http = http
        self.ports = [free_port() for _ in range(cfg.replicas)]
        self.logs = [workdir / f"arrivals-{p}.log" for p in self.ports]
        self.model = workdir / "model"  # what every replica starts from: weights id 0
        self.model.mkdir()
        save_file({WEIGHTS_TENSOR: np.zeros(1, np.int64)}, str(self.model / "model.safetensors"))
        self.procs: list[asyncio.subprocess.Process | None] = [None] * cfg.replicas
        self.starts = 0

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    async def start(self, i: int, *, stall: str | None = None) -> None:
        """A fresh process on replica `i`'s port (its previous one must be gone); `stall`: a
        route whose first call it holds until released."""
        args = [sys.executable, str(FAKE), "--port", str(self.ports[i]), "--model", str(self.model)]
        args += ["--seed", f"{self.cfg.seed * 100 + self.starts}", "--arrivals", str(self.logs[i])]
        args += ["--token-latency-s", str(self.cfg.token_latency_s)]
        args += ["--slow-latency-s", str(self.cfg.slow_latency_s)]
        self.starts += 1
        self.procs[i] = await asyncio.create_subprocess_exec(
            *args, *(["--stall", stall] if stall else []), stdin=asyncio.subprocess.DEVNULL
        )
        await self.wait_listening(i)

    async def wait_listening(self, i: int) -> None:
        """Until the port accepts connections: a new process needs ~0.3 s to import aiohttp,
        and was seen to need over 15 s on the shared machine under load."""
        deadline = time.monotonic() + START_BOUND_S
        proc = self.procs[i]
        while time.monotonic() < deadline and proc is not None and proc.returncode is None:
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", self.ports[i])
                writer.close()
                return
            await asyncio.sleep(0.05)
        code = None if proc is None else proc.returncode
        raise HarnessError(
            f"fake replica {i} did not listen within {START_BOUND_S} s (exit {code})"
        )

    def signal(self, i: int, sig: signal.Signals) -> None:
        proc = self.procs[i]
        if proc is not None and proc.returncode is None:
            proc.send_signal(sig)

    async def kill(self, i: int) -> None:
        """SIGKILL replica `i`'s process and reap it."""
        proc = self.procs[i]
        if proc is not None:
            self.signal(i, signal.SIGKILL)
            async with asyncio.timeout(self.cfg.op_bound_s):
                await proc.wait()
            self.procs[i] = None

    def exited(self) -> list[int]:
        """Replicas whose process exited by itself (a fake exits after a failed reload)."""
        return [i for i, p in enumerate(self.procs) if p is not None and p.returncode is not None]

    async def admin(self, i: int, path: str, body: Any = None, method: str = "POST") -> Any:
        async with (
            asyncio.timeout(self.cfg.op_bound_s),
            self.http.request(method, f"{self.url(i)}{path}", json=body) as reply,
        ):
            reply.raise_for_status()
            return await reply.json()

    async def close(self) -> None:
        for i in range(len(self.procs)):
            await self.kill(i)

    def arrivals(self, i: int) -> list[tuple[float, str, int]]:
        """(monotonic time, mode, max_tokens) of every generate request replica `i` received."""
        if not self.logs[i].exists():
            return []
        rows = [line.split() for line in self.logs[i].read_text().splitlines()]
        return [(float(t), mode, int(m)) for t, mode, m in rows]


class Scenario:
    """One scenario's run and its record."""

    def __init__(
        self, cfg: ChaosConfig, name: str, workdir: Path, http: aiohttp.ClientSession
    ) -> None:
        self.cfg = cfg
        self.name = name
        self.workdir = workdir
        self.fleet = Fleet(cfg, workdir, http)
        self.rng = random.Random(f"{cfg.seed}/{name}")
        self.prompts = ChaosPrompts(cfg.seed, VOCAB, {"plain": 1.0})
        self.t0 = time.monotonic()
        self.journal: list[str] = []  # prompt ids, one per ending
        self.labels: Counter[tuple[int, int]] = Counter()  # (label, weights id) -> tokens
        self.weights_of = {0: 0}  # version -> the weights id its successful update loaded
        self.next_weights = 1
        self.updates: Counter[str] = Counter()
        self.update_s: list[float] = []  # how long each update took (to its end or its cut)
        self.episodes: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.progress: list[tuple[float, int, int]] = []  # (t, handed out, failed)
        self.handed_out = 0
        self.failed_groups = 0
        self.stopped: str | None = None
        self.drained = False
        self.flowing = asyncio.Event()  # set by the first batch
        self.chaos_t0 = 0.0  # when the chaos began (groups flowing), in `now()` time

    def now(self) -> float:
        return time.monotonic() - self.t0

    def fail(self, check: str, detail: str) -> None:
        self.failures.append({"t_s": self.now(), "check": check, "detail": detail[:400]})

    def event(self, kind: str, note: str = "") -> None:
        self.events.append({"t_s": self.now(), "kind": kind, "note": note[:200]})

    # -- the producer's side ---------------------------------------------------------------------

    def on_drop(self, record: DropRecord) -> None:
        """FAILED and FILTERED are endings; EXPIRED prompts come back."""
        if record.outcome is PutOutcome.DROPPED_EXPIRED:
            return
        self.journal.append(record.prompt_id)
        self.failed_groups += record.outcome is PutOutcome.DROPPED_FAILED

    @staticmethod
    def reward(group: RolloutGroup) -> list[float]:
        return [float(len(s.tokens) % 3) for s in group.samples]

    def producer(self, engine: VLLMServerEngine) -> Producer:
        cfg = self.cfg
        return Producer(
            engine,
            self.prompts,
            self.reward,
            on_drop=self.on_drop,
            group_size=cfg.group_size,
            batch_size=cfg.batch_size,
            sampling=SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=1.0),
            max_inflight_groups=cfg.max_inflight,
            pause_mode=cfg.pause_mode,
            generate_timeout_s=cfg.generate_timeout_s,
            abort_timeout_s=cfg.abort_timeout_s,
            update_timeout_s=cfg.update_timeout_s,
            prompt_timeout_s=cfg.op_bound_s,
        )

    async def train(self, producer: Producer) -> None:
        """Take batches until the prompts are used up; decode every token handed out."""
        while True:
            try:
                batch = await producer.produce_batch(timeout=1.0)
            except TimeoutError:
                continue
            except StalledError as exc:
                self.event("stalled", str(exc))
                await asyncio.sleep(0.05)
                continue
            except ProducerExhausted:
                self.drained = True
                return
            except ProducerError as exc:
                self.stopped = str(exc)
                return
            for group in batch.groups:
                self.journal.append(group.prompt_id)
                for s in group.samples:
                    pairs = zip(
                        s.versions.tolist(), (s.tokens // TOKEN_STRIDE).tolist(), strict=True
                    )
                    self.labels.update(pairs)
            self.handed_out += len(batch.groups)
            self.flowing.set()
            self.progress.append((self.now(), self.handed_out, self.failed_groups))
            try:
                producer.check_ledger()
            except LedgerError as exc:
                self.fail("ledger", str(exc))

    async def update(self, producer: Producer, cut: tuple[int, str] | None = None) -> None:
        """One weight update with new weights; with `cut` (replica, route), the call to that
        replica's route stalls and the caller cancels the update there."""
        w = self.next_weights
        self.next_weights += 1
        weights = [(WEIGHTS_TENSOR, np.array([w], np.int64))]
        if cut is not None:
            await self.fleet.admin(cut[0], "/_chaos/stall", {"route": cut[1]})
        start, before = time.monotonic(), producer.version
        task = asyncio.ensure_future(producer.update_weights(weights))
        entered = cut is not None and await self.stalled_there(cut, task)
        if entered:
            task.cancel()
        await asyncio.wait({task}, timeout=self.cfg.op_bound_s)
        self.update_s.append(time.monotonic() - start)
        if cut is not None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                await self.fleet.admin(cut[0], "/_chaos/release")  # the step completes late
        if not task.done():
            task.cancel()
            self.fail("not_stopped", f"update_weights did not return within {self.cfg.op_bound_s}")
            self.updates["hung"] += 1
        elif task.cancelled():
            self.updates["cut" if entered else "cancelled by itself"] += 1
            if producer.version != before:  # the engine had committed it: the producer adopted it
                self.weights_of[producer.version] = w
            if not entered:
                self.fail("updates", "update_weights raised CancelledError; nobody cancelled it")
        elif isinstance(exc := task.exception(), ProducerError):
            self.stopped = str(exc)
            self.updates["stopped the producer"] += 1
        elif isinstance(exc, UpdateWeightsError):
            self.updates["failed"] += 1
            self.fail("updates", str(exc))
        elif exc is not None:
            self.updates[f"raised {type(exc).__name__}"] += 1
            self.fail("updates", f"{type(exc).__name__}: {exc}")
        else:
            self.weights_of[task.result()] = w
            self.updates["ok" if cut is None else "cut missed"] += 1

    async def stalled_there(
        self, cut: tuple[int, str], task: asyncio.Future[Any] | None = None
    ) -> bool:
        """Whether a call reached the stalled route of replica `cut[0]` (`op_bound_s` at
        most); False as soon as `task` (the update) ends first: the replica was out of the
        rotation. A poll of the fake, every 20 ms: it runs in another process."""
        deadline = time.monotonic() + self.cfg.op_bound_s
        while (task is None or not task.done()) and time.monotonic() < deadline:
            reply = await self.fleet.admin(cut[0], f"/_chaos/stall?route={cut[1]}", method="GET")
            if reply["entered"]:
                return True
            await asyncio.sleep(0.02)
        return False

    # -- chaos -----------------------------------------------------------------------------------

    async def chaos(self, producer: Producer) -> None:
        """Episodes of the scenario's kind until `chaos_s` has passed."""
        while self.now() < self.chaos_t0 + self.cfg.chaos_s and self.stopped is None:
            kind = self.name
            if kind == "all":
                kind = self.rng.choice([*MODES, *CUTS])
            target = self.rng.randrange(self.cfg.replicas) if self.name == "all" else 0
            if kind in CUTS:
                await self.update(producer, cut=(target, CUTS[kind]))
                self.episodes.append({"kind": kind, "replica": target, "t0": self.now()})
            else:
                await self.episode(producer, kind, target)
            await self.revive_exited()
            await self.update(producer)
            await asyncio.sleep(self.cfg.gap_s)

    async def episode(self, producer: Producer, mode: str, i: int) -> None:
        """Replica `i` misbehaves as `mode` for `episode_s` while updates go on, then is put
        right."""
        start, mono = self.now(), time.monotonic()
        match mode:
            case "slow" | "wedged" | "garbage":
                await self.fleet.admin(i, "/_chaos/mode", {"mode": mode})
            case "flap":
                self.fleet.signal(i, signal.SIGSTOP)
            case "sigkill":
                await self.fleet.kill(i)
                await self.fleet.start(i)
            case "stalled_probe":
                await self.fleet.kill(i)
                await self.fleet.start(i, stall="/reset_prefix_cache")
                # the updates below are to meet the engine's re-sync of it while it hangs
                if not await self.stalled_there((i, "/reset_prefix_cache")):
                    self.event("probe_missed", f"replica {i} was not re-synced")
        length = EPISODE_SHARE[mode] * self.cfg.episode_s
        while self.now() - start < length and self.stopped is None:
            await self.update(producer)
            await asyncio.sleep(self.cfg.update_every_s)
        await self.put_right(mode, i)
        self.episodes.append(
            {"kind": mode, "replica": i, "t0": start, "t1": self.now(), "mono": mono}
        )

    async def put_right(self, mode: str, i: int) -> None:
        match mode:
            case "slow" | "wedged" | "garbage":
                await self.fleet.admin(i, "/_chaos/mode", {"mode": "normal"})
            case "flap":
                self.fleet.signal(i, signal.SIGCONT)
            case "stalled_probe":
                await self.fleet.admin(i, "/_chaos/release")

    async def revive_exited(self) -> None:
        """Restart a fake that exited by itself (after a failed reload, as vLLM does)."""
        for i in self.fleet.exited():
            self.event("replica_exited", f"replica {i} exited: restarted")
            self.fleet.procs[i] = None
            await self.fleet.start(i)

    # -- the run ---------------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            for i in range(self.cfg.replicas):
                await self.fleet.start(i)
        except HarnessError as exc:
            self.fail("harness", str(exc))
            await self.fleet.close()
            return
        await self.run_started()

    async def run_started(self) -> None:
        cfg = self.cfg
        weights_dir = self.workdir / "weights"
        weights_dir.mkdir()
        engine = VLLMServerEngine(
            [self.fleet.url(i) for i in range(cfg.replicas)],
            vocab_size=VOCAB,
            weights_dir=weights_dir,
            request_timeout_s=cfg.generate_timeout_s * 2,
            control_timeout_s=cfg.control_timeout_s,
            connect_timeout_s=cfg.health_timeout_s,
            health_timeout_s=cfg.health_timeout_s,
            health_interval_s=cfg.health_interval_s,
            pause_timeout_s=cfg.pause_timeout_s,
            liveness_timeout_s=cfg.liveness_timeout_s,
        )
        producer = self.producer(engine)
        try:
            async with asyncio.timeout(cfg.chaos_s + cfg.drain_s + 4 * cfg.op_bound_s):
                await self.drive(producer)
        except ProducerError as exc:
            self.stopped = self.stopped or str(exc)
        except TimeoutError:
            self.fail("not_stopped", "the scenario did not end within its bound")
        except HarnessError as exc:
            self.fail("harness", str(exc))
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(cfg.op_bound_s):
                    await engine.close()
            await self.fleet.close()

    async def drive(self, producer: Producer) -> None:
        async with producer:
            trainer = asyncio.create_task(self.train(producer))
            # Chaos starts once groups flow (every replica synced): a stall armed earlier
            # would hit the engine's first sync of a replica, not an update.
            flowing = asyncio.ensure_future(self.flowing.wait())
            await asyncio.wait(
                {trainer, flowing}, timeout=self.cfg.op_bound_s, return_when=asyncio.FIRST_COMPLETED
            )
            flowing.cancel()
            self.chaos_t0 = self.now()
            chaos = asyncio.create_task(self.chaos(producer))
            await asyncio.wait({trainer, chaos}, return_when=asyncio.FIRST_COMPLETED)
            if chaos.done():
                chaos.result()
                self.event("drain_start")
                self.prompts.close()
                await asyncio.wait({trainer}, timeout=self.cfg.drain_s)
            if not trainer.done():
                self.fail("not_stopped", f"not drained within drain_s={self.cfg.drain_s}")
            for task in (trainer, chaos):
                task.cancel()
            await asyncio.wait({trainer, chaos}, timeout=self.cfg.op_bound_s)
            for task in (trainer, chaos):
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]

    # -- the checks ------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        ends = Counter(self.journal)
        ids = {ChaosPrompts.prompt_id(i) for i in range(self.prompts.drawn)}
        lost = sorted(ids - set(ends))
        duplicated = sorted(p for p, k in ends.items() if k > 1)
        if self.drained and lost:
            self.fail("exactly_once", f"{len(lost)} prompts lost: {lost[:5]}")
        if duplicated:
            self.fail("exactly_once", f"{len(duplicated)} prompts duplicated: {duplicated[:5]}")
        wrong = {
            (label, w): n
            for (label, w), n in self.labels.items()
            if self.weights_of.get(label) != w
        }
        if wrong:
            shown = ", ".join(
                f"{n} labelled {label} sampled by weights {w} (version {self._version_of(w)})"
                for (label, w), n in sorted(wrong.items())[:4]
            )
            self.fail("labels", f"{sum(wrong.values())} tokens mislabelled: {shown}")
        if self.stopped is not None:
            self.fail("not_stopped", f"ProducerError: {self.stopped}")
        elif not self.drained and not any(f["check"] == "not_stopped" for f in self.failures):
            self.fail("not_stopped", "the run did not drain")
        late = self.late_requests()
        if late:
            self.fail(
                "removed",
                f"{late} groups sent to a wedged or garbage replica after it was seen failing",
            )
        return {
            "scenario": self.name,
            "duration_s": self.now(),
            "prompts": self.prompts.drawn,
            "handed_out": self.handed_out,
            "failed_groups": self.failed_groups,
            "lost": len(lost) if self.drained else None,
            "unended": len(lost),
            "duplicated": len(duplicated),
            "tokens_checked": sum(self.labels.values()),
            "mislabelled_tokens": sum(wrong.values()),
            "updates": dict(self.updates),
            "failed_updates": sum(
                n for k, n in self.updates.items() if k not in ("ok", "cut", "cut missed")
            ),
            "max_update_s": max(self.update_s, default=float("nan")),
            "episodes": len(self.episodes),
            "late_requests": late,
            "stopped": self.stopped,
            "drained": self.drained,
            "failures": len(self.failures),
        }

    def _version_of(self, w: int) -> str:
        versions = [v for v, x in self.weights_of.items() if x == w]
        return str(versions[0]) if versions else "never committed"

    def late_requests(self) -> int:
        """Producer requests (max_tokens > 1) a wedged or garbage replica received later than
        `detect_bound_s` into its episode."""
        late = 0
        for ep in self.episodes:
            if ep["kind"] not in NEVER_ROUTED:
                continue
            lo = ep["mono"] + self.cfg.detect_bound_s
            hi = ep["mono"] + ep["t1"] - ep["t0"]
            late += sum(
                1 for t, _, m in self.fleet.arrivals(ep["replica"]) if lo <= t <= hi and m > 1
            )
        return late


async def run_scenario(cfg: ChaosConfig, name: str, workdir: Path) -> Scenario:
    """Run one scenario (fresh replicas, engine and producer); its record."""
    async with aiohttp.ClientSession() as http:
        scenario = Scenario(cfg, name, workdir, http)
        await scenario.run()
    return scenario


# -- report --------------------------------------------------------------------------------------


def report(results: list[tuple[Scenario, dict[str, Any]]], cfg: ChaosConfig, out: Path) -> None:
    info = run_info()
    text = f"## Replica chaos run\n\n{info_line(info)}\n"
    text += (
        f"\n{cfg.replicas} FAKE replicas (`_fake_replica.py`, a simulation), one misbehaving; "
        f"chaos {cfg.chaos_s:g} s per scenario, episodes of {cfg.episode_s:g} s, "
        f"pause_mode={cfg.pause_mode}, generate_timeout_s={cfg.generate_timeout_s:g}, "
        f"control_timeout_s={cfg.control_timeout_s:g}, abort_timeout_s={cfg.abort_timeout_s:g}.\n"
    )
    rows: list[Sequence[Any]] = []
    for sc, s in results:
        bad = sorted({f["check"] for f in sc.failures})
        ups = s["updates"]
        rows.append(
            (
                s["scenario"],
                "ok" if not bad else "FAIL: " + ", ".join(bad),
                s["handed_out"],
                s["failed_groups"],
                "n/a" if s["lost"] is None else s["lost"],
                s["duplicated"],
                s["mislabelled_tokens"],
                s["tokens_checked"],
                f"{ups.get('ok', 0)}/{ups.get('cut', 0)}/{s['failed_updates']}",
                s["late_requests"],
                "yes" if s["stopped"] else "no",
            )
        )
    headers = [
        "scenario", "verdict", "groups out", "groups failed", "lost", "dup",
        "mislabelled tokens", "tokens checked", "updates ok/cut/failed", "late groups", "stopped",
    ]  # fmt: skip
    text += print_section("Scenarios", headers, rows)
    rows = []
    for sc, _ in results:
        by: dict[str, list[str]] = defaultdict(list)
        for f in sc.failures:
            by[f["check"]].append(f["detail"])
        rows += [(sc.name, check, len(v), v[0][:220]) for check, v in sorted(by.items())]
    text += print_section("Failed checks", ["scenario", "check", "count", "first"], rows)
    text += "\nChecks: " + "; ".join(f"`{k}`: {v}" for k, v in CHECKS.items()) + ".\n"
    payload = {
        "info": info,
        "config": msgspec.to_builtins(cfg),
        "scenarios": [
            {"summary": s, "failures": sc.failures, "events": sc.events, "episodes": sc.episodes}
            for sc, s in results
        ],
    }
    save_report(out, "replica_chaos", figure(results, info), payload, text)


def figure(results: list[tuple[Scenario, dict[str, Any]]], info: dict[str, Any]) -> Any:
    fig, (ax_groups, ax_bad) = new_figure(2, 1, width=11, height=3.4)
    names = [s["scenario"] for _, s in results]
    x = np.arange(len(names))
    ax_groups.bar(x - 0.2, [s["handed_out"] for _, s in results], 0.4, label="groups handed out")
    ax_groups.bar(x + 0.2, [s["failed_groups"] for _, s in results], 0.4, label="groups failed")
    series = {
        "prompts lost + duplicated": [(s["lost"] or 0) + s["duplicated"] for _, s in results],
        "mislabelled tokens": [s["mislabelled_tokens"] for _, s in results],
        "failed updates (not cut)": [s["failed_updates"] for _, s in results],
        "late groups": [s["late_requests"] for _, s in results],
    }
    for k, (label, values) in enumerate(series.items()):
        ax_bad.bar(x - 0.3 + 0.2 * k, [v + 0.0 for v in values], 0.2, label=label)
    for k, (_, s) in enumerate(results):
        if s["stopped"]:
            ax_bad.annotate("stopped", (k, 0.5), ha="center", color="tab:red", fontsize=8)
    ax_bad.set_yscale("symlog")
    ax_groups.set(ylabel="groups", title="Work done per scenario")
    ax_bad.set(ylabel="count (0 = holds)", title="Violations per scenario")
    for ax in (ax_groups, ax_bad):
        ax.set_xticks(x, names, fontsize=8)
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3, axis="y")
    failing = sum(1 for sc, _ in results if sc.failures)
    fig.suptitle(
        f"Replica chaos (FAKE replicas: a simulation): {failing} of {len(results)} scenarios "
        f"fail a check\n{info['date']} · {info['commit']}",
        fontsize=9,
    )
    return fig


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="~2 min (CI) instead of ~8")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for PNG/JSON/MD")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"--scenarios: unknown {unknown}; known: {', '.join(SCENARIOS)}")
    cfg = ChaosConfig(
        chaos_s=8.0 if args.quick else 30.0,
        drain_s=15.0 if args.quick else 30.0,
        episode_s=7.0 if args.quick else 9.0,
        seed=args.seed,
    )
    results = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"asyncroll-chaos-{name}-") as tmp:
            scenario = asyncio.run(run_scenario(cfg, name, Path(tmp)))
            results.append((scenario, scenario.summary()))  # reads the replicas' arrival logs
        print(f"{name}: {results[-1][1]}", file=sys.stderr, flush=True)
    report(results, cfg, args.out)
    return 1 if any(sc.failures for sc, _ in results) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
