"""The supervisor starts the plan's processes, serves, drains and stops them, with stand-in engines;
no process outlives it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from supervisor_testing import alive, get, post, processes_of, slow_request, start, wait_draining, wait_generating

pytestmark = pytest.mark.timeout(120)

NAMES = {"decode0", "prefill0-stage0", "prefill0-stage1", "prefill0"}  # cpu-tiny: 1P (PP2) + 1D


def test_start_serve_and_sigterm_stop_every_child(tmp_path):
    s = start(tmp_path)
    try:
        s.wait_ready()
        assert set(s.workers) == NAMES
        pids = list(s.workers.values())
        assert all(alive(p) for p in pids) and sorted(processes_of(tmp_path)) == sorted(pids)
        plan = json.loads((tmp_path / "plan.json").read_text())
        assert [w["name"] for w in plan["workers"]] == ["prefill0-stage0", "prefill0-stage1", "prefill0", "decode0"]
        for name in NAMES:
            assert (tmp_path / f"{name}.log").read_text().startswith(f"{name}: serving")
        assert s.url.startswith("http://127.0.0.1:")
        status, r = post(s.url, {"prompt": [1, 2, 3], "max_tokens": 3})
        assert status == 200 and len(r["choices"][0]["token_ids"]) == 3
        assert get(f"{s.url}/health")[0] == 200
        assert b"kvpool:requests_total" in get(f"{s.url}/metrics")[1]
        s.signal(signal.SIGTERM)
        assert s.wait() == 0
        out, err = s.output()
        assert f"on {s.url}" in out and all(name in out for name in NAMES)
        assert not any(alive(p) for p in pids) and processes_of(tmp_path) == []
    finally:
        s.stop()


def test_sigint_drains_an_in_flight_request_first(tmp_path):
    s = start(tmp_path, behaviour={"decode0": {"token_delay_s": 0.1}})
    try:
        s.wait_ready()
        result = {}
        t = threading.Thread(target=lambda: result.update(r=post(s.url, {"prompt": [5], "max_tokens": 12})))
        t.start()
        wait_generating(s.url)  # its 10 tokens still to come take 1.0 s
        s.signal(signal.SIGINT)
        t.join(30)
        assert result["r"][0] == 200 and len(result["r"][1]["choices"][0]["token_ids"]) == 12
        assert s.wait() == 0
        assert processes_of(tmp_path) == []
    finally:
        s.stop()


def test_the_drain_is_bounded_by_serve_drain_s(tmp_path):
    s = start(tmp_path, ["serve.drain_s=0.5"], behaviour={"decode0": {"token_delay_s": 1.0}})
    try:
        s.wait_ready()
        t, result = slow_request(s.url)
        t0 = time.monotonic()
        s.signal(signal.SIGTERM)
        assert s.wait() == 0
        assert time.monotonic() - t0 < 10.0  # 0.5 s drain + the children's stop, not the request's 30 s
        t.join(10)
        status, body = result["r"]
        assert status == 503 and body["error"]["type"] == "unavailable"
        assert "did not finish within serve.drain_s = 0.5 s" in body["error"]["message"]
        assert "1 request(s) still running after serve.drain_s = 0.5 s" in s.output()[1]
        assert processes_of(tmp_path) == []
    finally:
        s.stop()


def test_a_child_ignoring_sigterm_is_killed(tmp_path):
    s = start(tmp_path, behaviour={"prefill0": {"ignore_sigterm": True}}, stop_timeout_s=1.0)
    try:
        s.wait_ready()
        pids = list(s.workers.values())
        s.signal(signal.SIGTERM)
        assert s.wait() == 0
        err = s.output()[1]
        assert "prefill0 (pid" in err and "did not stop within 1 s of SIGTERM; sending SIGKILL" in err
        assert not any(alive(p) for p in pids)
    finally:
        s.stop()


def test_a_child_killed_while_serving_is_reported_and_everything_stops(tmp_path):
    s = start(tmp_path, behaviour={"decode0": {"token_delay_s": 0.2}})
    try:
        s.wait_ready()
        pids = dict(s.workers)
        result = {}
        t = threading.Thread(target=lambda: result.update(r=post(s.url, {"prompt": [5], "max_tokens": 20})))
        t.start()
        wait_generating(s.url)  # its 18 tokens still to come take 3.6 s
        os.kill(pids["decode0"], signal.SIGKILL)
        t.join(30)
        status, body = result["r"]
        assert status == 502 and body["error"]["type"] == "engine_error"
        assert body["error"]["message"].startswith("decode0: POST /generate")
        assert s.wait() == 1
        _, err = s.output()
        assert f"error: decode0 (pid {pids['decode0']}) exited with signal SIGKILL while serving" in err
        assert "decode0: serving" in err  # the tail of its log
        assert not any(alive(p) for p in pids.values()) and processes_of(tmp_path) == []
    finally:
        s.stop()


def test_a_child_failing_at_start_is_reported_and_nothing_is_left(tmp_path):
    s = start(tmp_path, behaviour={"prefill0": {"exit_at_start": 3}})
    try:
        assert s.wait(60) == 1
        out, err = s.output()
        assert "error: prefill0 (pid" in err and "exited with status 3 before it was ready" in err
        assert "prefill0: exiting with status 3 as told" in err
        assert not (tmp_path / "router.ready.json").exists()
        assert processes_of(tmp_path) == []
        # the decode engine and both stages had started before it
        assert all((tmp_path / f"{n}.ready.json").exists() for n in ("decode0", "prefill0-stage0", "prefill0-stage1"))
    finally:
        s.stop()


def test_sigterm_during_the_start_stops_what_was_started(tmp_path):
    s = start(tmp_path, behaviour={"prefill0": {"start_delay_s": 30.0}})
    try:
        end = time.monotonic() + 60
        while not (tmp_path / "prefill0.log").exists() or not processes_of(tmp_path):
            assert time.monotonic() < end and s.proc.poll() is None
            time.sleep(0.05)
        started = processes_of(tmp_path)
        s.signal(signal.SIGTERM)
        assert s.wait() == 0
        assert "stopped by a signal before every process was ready" in s.output()[1]
        assert not any(alive(p) for p in started) and processes_of(tmp_path) == []
    finally:
        s.stop()


@pytest.mark.parametrize("after_the_drain_began", [True, False], ids=["after-the-drain-began", "at-once"])
def test_a_second_signal_ends_the_drain_at_once(tmp_path, after_the_drain_began):
    """Also a second signal that comes before the drain has begun (a fast double Ctrl-C)."""
    s = start(tmp_path, ["serve.drain_s=60"], behaviour={"decode0": {"token_delay_s": 1.0}})
    try:
        s.wait_ready()
        t, result = slow_request(s.url)
        t0 = time.monotonic()
        s.signal(signal.SIGTERM)
        if after_the_drain_began:
            wait_draining(s.url)  # the first signal was handled: the next one is a second signal
            assert s.proc.poll() is None  # draining: the request has 60 s
        s.signal(signal.SIGINT)
        assert s.wait() == 0
        assert time.monotonic() - t0 < 10.0
        t.join(10)
        assert result["r"][0] == 503 and result["r"][1]["error"]["type"] == "unavailable"
        assert "a second signal" in s.output()[1] and processes_of(tmp_path) == []
    finally:
        s.stop()
