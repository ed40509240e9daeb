"""The llama-server child process: start, health-poll, supervise, restart, give up.

One supervisor thread owns the child for its whole life. It matters on Linux: PR_SET_PDEATHSIG
fires when the *thread* that forked the child ends, so every (re)start happens on that one
thread, which lives as long as the child should. kill -9 of the agent therefore takes the child
with it (the kernel sends SIGKILL), and a normal exit stops it through `stop()` / atexit.

Failures, kept apart on purpose:
- the child exits before it ever became ready: a configuration problem (bad GGUF, draft_mtp on a
  model without MTP layers, ...). No retry; the reason is read from its stderr and reported.
- the child dies after it was ready: restarted, unless that is the third crash within a minute,
  in which case the breaker trips and the model is reported unavailable, not retried forever.
- the supervisor itself fails (an error that is not the child's, such as its log folder gone):
  the child is killed and the model failed with that reason, never left "starting".
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

from skulkp2p.ports import free_port
from skulkp2p.served.binary import launch_env

log = logging.getLogger("skulkp2p.served")

BREAKER_CRASHES = 3
BREAKER_WINDOW_S = 60.0
_PR_SET_PDEATHSIG = 1
_LIVE: weakref.WeakSet[ServedChild] = weakref.WeakSet()


class ServedError(RuntimeError):
    """The child cannot serve: failed to start (with its reason) or the breaker tripped."""



def _die_with_parent() -> None:
    # Runs in the forked child before exec: ask the kernel for SIGKILL when our parent goes.
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.setpgrp()  # Ctrl-C in the agent's terminal is for the agent; it stops the child itself


def stderr_reason(text: str, limit: int = 600) -> str:
    """The lines of a llama-server log that say why it stopped, else its last lines."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    keys = ("error", "failed", "exception", "unsupported", "not supported", "mtp", "abort")
    picked = [ln for ln in lines if any(k in ln.lower() for k in keys)]
    out = " | ".join((picked or lines)[-4:])
    return out[-limit:] or "(no output)"


class ServedChild:
    def __init__(self, name: str, binary: Path, args: list[str], *, host: str = "127.0.0.1",
                 ready_timeout_s: float = 120.0, log_dir: Path | None = None):
        self.name = name
        self.binary = binary
        self.args = list(args)
        self.host = host
        self.ready_timeout_s = ready_timeout_s
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.state = "starting"  # starting | ready | restarting | failed | stopped
        self.error: ServedError | None = None
        self.crashes: collections.deque[float] = collections.deque()
        self.restarts = 0
        self._cond = threading.Condition()
        self._stopping = False
        # A folder we made is ours to remove on stop; the reasons a child died are in its
        # error (stderr_reason) by then.
        self._own_log_dir = log_dir is None
        self._log_dir = log_dir or Path(tempfile.mkdtemp(prefix="skulkp2p-served-"))
        # a model named by its repository id ("owner/repo:Q4_K_M") makes one file name
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
        self._log_path = self._log_dir / f"{safe}.log"
        self._thread = threading.Thread(target=self._supervise, name=f"served-{name}",
                                        daemon=True)

    # ---- public ------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Start supervising and block until the first child is ready (or raise why not)."""
        _LIVE.add(self)
        self._thread.start()
        try:
            self.wait_ready(self.ready_timeout_s + 5)
        except BaseException:
            self.stop()  # never leave a half-started child behind
            raise

    def wait_ready(self, timeout: float) -> None:
        """Block until the child answers; raise ServedError when it cannot (any more)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.state not in ("ready", "failed", "stopped"):
                if self._supervisor_gone():
                    # _supervise ends with a final state; this is the guard for a way out
                    # that does not (nothing else would ever wake this wait)
                    raise ServedError(f"llama-server for {self.name}: its supervisor ended "
                                      f"while the child was {self.state}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServedError(f"llama-server for {self.name} is not ready after "
                                      f"{timeout:.0f} s")
                self._cond.wait(min(left, 1.0))
            if self.state == "failed":
                assert self.error is not None
                raise self.error
            if self.state == "stopped":
                raise ServedError(f"llama-server for {self.name} is stopped")

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self.state = "stopped"
            self._cond.notify_all()
        self._kill()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._own_log_dir and not self._thread.is_alive():
            shutil.rmtree(self._log_dir, ignore_errors=True)

    # ---- supervisor thread -------------------------------------------------------------------

    def _set(self, state: str, error: ServedError | None = None) -> None:
        with self._cond:
            if self._stopping:
                return
            self.state = state
            if error is not None:
                self.error = error
            self._cond.notify_all()

    def _supervisor_gone(self) -> bool:
        return self._thread.ident is not None and not self._thread.is_alive()

    def _supervise(self) -> None:
        """The supervisor thread. Whatever ends it, it ends in a final state (failed or
        stopped) with the child killed, so wait_ready never waits on a thread that is gone."""
        try:
            self._supervise_children()
        except BaseException as e:  # a bug or an OS error outside the expected ServedErrors
            self._kill()
            self._set("failed", ServedError(
                f"llama-server for {self.name}: its supervisor failed "
                f"({type(e).__name__}: {e}); not restarting it"))
            log.exception("llama-server for %s: supervisor failed", self.name)

    def _supervise_children(self) -> None:
        first = True
        while not self._stopping:
            try:
                proc = self._launch()
                self._poll_ready(proc)
            except ServedError as e:
                self._kill()
                if first or self._record_crash():
                    self._set("failed", e if first else self._breaker_error(str(e)))
                    log.error("%s", self.error)
                    return
                continue
            first = False
            self._set("ready")
            log.info("llama-server for %s ready on %s (pid %d)", self.name, self.base_url,
                     proc.pid)
            code = proc.wait()
            if self._stopping:
                return
            reason = stderr_reason(self._read_log())
            log.warning("llama-server for %s (pid %d) exited with %s: %s", self.name,
                        proc.pid, code, reason)
            if self._record_crash():
                self._set("failed", self._breaker_error(f"exit status {code}: {reason}"))
                log.error("%s", self.error)
                return
            self.restarts += 1
            self._set("restarting")

    def _record_crash(self) -> bool:
        """Note a crash; True when the breaker trips (too many within the window)."""
        now = time.monotonic()
        self.crashes.append(now)
        while self.crashes and now - self.crashes[0] > BREAKER_WINDOW_S:
            self.crashes.popleft()
        return len(self.crashes) >= BREAKER_CRASHES

    def _breaker_error(self, last: str) -> ServedError:
        return ServedError(f"llama-server for {self.name} crashed {len(self.crashes)} times "
                           f"within {BREAKER_WINDOW_S:.0f} s; not restarting it (breaker "
                           f"tripped). Last: {last}")

    def _launch(self) -> subprocess.Popen[bytes]:
        self.port = free_port(self.host)
        cmd = [str(self.binary), *self.args, "--host", self.host, "--port", str(self.port)]
        log.info("starting llama-server for %s: %s", self.name, " ".join(cmd))
        logf = open(self._log_path, "wb")  # noqa: SIM115 - the child owns it from here
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=subprocess.STDOUT, env=launch_env(self.binary),
                                         preexec_fn=_die_with_parent, close_fds=True)
        except OSError as e:
            raise ServedError(f"cannot start {self.binary}: {e.strerror or e}") from None
        finally:
            logf.close()
        return self.proc

    def _poll_ready(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        delay = 0.05
        while time.monotonic() < deadline:
            if self._stopping:
                return
            code = proc.poll()
            if code is not None:
                raise ServedError(f"llama-server for {self.name} exited during start-up "
                                  f"(status {code}): {stderr_reason(self._read_log())}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        raise ServedError(f"llama-server for {self.name} did not become ready within "
                          f"{self.ready_timeout_s:.0f} s: {stderr_reason(self._read_log())}")

    def _read_log(self) -> str:
        try:
            return self._log_path.read_bytes()[-20000:].decode("utf-8", "replace")
        except OSError:
            return ""

    def _kill(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


@atexit.register
def _stop_all() -> None:
    for child in list(_LIVE):
        child.stop(1.0)
