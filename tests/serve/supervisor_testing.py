"""Run the supervisor with stand-in engines as a process (``standin_serve.py``) and look at what it leaves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
MODEL = "refmodel-tiny"


def processes_of(run_dir: Path) -> list[int]:
    """Pids of the processes whose command line names ``run_dir``'s plan (the supervisor's children)."""
    needle = str(run_dir / "plan.json").encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state != "Z":
            pids.append(int(entry.name))
    return pids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Served:
    proc: subprocess.Popen
    run_dir: Path
    url: str = ""
    workers: dict | None = None

    def wait_ready(self, timeout_s: float = 60.0) -> Served:
        path = self.run_dir / "router.ready.json"
        end = time.monotonic() + timeout_s
        while not path.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"the supervisor exited with {self.proc.returncode}: {self.output()}")
            assert time.monotonic() < end, "the supervisor was not ready in time"
            time.sleep(0.05)
        info = json.loads(path.read_text())
        self.url, self.workers = info["url"], info["workers"]
        return self

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        return self.proc.wait(timeout_s)

    def output(self) -> tuple[str, str]:
        if self.proc.poll() is None:
            return "", ""
        return self.proc.stdout.read(), self.proc.stderr.read()

    def stop(self) -> None:
        """Whatever happened in the test: the supervisor and its children end (SIGKILL as the last resort)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for pid in processes_of(self.run_dir):
            os.kill(pid, signal.SIGKILL)


def start(run_dir: Path, sets: list[str] = (), behaviour: dict | None = None, stop_timeout_s: float = 5.0) -> Served:
    argv = [sys.executable, str(HERE / "standin_serve.py"), "--run-dir", str(run_dir), "--stop-timeout-s",
            str(stop_timeout_s)]
    for s in sets:
        argv += ["--set", s]
    env = {**os.environ, "STANDIN_BEHAVIOUR": json.dumps(behaviour or {})}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return Served(proc, run_dir)


def post(url: str, body: dict, timeout_s: float = 30.0) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps({"model": MODEL, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(url: str, name: str) -> float:
    """The value of the router's unlabelled series ``name`` in ``GET URL/metrics`` (0 if absent)."""
    for line in get(f"{url}/metrics")[1].decode().splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


def wait_until(what: str, pred, timeout_s: float = 30.0) -> None:
    """Poll ``pred`` until it holds; fail naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, f"{what} did not happen within {timeout_s:g} s"
        time.sleep(0.02)


def wait_running(url: str) -> None:
    """Until the router has admitted a request (it is in flight: a drain waits for it)."""
    wait_until("a request admitted", lambda: metric(url, "kvpool:requests_running") >= 1)


def slow_request(url: str, max_tokens: int = 30) -> tuple[threading.Thread, dict]:
    """A one-token prompt asking for ``max_tokens`` tokens, posted from a thread, once the router
    has admitted it: the thread and the dict its answer lands in (``result["r"] = (status, body)``)."""
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=post(url, {"prompt": [5], "max_tokens": max_tokens})))
    t.start()
    wait_running(url)
    return t, result


def wait_generating(url: str) -> None:
    """Until decode has streamed a token of a request to the router (it is generating)."""
    wait_until("a token from decode", lambda: metric(url, "kvpool:inter_token_latency_seconds_count") >= 1)


def wait_draining(url: str) -> None:
    """Until the router drains (after a first stop signal): ``/health`` says so."""
    wait_until("the drain", lambda: json.loads(get(f"{url}/health")[1]).get("status") == "draining")


def get(url: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
