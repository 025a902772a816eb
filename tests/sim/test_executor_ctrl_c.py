"""A Ctrl-C while a sweep's worker processes start (``sim.executor``): the caller gets the
``KeyboardInterrupt`` at once and no process is left behind, whichever process had just started
when the terminal's SIGINT came: the progress queue's server or a pool worker. A task's error
ends the map the same way, without waiting for the other tasks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(120)

#: the sweep under test, with SIGINT sent to its process group right after each process named so starts
#: (every process of the group gets it, as from a terminal); its two tasks would take 30 s
SWEEP = """
import multiprocessing.process, os, signal, sys, time
from kvpool.sim.executor import Runner

start = multiprocessing.process.BaseProcess.start

def start_then_ctrl_c(process):
    start(process)
    if process.name.startswith(sys.argv[1]) and os.getpid() == TOP:
        os.killpg(0, signal.SIGINT)
        time.sleep(0.05)  # the signal is handled here, before the start returns

def nap(seconds, report):
    time.sleep(seconds)

if __name__ == "__main__":
    TOP = os.getpid()
    multiprocessing.process.BaseProcess.start = start_then_ctrl_c
    try:
        Runner("local", 2).map(nap, [30.0, 30.0], on_progress=lambda i, value: None)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""


def group_is_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("started", ["SyncManager", "ForkProcess"])
def test_ctrl_c_as_the_processes_start_stops_them_all(tmp_path, started):
    (tmp_path / "sweep.py").write_text(SWEEP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    p = subprocess.Popen([sys.executable, "-m", "sweep", started], cwd=tmp_path, env=env, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal starts it
    try:
        out, err = p.communicate(timeout=25)  # the tasks alone would take 30 s
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert (p.returncode, out.strip()) == (0, "interrupted"), (p.returncode, out, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    end = time.monotonic() + 10  # the terminated workers are reaped by the time the sweep returns
    while not group_is_gone(p.pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert group_is_gone(p.pid), "a process of the sweep outlived it"


def fail_at_once_or_nap(seconds: float) -> float:
    if seconds == 0:
        raise ValueError("this task fails")
    time.sleep(seconds)
    return seconds


def test_a_failing_task_stops_the_others_and_reaches_the_caller():
    """The error of one task ends the map at once: the other task's 30 s nap is not waited for, and
    no worker process is left."""
    import multiprocessing

    from kvpool.sim.executor import Runner

    before = set(multiprocessing.active_children())  # another test's, if any
    started = time.monotonic()
    with pytest.raises(ValueError, match="this task fails"):
        Runner("local", 2).map(fail_at_once_or_nap, [30.0, 0.0])
    assert time.monotonic() - started < 25
    assert set(multiprocessing.active_children()) <= before
