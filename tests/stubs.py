"""Stub HTTP replicas for the server-engine tests: aiohttp apps served on loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from aiohttp import web

from asyncroll.engines.server.launch import free_port


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


@contextlib.asynccontextmanager
async def not_http() -> AsyncIterator[str]:
    """A loopback port that answers every connection with a line that is not HTTP (another
    service on a replica's port); its base URL."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            await reader.read(1024)
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()
