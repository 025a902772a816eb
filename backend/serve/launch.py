"""Start and stop ``kvpool serve`` as a child process: for ``kvpool calibrate``, the benches and the tests.

Contract:
    * ``start_serve(scenario, sets, run_dir, pool=..., env=...) -> ServeProcess`` runs
      ``python -m kvpool.cli serve SCENARIO --port 0 --run-dir RUN_DIR [--set ...] [--pool POOL]``
      in its own process group (stdin closed, stdout and stderr in ``RUN_DIR.out`` beside the run
      directory) and returns once ``RUN_DIR/router.ready.json`` exists, within ``ready_timeout_s``.
      ``run_dir`` is used as given when it is new or empty, else the first free ``run_dir-K``
      (``kvpool serve`` refuses a run directory that holds files).
    * A server that exits first, or is not ready in time, raises ``ServeStartError`` naming its
      exit status (or the bound) and its output file; one not ready in time is stopped first.
    * ``ServeProcess.stop(timeout_s)`` sends SIGTERM (the server drains, then stops every child by
      its pid), waits up to ``timeout_s``, then SIGKILLs the process group; it returns the exit
      status and is idempotent. ``pids()`` names every process the ready file lists (the
      supervisor, each worker, each pool process) so a caller can check that none outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Default bound on a start (the model's weights are built in every worker; a GPU start takes longer).
READY_TIMEOUT_S = 600.0
#: Default bound on the server's exit after SIGTERM before its process group gets SIGKILL.
STOP_TIMEOUT_S = 60.0
POLL_S = 0.1


class ServeStartError(RuntimeError):
    """``kvpool serve`` exited before it was ready, or was not ready within the bound."""


def unused_run_dir(run_dir: Path) -> Path:
    """``run_dir``, or ``run_dir-2``, ``run_dir-3``, ... when it holds files."""
    candidate, k = run_dir, 1
    while candidate.exists() and any(candidate.iterdir()):
        k += 1
        candidate = run_dir.with_name(f"{run_dir.name}-{k}")
    return candidate


@dataclass
class ServeProcess:
    """One running ``kvpool serve``: its process, run directory, output file and ready file."""

    proc: subprocess.Popen
    run_dir: Path
    log: Path
    ready: dict = field(default_factory=dict)
    status: int | None = None

    @property
    def url(self) -> str:
        return self.ready["url"]

    @property
    def workers(self) -> dict[str, int]:
        return self.ready["workers"]

    def pids(self) -> dict[str, int]:
        """Every process the ready file names: the supervisor, each worker, each pool process."""
        if not self.ready:
            return {}
        out = {"supervisor": self.ready["pid"], **self.workers}
        out.update({f"pool process {i}": pid for i, pid in enumerate(self.ready.get("pool", []))})
        return out

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> ServeProcess:
        """Wait for ``router.ready.json`` (see the module docstring)."""
        path = self.run_dir / "router.ready.json"
        end = time.monotonic() + timeout_s
        while not path.exists():
            if self.proc.poll() is not None:
                raise ServeStartError(f"kvpool serve exited with status {self.proc.returncode}; see {self.log}")
            if time.monotonic() > end:
                self.stop()
                raise ServeStartError(f"kvpool serve was not ready within {timeout_s:g} s; see {self.log}")
            time.sleep(POLL_S)
        self.ready = json.loads(path.read_text())
        return self

    def wait_exit(self, timeout_s: float) -> int:
        """The exit status of a server that exits by itself (e.g. after a worker died), within ``timeout_s``."""
        self.status = self.proc.wait(timeout_s)
        return self.status

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL the process group; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self.status = self.proc.returncode
        return self.status


def serve_argv(scenario: str, sets: list[str], run_dir: Path, pool: str | None = None) -> list[str]:
    """The command line of ``kvpool serve`` for ``start_serve``."""
    argv = [sys.executable, "-m", "kvpool.cli", "serve", scenario, "--port", "0", "--run-dir", str(run_dir)]
    for x in sets:
        argv += ["--set", x]
    if pool is not None:
        argv += ["--pool", pool]
    return argv


def start_serve(scenario: str, sets: list[str], run_dir: Path, *, pool: str | None = None, env: dict | None = None,
                ready_timeout_s: float = READY_TIMEOUT_S) -> ServeProcess:
    """``kvpool serve SCENARIO`` ready at a free port (see the module docstring)."""
    run_dir = unused_run_dir(Path(run_dir))
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_name(run_dir.name + ".out")
    with log.open("wb") as f:
        proc = subprocess.Popen(serve_argv(scenario, sets, run_dir, pool), stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})})
    served = ServeProcess(proc, run_dir, log)
    try:
        return served.wait_ready(ready_timeout_s)
    except BaseException:
        served.stop()
        raise


__all__ = ["ServeProcess", "ServeStartError", "unused_run_dir", "serve_argv", "start_serve"]
