"""``kvpool serve``'s bad input: one ``error:`` line naming the input, exit status 2, nothing started."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

KVPOOL = shutil.which("kvpool", path=str(Path(sys.executable).parent)) or "kvpool"


def serve(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([KVPOOL, "serve", *args], capture_output=True, text=True, timeout=90, cwd=cwd,
                          env={**os.environ, "COLUMNS": "120"})


@pytest.mark.parametrize("args,words", [
    (["no-such-scenario"], "no-such-scenario"),
    (["cpu-tiny", "--set", "model.record_bytes=576"], "the reference model cannot serve it: model.record_bytes is 576"),
    (["cpu-tiny", "--set", "serve.colour=1"], "serve.colour"),
    (["cpu-tiny", "--devices", "gpu0"], "--devices gpu0: 'gpu0' is not a device; allowed: cpu, cuda, cuda:N"),
    (["cpu-tiny", "--on-worker-exit", "later"], "--on-worker-exit later: allowed: shutdown, restart"),
    (["cpu-tiny", "--on-worker-exit", "restart"], "--on-worker-exit restart: not supported yet"),
    (["cpu-tiny", "--port", "70000"], "--port 70000: expected 0-65535"),
])
def test_bad_input_is_one_error_line(args, words, tmp_path):
    r = serve(*args, cwd=tmp_path)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and words in lines[0]
    assert not (tmp_path / "out").exists()  # no run directory: nothing was started


def test_a_port_in_use_is_one_error_line_before_any_process_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = serve("cpu-tiny", "--port", str(port), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: --port {port}: cannot listen on 127.0.0.1:{port}")
    assert not list((tmp_path / "run").glob("*.log"))  # no worker was started
