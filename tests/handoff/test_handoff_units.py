"""Fast in-process checks: messages, argument validation, bounded waits, metrics folding."""

from __future__ import annotations

import time

import pytest
import torch

from kvpool.backend.handoff import (
    DecodeRank,
    HandoffError,
    HandoffResult,
    LocalTransport,
    PeerLost,
    PrefillStage,
    StagePart,
    StageReport,
    make_transport,
    request_metrics,
)
from kvpool.backend.handoff import messages as m
from kvpool.policy.layout import HandoffPlan

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("msg", [
    m.Attach(1, "stage1-x"),
    m.Landing(2, 7, {"kind": "local", "key": "k", "nbytes": 10}, 4096, (0, 1, 2)),
    m.Want("r", 123, 0),
    m.Ready("r", 123, 1, 3, 65088, 576),
    m.Done("r", 123, 1, 14, 867456),
    m.Credit((4, 5)),
    m.Abort("r", 123, 0, "boom", (2,)),
    m.Fail("r", 123, 3, "timed out"),
])
def test_messages_round_trip(msg):
    assert m.decode(m.encode(msg)) == msg


def test_bad_message_is_a_value_error():
    for junk in (b"not json", b'{"t": "Nope"}', b'{"t": "Want", "request_id": "r"}'):
        with pytest.raises(ValueError):
            m.decode(junk)


def _rank(slots: int = 4, slot_bytes: int = 4096, stages: int = 2) -> DecodeRank:
    caches = [torch.zeros(8, 16, 64, dtype=torch.uint8) for _ in range(4)]
    return DecodeRank(0, caches, LocalTransport(), stages=stages, slots=slots, slot_bytes=slot_bytes)


def test_decode_rank_validates_its_geometry_and_plans():
    with pytest.raises(ValueError, match="slots >= stages"):
        _rank(slots=1, stages=2)
    with pytest.raises(ValueError, match="8 MiB"):
        _rank(slot_bytes=9 << 20)
    dr = _rank()
    try:
        assert list(dr.stage_slots(1)) == [2, 3]
        big = HandoffPlan(100, 2, 64, 2, max_write_bytes=8192)
        with pytest.raises(ValueError, match="slots hold"):
            dr.expect("r", torch.arange(4), {0: StagePart(big, 0)})
        with pytest.raises(ValueError, match="stage 5"):
            dr.expect("r", torch.arange(4), {5: StagePart(HandoffPlan(10, 2, 64, 2, 4096), 0)})
        with pytest.raises(ValueError, match="exceed"):
            dr.expect("r", torch.arange(4), {0: StagePart(HandoffPlan(10, 2, 64, 2, 4096), 3)})
    finally:
        dr.close()


def test_wait_without_a_sender_fails_at_its_deadline():
    dr = _rank()
    try:
        dr.expect("r", torch.arange(4), {0: StagePart(HandoffPlan(40, 2, 64, 2, 4096), 0)})
        t0 = time.monotonic()
        with pytest.raises(HandoffError, match="not ready within"):
            dr.wait("r", 0.3)
        assert 0.3 <= time.monotonic() - t0 < 2.0
        assert dr.status("r") == "failed"
    finally:
        dr.close()


def test_connect_to_nobody_fails_within_the_connect_timeout():
    ps = PrefillStage(0, LocalTransport(), staging_bytes=1024, connect_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerLost, match="no LANDING"):
            ps.connect(["tcp://127.0.0.1:1"])
        assert time.monotonic() - t0 < 2.0
    finally:
        ps.close()


def test_unknown_transport_and_bad_timeouts_are_rejected():
    with pytest.raises(ValueError, match="transport must be one of"):
        make_transport("carrier-pigeon")
    with pytest.raises(ValueError, match="credit_timeout_s"):
        PrefillStage(0, LocalTransport(), staging_bytes=16, credit_timeout_s=0)


def test_request_metrics_use_the_simulator_names():
    reports = [StageReport("r", s, 100, 3, 0.01, 0.02, 0.0, 0.05, 2) for s in range(2)]
    results = [HandoffResult("r", r, 100, 3, 0.1 * (r + 1), 0.01, {0: 0.05, 1: 0.1 * (r + 1)}) for r in range(2)]
    got = request_metrics(reports, results)
    assert got["handoff_bytes"] == 200 and got["handoff_writes"] == 6
    assert got["handoff_s"] == pytest.approx(0.2)
    assert got["handoff_stage_s"] == {0: 0.05, 1: pytest.approx(0.2)}
