"""``python -m kvpool.backend.pool.netns COMMAND``: brings ``lo`` up in a fresh namespace, then runs COMMAND.

A new ``unshare -n`` namespace starts with ``lo`` down (no socket can reach 127.0.0.1); through the
module the command finds it up and the namespace acceptable for Mooncake (``netns_problem()`` is
``None``). Errors are one ``error:`` line and status 2.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

MODULE = [sys.executable, "-m", "kvpool.backend.pool.netns"]
PROBE = ("import socket; from kvpool.backend.pool.netns import interface_up, netns_problem\n"
         "print(interface_up('lo'), netns_problem())\n"
         "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
         "socket.create_connection(s.getsockname(), timeout=5).close(); print('connected')")


def can_unshare() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-n", "true"], capture_output=True, timeout=30).returncode == 0


needs_unshare = pytest.mark.skipif(not can_unshare(), reason="needs permission to create a network namespace (unshare -n)")


@needs_unshare
def test_a_fresh_namespace_has_loopback_down():
    done = subprocess.run(["unshare", "-n", sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and done.stdout.startswith("False the loopback interface is down"), done


@needs_unshare
def test_the_module_brings_loopback_up_and_runs_the_command():
    done = subprocess.run(["unshare", "-n", *MODULE, sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["True None", "connected"]


@needs_unshare
def test_a_command_that_is_not_there_is_one_error_line():
    done = subprocess.run(["unshare", "-n", *MODULE, "/nonexistent/cmd"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.splitlines() == ["error: /nonexistent/cmd: No such file or directory"]


def test_no_command_is_a_usage_error():
    done = subprocess.run(MODULE, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("error: usage: python -m kvpool.backend.pool.netns COMMAND")
