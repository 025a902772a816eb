"""Faults with real processes on loopback: a decode rank killed mid-handoff, credits that never
come back, a failed write (quarantine). Every wait is bounded; each test states its bound."""

from __future__ import annotations

import os
import signal
import time

import pytest

from handoff_workers import Geom, call, decode_main, expected_rank_kv, prefill_main

from kvpool.backend.handoff import HandoffResult, StageReport

pytestmark = pytest.mark.timeout(120)

G = Geom(tokens=1100, stages=1, ranks=1, slots=2)   # ~30 writes of 64 KiB through 2 slots


def _decode(cluster, g, **opts):
    return cluster._started(*cluster._spawn(decode_main, 0, g, "mooncake", opts))


def _prefill(cluster, g, endpoints, **opts):
    return cluster._started(*cluster._spawn(prefill_main, 0, g, "mooncake", endpoints, opts))


def _send(conn, rid, seed=0, target="a", timeout_s=30.0):
    conn.send(("send", rid, seed, target, timeout_s, {}))
    assert conn.poll(timeout_s + 10), "prefill did not answer"
    return conn.recv()[1]


def test_decode_killed_mid_handoff_fails_fast_then_retries_elsewhere(cluster):
    """Decode A dies after 3 landed writes: the stage reports an error within the heartbeat bound
    (not the credit timeout), and the same request then goes to decode B and lands bit-exact."""
    a_proc, a, a_ep = _decode(cluster, G, die_after_writes=3)
    _, b, b_ep = _decode(cluster, G)
    _, p, _ = _prefill(cluster, G, [a_ep], credit_timeout_s=20.0, peer_timeout_s=1.0)
    call(a, ("expect", "r1", 0, {}))
    rep = _send(p, "r1")
    assert isinstance(rep, dict), f"send to a dead decode succeeded: {rep}"
    assert rep["error"] in ("PeerLost", "TransferFailed"), rep
    assert rep["after_s"] < 5.0, rep
    a_proc.join(5)
    assert a_proc.exitcode == 9
    call(p, ("connect", "b", [b_ep]))
    call(b, ("expect", "r1", 0, {}))
    rep = _send(p, "r1", target="b")
    assert isinstance(rep, StageReport) and rep.handoff_writes == G.plan().batched_writes, rep
    assert isinstance(call(b, ("wait", "r1", 20)), HandoffResult)
    assert call(b, ("kv", 0, {})).equal(expected_rank_kv(G, 0, 0))


def test_hung_decode_rank_is_declared_lost_by_heartbeat(cluster):
    """Decode SIGSTOPs itself after 3 landed writes (alive, but its engine and side channel are
    frozen; an engine write to it would only fail after MC_TRANSFER_TIMEOUT, 30 s): the ZMQ
    heartbeat declares it lost after peer_timeout_s, well before the credit timeout."""
    proc, d, ep = _decode(cluster, G, freeze_after_writes=3)
    _, p, _ = _prefill(cluster, G, [ep], credit_timeout_s=20.0, peer_timeout_s=1.0)
    call(d, ("expect", "r1", 0, {}))
    try:
        rep = _send(p, "r1")
        assert isinstance(rep, dict) and rep["error"] == "PeerLost", rep
        assert rep["after_s"] < 6.0, rep
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_credits_that_never_come_back_fail_after_the_bounded_wait(cluster):
    """The decode rank stops handling READYs (alive, heartbeats answered): the stage runs out of
    credits and fails with CreditTimeout after credit_timeout_s, not before and not much later."""
    _, d, ep = _decode(cluster, G, stall_after_writes=2)
    _, p, _ = _prefill(cluster, G, [ep], credit_timeout_s=1.0)
    call(d, ("expect", "r1", 0, {}))
    rep = _send(p, "r1")
    assert isinstance(rep, dict) and rep["error"] == "CreditTimeout", rep
    assert 1.0 <= rep["after_s"] < 6.0, rep


def test_failed_write_quarantines_its_slot_until_released(cluster):
    """Write #1 lands but reports failure: the request fails on both sides, its slot is
    quarantined on both sides (never scattered, never credited), the next request runs on the
    other slots and is bit-exact, and after quarantine_s the slot is credited back."""
    g = Geom(tokens=1100, stages=1, ranks=1, slots=4)
    _, d, ep = _decode(cluster, g, quarantine_s=3.0)
    _, p, _ = _prefill(cluster, g, [ep], fail_write=1)
    call(d, ("expect", "r1", 0, {}))
    rep = _send(p, "r1")
    assert isinstance(rep, dict) and rep["error"] == "TransferFailed", rep
    with pytest.raises(RuntimeError, match="aborted"):
        call(d, ("wait", "r1", 10))
    quarantined = call(p, ("stats", "a"))["quarantined"][0]
    assert quarantined, "no slot quarantined on the prefill side"
    deadline = time.monotonic() + 5
    while call(d, ("state",))["quarantined"] != quarantined:
        assert time.monotonic() < deadline, "decode never quarantined the slots"
        time.sleep(0.05)
    assert call(p, ("credits", "a")) == [g.slots - len(quarantined)]
    call(d, ("expect", "r2", 1, {}))
    rep = _send(p, "r2", seed=1)
    assert isinstance(rep, StageReport), rep
    assert isinstance(call(d, ("wait", "r2", 20)), HandoffResult)
    assert call(d, ("kv", 1, {})).equal(expected_rank_kv(g, 0, 1))
    deadline = time.monotonic() + 10
    while call(p, ("credits", "a")) != [g.slots]:
        assert time.monotonic() < deadline, "quarantined slots never came back"
        time.sleep(0.1)
    assert call(d, ("state",))["quarantined"] == []


@pytest.mark.gpu
def test_stage_dies_after_fenced_readies(cluster):
    """GPU IPC with device fences: the stage dies right after its first writes and their READIES
    (fences) went out. Each rank either scatters what landed or fails the request at its deadline;
    nothing hangs, and the rank keeps answering."""
    g = Geom(tokens=701, stages=1, ranks=2, slots=2, max_write_bytes=16 * 1024)
    decodes = cluster.decodes(g, "ipc", device="cuda:0")
    dconns = [c for _, c, _ in decodes]
    (pp, p, _), = cluster.prefills(g, "ipc", [ep for _, _, ep in decodes], device="cuda:0", die_on_poll=True)
    for conn in dconns:
        call(conn, ("expect", "dies", 3, {}))
    p.send(("send", "dies", 3, "a", 10.0, {}))
    pp.join(30)
    assert pp.exitcode == 9
    t0 = time.monotonic()
    for conn in dconns:
        with pytest.raises(RuntimeError, match="not ready within|fence"):   # later writes never come
            call(conn, ("wait", "dies", 3), 15)
        state = call(conn, ("state",))
        assert state["fenced"] >= 1 and state["landed"] >= 1
    assert time.monotonic() - t0 < 15
