"""Ctrl-C stops a command cleanly wherever it lands: while the command line loads, in a sweep whose
worker processes get the same SIGINT, or inside a destructor (where Python would print "Exception
ignored" and go on): ``aborted``, exit status 130, no traceback, no temporary file left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import kvpool.cli.entry as entry

pytestmark = pytest.mark.timeout(120)
SWEEP = ["sim", "run", "mi355x-1p1d", "--sessions", "8,16", "--duration", "3600", "--seed", "11",
         "--set", "workload.synthetic_sessions=40", "--workers", "2"]


def catches_sigint(pid: int) -> bool:
    """Whether process ``pid`` has a handler of its own for SIGINT (``SigCgt`` of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (signal.SIGINT - 1) & 1)


def wait_until_python_handles_sigint(p: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Until the interpreter in ``p`` has installed its SIGINT handler (a few ms into its start; a
    SIGINT before that ends any program by the signal, before any of kvpool runs)."""
    end = time.monotonic() + timeout_s
    while not catches_sigint(p.pid):
        assert p.poll() is None and time.monotonic() < end, "the interpreter did not start"
        time.sleep(0.001)


@pytest.mark.parametrize("after_s", [0.15, 0.3, 1.0, 2.0])
def test_ctrl_c_at_any_moment_is_aborted_with_130_and_no_traceback(tmp_path, after_s):
    env = {**os.environ, "KVPOOL_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.Popen([sys.executable, "-m", "kvpool.cli", *SWEEP, "--out", str(tmp_path / "out")], cwd=tmp_path,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_until_python_handles_sigint(p)
    time.sleep(after_s)
    os.killpg(p.pid, signal.SIGINT)  # as a terminal does: the command and its worker processes
    _, err = p.communicate(timeout=60)
    text = err.decode()
    assert "Traceback" not in text and "Exception ignored" not in text, text[-3000:]
    if p.returncode != 0:  # a run that had finished before the signal exits 0
        assert p.returncode == 130 and text.strip().splitlines()[-1] == "aborted", (p.returncode, text[-2000:])
    left = [f.name for f in tmp_path.rglob("*") if ".tmp" in f.name]
    assert not left, left


def test_ctrl_c_inside_a_destructor_reaches_the_command():
    """What Python reports as unraisable (a KeyboardInterrupt in a weakref callback) is delivered to
    the main thread again, and anything else still goes to the default hook."""
    class Unraisable:
        exc_type, exc_value, exc_traceback, err_msg, object = KeyboardInterrupt, KeyboardInterrupt(), None, None, None

    # the command line runs with Python's own SIGINT handler, which turns the re-delivered Ctrl-C into
    # KeyboardInterrupt; this test process may hold another one, left by a test before it
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            entry._ctrl_c_in_a_destructor(Unraisable())
            for _ in range(1000):  # the interrupt arrives at the next bytecode boundaries
                time.sleep(0.001)
    finally:
        signal.signal(signal.SIGINT, previous)
    seen = []
    old = entry._default_unraisablehook
    entry._default_unraisablehook = seen.append
    try:
        other = type("U", (), {"exc_type": ValueError})()
        entry._ctrl_c_in_a_destructor(other)
    finally:
        entry._default_unraisablehook = old
    assert seen == [other]


def test_ctrl_c_while_the_command_line_builds_its_app_is_aborted():
    """Not only the imports: a Ctrl-C anywhere in the command line's loading (here in the app's
    construction, after every import) is ``aborted``, status 130, no traceback."""
    code = ("import runpy, typer\n"
            "def interrupted(*args, **kwargs):\n    raise KeyboardInterrupt\n"
            "typer.Typer.add_typer = interrupted  # only the top-level app adds sub-apps\n"
            "runpy.run_module('kvpool.cli', run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-c", code, "--version"], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stderr.strip()) == (130, "aborted"), (p.returncode, p.stderr[-2000:])


def test_ctrl_c_inside_a_string_exec_still_exits_130(tmp_path):
    """A Ctrl-C that ends a string ``exec`` (as one does when it lands while a dataclass or a
    namedtuple is built during an import) must not turn ``python -m``'s exit status 130 into a
    death by SIGINT."""
    (tmp_path / "interrupted_import.py").write_text(
        "import kvpool.cli as cli\n"
        "try:\n"
        "    exec('raise KeyboardInterrupt', {})\n"
        "except KeyboardInterrupt:\n"
        "    cli.exit_aborted()\n")
    p = subprocess.run([sys.executable, "-m", "interrupted_import"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (p.returncode, p.stderr.strip()) == (130, "aborted"), (p.returncode, p.stderr[-2000:])


def test_once_the_command_has_ended_ctrl_c_cannot_kill_the_exit():
    """The script's entry point: the command's status stands and SIGINT is ignored from the moment
    the command ends (a Ctrl-C during the interpreter's shutdown would otherwise be a death by
    SIGINT after the outputs were written)."""
    code = ("import signal, sys\nimport kvpool.cli as cli\nsys.argv = ['kvpool', '--version']\n"
            "try:\n    cli.script()\nexcept SystemExit as e:\n"
            "    print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, e.code)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.splitlines()[-1] == "True 0", (p.stdout, p.stderr[-2000:])
