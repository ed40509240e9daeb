"""A real headless Chromium for tests, driven over the DevTools protocol on a pipe.

`--remote-debugging-pipe` makes Chromium read protocol messages (JSON, each ended by a NUL
byte) on its file descriptor 3 and write answers and events on 4: no websocket, no driver, no
extra package. The browser runs in its own session (process group) with a throw-away profile;
`close()` asks it to quit and kills that group, by the pid we started, if it does not.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_binary() -> str | None:
    """SKULKP2P_CHROMIUM, else the first Chromium on PATH (Debian's package is `chromium`)."""
    env = os.environ.get("SKULKP2P_CHROMIUM")
    if env:
        return env if os.access(env, os.X_OK) else None
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


class BrowserError(Exception):
    pass


class Browser:
    def __init__(self, binary: str, width: int = 1400, height: int = 1000,
                 timeout: float = 30.0):
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="skulkp2p-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-sync", "--mute-audio",
                "--hide-scrollbars", f"--user-data-dir={self.profile}",
                f"--window-size={width},{height}", "--remote-debugging-pipe", "about:blank"]
        # Our pipe ends become the child's descriptors 3 and 4 (posix_spawn: no shell, and no
        # preexec_fn in a process that may run threads); it leads a session of its own.
        # Sources above 9 first, so that no dup2 below overwrites another's source.
        null = os.open(os.devnull, os.O_RDWR)
        src = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (null, to_chrome_r,
                                                                      from_chrome_w)]
        for fd in (null, to_chrome_r, from_chrome_w):
            os.close(fd)
        try:
            self.pid = os.posix_spawn(binary, [binary, *args], dict(os.environ), file_actions=[
                (os.POSIX_SPAWN_DUP2, src[0], 0), (os.POSIX_SPAWN_DUP2, src[0], 1),
                (os.POSIX_SPAWN_DUP2, src[0], 2), (os.POSIX_SPAWN_DUP2, src[1], 3),
                (os.POSIX_SPAWN_DUP2, src[2], 4)], setsid=True)
        finally:
            for fd in src:
                os.close(fd)
        self.status: int | None = None
        self._buf = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        try:
            self.version = self.call("Browser.getVersion")
        except BaseException:
            self.close()
            raise

    # ---- protocol --------------------------------------------------------------------------

    def call(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            msg["sessionId"] = session
        try:
            os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        except OSError as e:
            raise BrowserError(f"chromium is gone ({e}); exit status {self.poll()}") from None
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            while b"\0" in self._buf:
                raw, _, self._buf = self._buf.partition(b"\0")
                reply = json.loads(raw)
                if reply.get("id") == msg["id"]:
                    if "error" in reply:
                        raise BrowserError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
                if "method" in reply and len(self.events) < 1000:
                    self.events.append(reply)
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"{method}: no answer within {timeout or self.timeout} s")
            ready, _, _ = select.select([self._from_chrome], [], [], left)
            if ready:
                data = os.read(self._from_chrome, 1 << 20)
                if not data:
                    raise BrowserError(f"chromium closed the pipe (status {self.poll()})")
                self._buf += data

    def open(self, url: str) -> Page:
        target = self.call("Target.createTarget", {"url": url})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target,
                                                      "flatten": True})["sessionId"]
        page = Page(self, session)
        page.wait(f"location.href === {json.dumps(url)} && document.readyState === 'complete'",
                  self.timeout, f"{url} loaded")
        return page

    def poll(self) -> int | None:
        """The exit status once the browser ended (reaped here), else None."""
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status

    def _wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(OSError):
                os.write(self._to_chrome, json.dumps(
                    {"id": 0, "method": "Browser.close", "params": {}}).encode() + b"\0")
            self._wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # its renderers and helpers: our pid's group
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._wait(10)
        for fd in (self._to_chrome, self._from_chrome):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser = browser
        self.session = session

    def eval(self, expression: str, timeout: float | None = None) -> Any:
        """The value of a JavaScript expression (promises awaited), as JSON."""
        got = self.browser.call("Runtime.evaluate", {
            "expression": expression, "returnByValue": True, "awaitPromise": True},
            self.session, timeout)
        if "exceptionDetails" in got:
            raise BrowserError(f"{expression[:80]!r}: {got['exceptionDetails']}")
        return got.get("result", {}).get("value")

    def wait(self, expression: str, timeout: float, what: str) -> Any:
        """Poll a JavaScript expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.eval(expression)
            if last:
                return last
            time.sleep(0.1)
        raise AssertionError(f"the page never showed {what} within {timeout} s (last value "
                             f"{last!r}); its text:\n{self.text()[:3000]}")

    def text(self) -> str:
        return str(self.eval("document.body ? document.body.innerText : ''") or "")

    def screenshot(self, path: Path, full_page: bool = True) -> bytes:
        params: dict[str, Any] = {"format": "png", "captureBeyondViewport": full_page}
        if full_page:
            w, h = self.eval("[document.documentElement.scrollWidth, "
                             "document.documentElement.scrollHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": w, "height": h, "scale": 1}
        data = base64.b64decode(self.browser.call("Page.captureScreenshot", params,
                                                  self.session)["data"])
        path.write_bytes(data)
        return data
