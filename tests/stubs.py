"""Stub HTTP replicas for the server-engine tests: aiohttp apps served on loopback ports."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from aiohttp import web

from asyncroll.engines.vllm_serve import free_port


@contextlib.asynccontextmanager
async def served(apps: Sequence[web.Application]) -> AsyncIterator[list[str]]:
    """Serve each app on a free loopback port; the base URLs, in order. Each runner is cleaned
    up on exit, with a short shutdown timeout: a stub handler left waiting must not hold the
    test for aiohttp's default minute."""
    runners: list[web.AppRunner] = []
    try:
        urls = []
        for app in apps:
            runner = web.AppRunner(app, shutdown_timeout=1.0)
            runners.append(runner)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()
