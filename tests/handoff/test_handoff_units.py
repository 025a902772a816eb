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
    handoff_breakdown,
    make_transport,
    record_handoff,
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


def test_mooncake_transport_refuses_public_listeners_unless_allowed(monkeypatch):
    """Outside a private namespace the engine is not started unless the caller allows it."""
    from kvpool.backend.pool import netns

    monkeypatch.setattr(netns.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
    engine = pytest.importorskip("mooncake.engine")
    monkeypatch.setattr(engine, "TransferEngine", lambda: pytest.fail("the transfer engine started"))
    with pytest.raises(netns.PublicListenersRefused, match=r"\(eth0\).*allow_public_listeners=True"):
        make_transport("mooncake")


def test_the_handoff_fills_the_request_record():
    from kvpool.workload.records import RequestRecord

    reports = [StageReport("r", s, 100, 3, 0.01 * (s + 1), 0.02, 0.0, 0.05, 2) for s in range(2)]
    results = [HandoffResult("r", r, 100, 3, 0.1 * (r + 1), 0.01 * (r + 1), {0: 0.05, 1: 0.1 * (r + 1)})
               for r in range(2)]
    rec = RequestRecord("r", restore_bytes=7)
    assert record_handoff(rec, reports, results) is rec
    assert (rec.handoff_bytes, rec.handoff_writes) == (200, 6)
    assert rec.handoff_s == pytest.approx(0.2)
    assert rec.restore_bytes == 7 and rec.as_dict()["handoff_bytes"] == 200  # the other fields are left alone
    parts = handoff_breakdown(reports, results)
    assert parts.stage_s == {0: 0.05, 1: pytest.approx(0.2)}
    assert (parts.gather_s, parts.scatter_s) == (pytest.approx(0.02), pytest.approx(0.02))
    other = RequestRecord("q")
    with pytest.raises(ValueError, match="request\\(s\\) r given for request 'q'"):
        record_handoff(other, reports, results)
    assert (other.handoff_bytes, other.handoff_writes, other.handoff_s) == (0, 0, 0.0)


class FakeStage:
    """A raw DEALER speaking the stage side of the protocol, driven in the test's thread."""

    def __init__(self, endpoint: str, stage: int = 0) -> None:
        import zmq

        self.zmq = zmq
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.send(m.encode(m.Attach(stage, "fake")))

    def send(self, msg) -> None:
        self.sock.send(m.encode(msg))

    def recv(self, dr: DecodeRank, kind: type, timeout_s: float = 3.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dr.poll(0.01)
            try:
                msg = m.decode(self.sock.recv(self.zmq.NOBLOCK))
            except self.zmq.Again:
                continue
            if isinstance(msg, kind):
                return msg
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def close(self) -> None:
        self.sock.close(0)


def _protocol_setup():
    dr = _rank(slots=4, slot_bytes=4096, stages=2)
    fake = FakeStage(dr.endpoint)
    landing = fake.recv(dr, m.Landing)
    plan = HandoffPlan(40, 2, 64, 2, 4096)
    nonce = dr.expect("r", torch.arange(4), {0: StagePart(plan, 0)})
    want = fake.recv(dr, m.Want)
    return dr, fake, landing, plan, nonce, want


def test_stale_ready_is_dropped_and_its_slot_credited_back():
    """A READY with another nonce (an earlier attempt) is never scattered; its slot comes back."""
    dr, fake, landing, plan, nonce, want = _protocol_setup()
    try:
        assert landing.slots == (0, 1) and want.nonce == nonce
        w = plan.writes(0)[0]
        fake.send(m.Ready("r", nonce + 1, 0, 1, w.offset_bytes, w.nbytes))
        assert fake.recv(dr, m.Credit).slots == (1,)
        assert dr.dropped_readies == 1 and dr.landed_writes == 0 and dr.status("r") == "pending"
    finally:
        fake.close()
        dr.close()


def test_ready_outside_the_plan_fails_the_request_and_tells_the_stage():
    dr, fake, landing, plan, nonce, want = _protocol_setup()
    try:
        fake.send(m.Ready("r", nonce, 0, 0, 64, 128))   # no such write in the plan
        assert fake.recv(dr, m.Credit).slots == (0,)
        fail = fake.recv(dr, m.Fail)
        assert fail.request_id == "r" and "not in the plan" in fail.reason
        assert dr.status("r") == "failed"
    finally:
        fake.close()
        dr.close()


def test_abort_quarantines_slots_then_credits_them_back():
    dr, fake, landing, plan, nonce, want = _protocol_setup()
    dr.quarantine_s = 0.3
    try:
        t0 = time.monotonic()                                                 # before the quarantine begins
        fake.send(m.Abort("r", nonce, 0, "write failed", (1,)))
        deadline = time.monotonic() + 2
        while dr.status("r") == "pending" and time.monotonic() < deadline:
            dr.poll(0.01)
        assert dr.status("r") == "failed" and dr.quarantined_slots == [1]
        w = plan.writes(0)[0]
        fake.send(m.Ready("r2", nonce, 0, 1, w.offset_bytes, w.nbytes))   # a quarantined slot: ignored
        assert fake.recv(dr, m.Credit).slots == (1,)                          # only after quarantine_s
        assert time.monotonic() - t0 >= dr.quarantine_s and dr.quarantined_slots == []
    finally:
        fake.close()
        dr.close()


@pytest.mark.parametrize("kind", ["local", "ipc"])
def test_submit_group_writes_every_peer_and_completes_them_together(kind):
    from kvpool.backend.handoff.transport import DONE

    t = make_transport(kind)
    src = torch.arange(64, dtype=torch.uint8)
    t.register_source(src)
    pools = [t.allocate(32) for _ in range(2)]
    peers = [t.open(t.expose(p)) for p in pools]
    for p in pools:
        p.zero_()
    jobs = [(peers[0], [(0, 0, 8), (8, 8, 8)]), (peers[1], [(32, 16, 8)])]
    handles = t.submit_group(jobs, src)
    assert [len(h) for h in handles] == [2, 1]
    assert all(t.poll(h) == DONE for hs in handles for h in hs)
    assert pools[0][:16].tolist() == list(range(16)) and pools[1][16:24].tolist() == list(range(32, 40))
    with pytest.raises(ValueError):
        t.submit_group([(peers[0], [(0, 30, 8)])], src)   # past the peer's pool
    t.close()
