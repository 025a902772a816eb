"""The prefill engine and its stages on a real local Mooncake pool (``serve.pool = "mooncake"``,
started by ``backend.serve.pool_setup``: one master and one store service on 127.0.0.1), handing KV
to decode ranks in this process.

A prompt evicted from the GPU prefix cache is restored from the pool and the landed KV equals a
single-process ``RefModel.prefill`` bit for bit. Then the pool's processes are killed under the
running deployment: after the store service dies, a restore of its chunks fails and the request
recomputes (the lookup still finds the keys: the master lists them until its client TTL); a
request in flight when the master dies ends with exact KV or a 5xx naming the cause; after the
master died, the lookup gets no answer and the request computes. Every answer comes within a stated
bound and its KV is still exact; afterwards no process is left. The fault test runs after the
restore test (file order): it kills the pool both share.

Mooncake's listeners bind every interface, so these tests fail (never skip) outside a private
network namespace: ``unshare -n sh -c 'ip link set lo up && .venv/bin/python -m pytest tests/serve'``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from prefill_testing import DecodeSide, Deployment, Reference, make_plan
from test_prefill_engine import assert_matches_reference, prompt, sources

from kvpool.backend.pool.netns import netns_problem
from kvpool.backend.serve import pool_setup
from kvpool.backend.serve.pool_setup import ServePoolError, pool_spec, start_serve_pool
from kvpool.backend.serve.prefill_scheduler import EXISTS_WAIT_S
from kvpool.backend.serve.plan import ServePlan, build_plan

#: 40 pages of prefill KV, 128-token steps, one 64 MiB store service (so one kill loses every chunk).
OVERRIDES = ["serve.pool=mooncake", "serve.prefill_kv_tokens=640", "prefill.max_batched_tokens=128",
             "pool.services_per_server=1", "pool.gib_per_service=0.0625"]
#: Mooncake client RPC timeout of every process (a hung master fails calls after it).
RPC_TIMEOUT_MS = 1_000
#: A request after a store service died: the failed read (at most ~1 s of reconnects) plus compute.
DEAD_SERVICE_BOUND_S = 5.0
#: A request after the master died: the unanswered lookup (at most EXISTS_WAIT_S), a save whose put
#: gets no answer (~4.3 s of reconnects), compute.
DEAD_MASTER_BOUND_S = EXISTS_WAIT_S + 8.0


def require_private_netns() -> None:
    problem = netns_problem()
    if problem:
        pytest.fail(f"refusing to start Mooncake processes: {problem}", pytrace=False)
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    os.environ["MC_RPC_TIMEOUT_MS"] = str(RPC_TIMEOUT_MS)  # inherited by the stage processes


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_private_netns()
    run_dir = tmp_path_factory.mktemp("prefill-mooncake")
    plan0 = make_plan(run_dir, OVERRIDES)
    sc = plan0.scenario_model()
    # client TTL 10 s: a killed service's keys stay listed through the fault test's first phase
    pool = start_serve_pool(sc, run_dir, None, spec=pool_spec(sc, lease_ttl_ms=2_000, client_ttl_s=10,
                                                              rpc_timeout_ms=RPC_TIMEOUT_MS))
    pool_pids = pool.pids()
    dep = decode = None
    try:
        plan = build_plan(sc, run_dir, router_port=0, pool_address=pool.address)
        plan.write()
        decode = DecodeSide(plan)
        dep = Deployment(plan).start()
        yield dep, decode, Reference(plan), pool
    finally:
        if dep is not None:
            dep.stop()
        if decode is not None:
            decode.close()
        pool.stop()
        left = {name: p.pid for name, p in (dep.procs.items() if dep else ()) if p.poll() is None}
        left.update({f"pool pid {pid}": pid for pid in pool_pids if not gone(pid)})
        assert not left, f"processes left running: {left}"


def prefill(dep: Deployment, decode: DecodeSide, rid: str, tokens: list[int]) -> tuple[dict, float]:
    decode.expect(rid, len(tokens))
    t0 = time.monotonic()
    status, body = dep.post("/prefill", {"request_id": rid, "token_ids": tokens, "decode_instance": 0})
    took_s = time.monotonic() - t0
    assert status == 200, (body, dep.logs())
    assert decode.wait(rid) == ["ready"] * decode.ranks_n
    return body, took_s


def evict(dep: Deployment, decode: DecodeSide, tag: str, seed: int) -> None:
    """Four 200-token prompts: 4 x 13 pages > the 40 pages, so earlier prompts leave the GPU prefix cache."""
    for i in range(4):
        prefill(dep, decode, f"{tag}-fill-{i}", prompt(200, seed + i))


def test_the_plan_carries_the_pool_address(served):
    dep, _, _, pool = served
    plan = ServePlan.read(dep.plan.path)
    assert plan.pool_address == pool.address and pool.address.startswith("mooncake://127.0.0.1:")
    assert ServePlan.from_json(plan.to_json()) == plan
    assert len(pool.pids()) == 2 and not pool.dead()                 # the master and one store service


def test_an_evicted_prefix_is_restored_from_the_mooncake_pool(served):
    dep, decode, ref, _ = served
    tokens = prompt(200, 4)
    first, _ = prefill(dep, decode, "mc-a", tokens)
    assert sources(first) == (0, 0, 200) and first["record"]["save_bytes"] == 3 * 64 * 4 * 1152
    evict(dep, decode, "mc", 100)
    body, _ = prefill(dep, decode, "mc-b", tokens)
    assert sources(body) == (0, 192, 8)                              # 3 chunks of 64 from the pool
    rec = body["record"]
    assert rec["lookup_answered"] and not rec["restore_failed"]
    assert rec["restore_bytes"] == 3 * 64 * 4 * 1152 and len(rec["restore_stage_s"]) == 2
    assert_matches_reference(decode, ref, "mc-b", tokens, body)


def test_killed_store_service_then_master_make_requests_recompute(served):
    dep, decode, ref, pool = served
    tokens = prompt(200, 5)
    prefill(dep, decode, "kill-a", tokens)
    evict(dep, decode, "kill", 300)                                  # its 3 chunks now live only in the pool

    pool.local.kill_service(0, signal.SIGKILL)
    body, took_s = prefill(dep, decode, "kill-b", tokens)
    rec = body["record"]
    assert rec["lookup_answered"] and rec["restore_failed"]          # listed, but the read failed
    assert sources(body) == (0, 0, 200) and took_s < DEAD_SERVICE_BOUND_S
    assert_matches_reference(decode, ref, "kill-b", tokens, body)

    # the master dies while a request is in flight: it ends exact or with a 5xx naming the cause
    inflight = prompt(400, 7)
    decode.expect("kill-inflight", len(inflight))
    answer: list = []
    t0 = time.monotonic()
    thread = threading.Thread(target=lambda: answer.append(dep.post(
        "/prefill", {"request_id": "kill-inflight", "token_ids": inflight, "decode_instance": 0})))
    thread.start()
    time.sleep(0.01)
    pool.local.kill_master(signal.SIGKILL)
    thread.join(DEAD_MASTER_BOUND_S)
    assert answer and time.monotonic() - t0 < DEAD_MASTER_BOUND_S, "no answer within the bound"
    status, body = answer[0]
    if status == 200:
        assert decode.wait("kill-inflight") == ["ready"] * decode.ranks_n
        assert_matches_reference(decode, ref, "kill-inflight", inflight, body)
    else:
        assert 500 <= status < 600 and body["error"], body

    fresh = prompt(200, 6)
    body, took_s = prefill(dep, decode, "kill-c", fresh)
    rec = body["record"]
    assert not rec["lookup_answered"] and not rec["restore_failed"]  # no answer: no load, all computed
    assert sources(body) == (0, 0, 200) and rec["save_bytes"] == 0
    assert took_s < DEAD_MASTER_BOUND_S
    assert_matches_reference(decode, ref, "kill-c", fresh, body)
    status, text = dep.get("/health")
    assert status == 200 and '"status": "ok"' in text                 # a lost pool is not a broken engine


def test_outside_a_private_network_namespace_nothing_starts(tmp_path, monkeypatch):
    import socket

    sc = make_plan(tmp_path, OVERRIDES).scenario_model()
    monkeypatch.setattr(socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
    for address in (None, "mooncake://127.0.0.1:1"):
        with pytest.raises(ServePoolError, match=r"serve.pool is mooncake: refusing to start: .*\(eth0\).*unshare -n"):
            start_serve_pool(sc, tmp_path, address)
    assert not (tmp_path / "pool").exists()


def test_a_pool_address_that_does_not_answer_is_one_clear_error(tmp_path):
    from kvpool.backend.pool.launcher import free_port

    require_private_netns()
    sc = make_plan(tmp_path, OVERRIDES).scenario_model()
    t0 = time.monotonic()
    with pytest.raises(ServePoolError, match="--pool-address .*no Mooncake master answers at 127.0.0.1:"):
        start_serve_pool(sc, tmp_path, f"mooncake://127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < pool_setup.ANSWER_WAIT_S + 1.0
    with pytest.raises(ServePoolError, match="--pool-address: bad pool address 'http://x:1'"):
        start_serve_pool(sc, tmp_path, "http://x:1")
    with pytest.raises(ServePoolError, match="pool.services_per_server"):
        pool_spec(make_plan(tmp_path, [*OVERRIDES, "pool.services_per_server=0"]).scenario_model())


def test_a_stage_without_a_reachable_pool_exits_with_one_error_line(tmp_path):
    import subprocess
    import sys

    from kvpool.backend.pool.launcher import free_port

    require_private_netns()
    sc = make_plan(tmp_path, OVERRIDES).scenario_model()
    dead = f"mooncake://127.0.0.1:{free_port()}"
    for address, reason in (("", "the plan names no pool_address"),
                            (dead, f"pool_address {dead}: no Mooncake master answers at 127.0.0.1:")):
        plan = build_plan(sc, tmp_path, router_port=0, pool_address=address)
        plan.write()
        out = subprocess.run([sys.executable, "-m", "kvpool.backend.serve.prefill_stage", "--plan", str(plan.path),
                              "--name", "prefill0-stage0"], capture_output=True, text=True, timeout=60)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(lines) == 1, out.stderr
        assert lines[0].startswith("error: serve.pool is mooncake") and reason in lines[0], lines[0]
