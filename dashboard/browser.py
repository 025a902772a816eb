"""A running ``kvpool dashboard`` and the headless Chromium that drives it (Playwright).

Contract:
    * ``served_dashboard(log) -> url``: a context manager that starts ``kvpool dashboard`` (the
      ``kvpool`` beside this Python) on a free 127.0.0.1 port in its own process group, with its
      output to ``log`` (a file object, or ``None`` to discard it), waits until
      ``/_stcore/health`` answers 200 (at most ``timeout_s``; ``DashboardError`` if it exits or
      does not answer), yields ``http://127.0.0.1:PORT`` and stops it on exit (SIGTERM, SIGKILL
      after ``STOP_TIMEOUT_S``).
    * ``CHROMIUM`` and ``CHROMIUM_ARGS``: Debian's Chromium (never ``playwright install``) and the
      flags of a headless, offline run; ``missing_chromium()`` names what to install when it is absent.
    Used by ``scripts/dashboard_screenshots.py`` and ``tests/dashboard/test_e2e_browser.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STOP_TIMEOUT_S = 10.0


class DashboardError(RuntimeError):
    """The dashboard exited or did not answer its health check in time."""


def missing_chromium() -> str | None:
    """``None`` when Chromium is there, otherwise what is missing and how to install it."""
    if os.path.exists(CHROMIUM):
        return None
    return f"{CHROMIUM} is missing: scripts/setup.sh dev installs Debian's chromium"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DashboardError(f"kvpool dashboard exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise DashboardError(f"{url} did not answer its health check in {timeout_s:.0f} s")


@contextmanager
def served_dashboard(log: IO[str] | None = None, timeout_s: float = 90.0) -> Iterator[str]:
    """See the module docstring."""
    port = _free_port()
    kvpool = str(Path(sys.executable).with_name("kvpool"))
    out = log if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen([kvpool, "dashboard", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, timeout_s)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
