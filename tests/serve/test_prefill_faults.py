"""Faults of the prefill engine, with real processes: a decode instance that is not there fails the
hand-off with a 502 naming it; a stage that dies fails requests with a 503 naming the stage, within
a bound, and the engine reports itself failed."""

from __future__ import annotations

import signal
import time

import pytest

from prefill_testing import DecodeSide, Deployment, make_plan

from kvpool.backend.serve.prefill_scheduler import LIVENESS_EVERY_S


@pytest.fixture
def deployment(tmp_path):
    plan = make_plan(tmp_path, ["serve.prefill_kv_tokens=640"])
    dep = Deployment(plan)
    try:
        dep.start()
        yield dep, plan
    finally:
        dep.stop()
        left = {name: p.pid for name, p in dep.procs.items() if p.poll() is None}
        assert not left, f"processes left running: {left}"


def test_a_missing_decode_instance_then_a_dead_stage(deployment):
    dep, plan = deployment
    body = {"request_id": "f-1", "token_ids": list(range(100)), "decode_instance": 0}
    status, answer = dep.post("/prefill", body)
    assert status == 502 and "decode instance 0 is not ready" in answer["error"]
    assert answer["record"]["computed_tokens"] == 100       # it was computed; only the hand-off failed

    decode = DecodeSide(plan)
    try:
        decode.expect("f-2", 100)
        status, answer = dep.post("/prefill", {**body, "request_id": "f-2"})
        assert status == 200, answer
        assert answer["record"]["gpu_tokens"] == 96         # the failed request's pages were cached

        stage = dep.procs["prefill0-stage1"]
        stage.send_signal(signal.SIGKILL)
        stage.wait(5)
        t0 = time.monotonic()
        status, answer = dep.post("/prefill", {**body, "request_id": "f-3", "token_ids": list(range(1, 101))})
        assert status == 503 and "prefill0-stage1" in answer["error"] and "exited" in answer["error"]
        assert time.monotonic() - t0 < 4 * LIVENESS_EVERY_S + 2.0
        status, text = dep.get("/health")
        assert status == 503 and "failed" in text and "prefill0-stage1" in text
    finally:
        decode.close()
