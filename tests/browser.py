"""Headless Chromium driven over the DevTools protocol (a websocket, with aiohttp): what the
report's browser test and benchmark use to open a page from disk, read its DOM, collect its
console errors and take a screenshot, with one browser start for all of it.

Every wait has a deadline (`DEADLINE_S`), and `close()` ends the browser's whole process group
(the launcher, the browser, its renderer and GPU processes), so no Chromium outlives its user.

As a command, it saves the screenshot the docs show (docs/report.md):

    python -m tests.browser [--example] RUN_DIR OUT.png [--group UID --sample I --mode mask]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

DEADLINE_S = 30.0
CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    """The Chromium to run: $ASYNCROLL_CHROMIUM, else the first of CANDIDATES on PATH."""
    return os.environ.get("ASYNCROLL_CHROMIUM") or next(
        (path for name in CANDIDATES if (path := shutil.which(name))), None
    )


class BrowserError(RuntimeError):
    """Chromium did not start, answer or load within its deadline."""


class Chromium:
    """One headless Chromium and one page of it. `errors` collects what the page's console
    reports as an error: console.error calls, uncaught exceptions, failed loads."""

    def __init__(self, process: asyncio.subprocess.Process, profile: str) -> None:
        self.process = process
        self.profile = profile
        self.errors: list[str] = []
        self.stderr: list[str] = []
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def start(cls, executable: str, *, width: int = 1400, height: int = 1000) -> Chromium:
        profile = tempfile.mkdtemp(prefix="asyncroll-chromium-")
        process = await asyncio.create_subprocess_exec(
            executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-extensions", "--disable-background-networking", "--hide-scrollbars",
            f"--user-data-dir={profile}", f"--window-size={width},{height}",
            "--remote-debugging-port=0", "--remote-allow-origins=*", "about:blank",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        browser = cls(process, profile)
        try:
            await asyncio.wait_for(browser._connect(), DEADLINE_S)
        except BaseException as exc:
            await browser.close()
            if isinstance(exc, TimeoutError):
                tail = "\n".join(browser.stderr[-20:])
                message = f"{executable} did not start in {DEADLINE_S} s:\n{tail}"
                raise BrowserError(message) from exc
            raise
        return browser

    async def _connect(self) -> None:
        assert self.process.stderr is not None
        port = None
        while port is None:
            raw = await self.process.stderr.readline()
            if not raw:
                raise BrowserError("chromium exited:\n" + "\n".join(self.stderr[-20:]))
            line = raw.decode(errors="replace").rstrip()
            self.stderr.append(line)
            if found := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                port = int(found.group(1))
        self._tasks.append(asyncio.create_task(self._drain()))
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as reply:
            targets = await reply.json()
        page = next(t for t in targets if t["type"] == "page")
        self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self._tasks.append(asyncio.create_task(self._read()))
        for domain in ("Page", "Runtime", "Log"):
            await self.send(f"{domain}.enable")

    async def _drain(self) -> None:
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            self.stderr.append(raw.decode(errors="replace").rstrip())

    async def _read(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            data = json.loads(message.data)
            if "id" in data:
                future = self._replies.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
                continue
            method, params = data.get("method"), data.get("params", {})
            self._note(method, params)
            waiter = self._events.pop(method, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(params)
        for future in self._replies.values():  # the browser went away: no reply will come
            if not future.done():
                future.set_exception(BrowserError("the DevTools connection closed"))

    def _note(self, method: str | None, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            args = params.get("args", [])
            self.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in args))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append(details.get("exception", {}).get("description") or details["text"])
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            self.errors.append(f"{entry['text']} ({entry.get('url', '')})")

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """One DevTools command's result, within the deadline."""
        assert self._ws is not None, "not connected"
        n = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies[n] = future
        await self._ws.send_str(json.dumps({"id": n, "method": method, "params": params or {}}))
        try:
            reply = await asyncio.wait_for(future, DEADLINE_S)
        except TimeoutError:
            raise BrowserError(f"no reply to {method} in {DEADLINE_S} s") from None
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply["result"]
        return result

    async def open(self, url: str) -> None:
        """Navigate to `url` and wait for its load event; clears `errors` first."""
        self.errors.clear()
        loop = asyncio.get_running_loop()
        loaded: asyncio.Future[dict[str, Any]] = loop.create_future()
        moved: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._events["Page.loadEventFired"] = loaded
        self._events["Page.navigatedWithinDocument"] = moved
        reply = await self.send("Page.navigate", {"url": url})
        if reply.get("errorText"):
            raise BrowserError(f"cannot open {url}: {reply['errorText']}")
        try:
            if "loaderId" not in reply:  # only the #fragment changed: load the page again
                await asyncio.wait_for(moved, DEADLINE_S)
                await self.send("Page.reload")
            await asyncio.wait_for(loaded, DEADLINE_S)
        except TimeoutError:
            raise BrowserError(f"{url} did not load in {DEADLINE_S} s") from None
        finally:
            self._events.pop("Page.navigatedWithinDocument", None)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        reply = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in reply:
            details = reply["exceptionDetails"]
            raise BrowserError(details.get("exception", {}).get("description") or details["text"])
        return reply["result"].get("value")

    async def screenshot(self, path: Path) -> Path:
        """The whole page, not only the window, as a PNG."""
        size = (await self.send("Page.getLayoutMetrics"))["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        reply = await self.send(
            "Page.captureScreenshot",
            {"format": "png", "captureBeyondViewport": True, "clip": clip},
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(reply["data"]))  # noqa: ASYNC240 (a test's few kB)
        return path

    async def close(self) -> None:
        """End the browser and every process it started, within the deadline."""
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), DEADLINE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()
        with contextlib.suppress(ProcessLookupError):  # a renderer the browser left behind
            os.killpg(self.process.pid, signal.SIGKILL)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        shutil.rmtree(self.profile, ignore_errors=True)


@contextlib.asynccontextmanager
async def chromium(executable: str | None = None) -> AsyncIterator[Chromium]:
    path = executable or find_chromium()
    if path is None:
        raise BrowserError("no chromium on PATH (Debian: apt-get install chromium)")
    browser = await Chromium.start(path)
    try:
        yield browser
    finally:
        await browser.close()


# The page's view of the sample it shows: what the test compares with the record.
SAMPLE_FACTS = """asyncrollReport.settled().then(() => {
  const toks = [...document.querySelectorAll('#tokens .tok')];
  const view = asyncrollReport.view();
  return {
    title: document.getElementById('sample-title').textContent,
    count: toks.length,
    mask: toks.map(t => Number(t.dataset.mask)),
    versions: toks.map(t => Number(t.dataset.version)),
    bridges: toks.filter(t => t.classList.contains('bridge')).length,
    turn_ends: [...document.querySelectorAll('#tokens .turn-end')].map(e => Number(e.dataset.turn)),
    logprobs: view.logprobs, trainer: view.trainer, tokens: view.tokens,
    page_errors: window.reportErrors,
  };
})"""


async def save_screenshot(run_dir: Path, out: Path, hash_: str) -> Path:
    """Build `run_dir`'s report and save a screenshot of it opened at `#hash_`."""
    from asyncroll.report import build_report

    index = build_report(run_dir)
    async with chromium() as browser:
        await browser.open(index.resolve().as_uri() + "#" + hash_)
        await browser.evaluate("asyncrollReport.settled()")
        if browser.errors:
            raise BrowserError(f"the page reported errors: {browser.errors}")
        return await browser.screenshot(out)


def main() -> None:
    parser = argparse.ArgumentParser(description="Screenshot of a run's report.")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--group", type=int, help="uid of the group to open")
    parser.add_argument("--sample", type=int, default=0)
    parser.add_argument("--mode", default="mask", choices=("mask", "version", "gap"))
    parser.add_argument(
        "--example", action="store_true", help="first write a synthetic record to RUN_DIR"
    )
    args = parser.parse_args()
    if args.example:
        from tests.report_records import make_run

        make_run(args.run_dir, steps=30, groups=4, samples=4, tokens=40)
    hash_ = f"mode={args.mode}"
    if args.group is not None:
        hash_ += f"&group={args.group}&sample={args.sample}"
    print(asyncio.run(save_screenshot(args.run_dir, args.out, hash_)))


if __name__ == "__main__":
    main()
