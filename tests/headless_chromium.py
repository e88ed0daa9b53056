"""Open a local page in headless Chromium and report what a person would see: the console errors
it logged, a screenshot, its width. Shared by the tests that look at pages in a real browser.

Speaks the DevTools protocol over ``--remote-debugging-pipe`` (JSON messages, NUL-terminated, on
the browser's fds 3 and 4): no port, no network, no client library.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

NAMES = ("chromium", "chromium-browser", "google-chrome")
FLAGS = (
    "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--no-default-browser-check",
    "--hide-scrollbars", "--remote-debugging-pipe",
)  # fmt: skip


def find_chromium() -> str | None:
    return next(filter(None, map(shutil.which, NAMES)), None)


@dataclass(frozen=True)
class PageView:
    errors: list[str]  # console errors, uncaught exceptions, failed loads
    screenshot: bytes  # PNG of the viewport
    scroll_width: int  # the document's width: more than the viewport's means a horizontal scroll


class _Browser:
    """A headless Chromium on a DevTools pipe. Mutates itself (pending events) as it reads."""

    def __init__(self, chromium: str, profile: str):
        to_browser, self._to_browser = os.pipe()
        self._from_browser, from_browser = os.pipe()
        # above the fds the two dup2s write, so neither clobbers the other's source
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_browser, from_browser)]
        actions = [
            (os.POSIX_SPAWN_DUP2, high[0], 3),
            (os.POSIX_SPAWN_DUP2, high[1], 4),
            (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
            (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
        ]
        argv = [chromium, *FLAGS, f"--user-data-dir={profile}", "about:blank"]
        # its own process group: closing ends its helper processes too
        self.pid = os.posix_spawn(chromium, argv, os.environ, file_actions=actions, setpgroup=0)
        for fd in (to_browser, from_browser, *high):
            os.close(fd)
        self._buffer, self._next_id, self.events = b"", 0, []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> None:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send one command and wait for its result (RuntimeError on a protocol error)."""
        self.send(method, params, session)
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(event.get("method") == method for event in self.events):
            self.events.append(self._read(deadline - time.monotonic()))

    def _read(self, timeout: float = 60.0) -> dict:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_browser], [], [], max(timeout, 0))
            chunk = os.read(self._from_browser, 1 << 20) if ready else b""
            if not chunk:
                raise TimeoutError("chromium sent nothing (closed, or past the timeout)")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the browser to close, give it ``timeout`` seconds, then end its process group."""
        with suppress(OSError):
            self.send("Browser.close")
        deadline = time.monotonic() + timeout
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        with suppress(ProcessLookupError):  # helpers (crashpad) can outlive the browser
            os.killpg(self.pid, signal.SIGKILL)
        with suppress(ChildProcessError):  # reaped above when it closed in time
            os.waitpid(self.pid, 0)
        os.close(self._to_browser)
        os.close(self._from_browser)


def view_page(chromium: str, page: Path, *, width: int = 1280, height: int = 2000) -> PageView:
    """Load ``page`` in a ``width`` x ``height`` viewport and wait for its load event."""
    # a helper may still be writing the profile when it is killed
    with tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True) as profile:
        browser = _Browser(chromium, profile)
        try:
            target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            attached = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})
            session = attached["sessionId"]
            for domain in ("Runtime", "Log", "Page"):
                browser.call(f"{domain}.enable", session=session)
            metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
            browser.call("Emulation.setDeviceMetricsOverride", metrics, session)
            browser.call("Page.navigate", {"url": page.resolve().as_uri()}, session)
            browser.wait_for("Page.loadEventFired", timeout=60)
            evaluated = browser.call(
                "Runtime.evaluate",
                {"expression": "document.documentElement.scrollWidth", "returnByValue": True},
                session,
            )
            shot = browser.call("Page.captureScreenshot", {"format": "png"}, session)
            return PageView(
                errors=_errors(browser.events),
                screenshot=base64.b64decode(shot["data"]),
                scroll_width=evaluated["result"]["value"],
            )
        finally:
            browser.close()


def _errors(events: list[dict]) -> list[str]:
    """What the page reported as errors: console.error calls, uncaught exceptions, and log
    entries of level error (a resource that failed to load, a blocked request)."""
    errors = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            errors.append(" ".join(str(arg.get("value")) for arg in params["args"]))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            errors.append(details.get("exception", {}).get("description") or details["text"])
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            errors.append(params["entry"]["text"])
    return errors
