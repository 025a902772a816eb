"""Production mode end to end on the CPU: ``kvpool serve cpu-tiny`` (real processes on loopback) driven
by ``kvpool replay`` of the repository's kv-cache-tester traces and by a multi-turn session, on the
embedded pool and on a real Mooncake pool (a master and a store service started by ``kvpool serve
--pool mooncake``).

The deployment's prefill KV is 4096 tokens (``serve.prefill_kv_tokens``): three sessions of the
traces scaled by 1/64 (prompts of ~0.9K-2.6K tokens) do not fit in it together, so each request
finds the head of its session's prefix in the GPU prefix cache, loads the evicted rest from the
pool and computes the new tail: the replay's token shares GPU, pool and computed are all > 0. Its
summary has every key of ``kvpool sim run --json``'s results and no request fails. The session's
turns each send the previous prompt, its answer and new tokens; turn 2 finds turn 1 in the GPU
prefix cache, turn 3 (after prompts that evict it) in the pool; every answer equals the no-cache
recompute (``reference_generate``). After each deployment stops, no process it started is left.

The Mooncake deployment needs a private network namespace (the test fails outside one):
``unshare -n sh -c 'ip link set lo up && .venv/bin/python -m pytest tests/serve/test_serve_e2e.py'``.
"""

from __future__ import annotations

import json
import random

import pytest
from serve_process import get_text, multi_turn_session, post, require_private_netns, start_replay, start_serve

from kvpool.backend.serve.model_config import ref_config
from kvpool.scenario.load import load_scenario
from kvpool.workload.records import SUMMARY_KEYS

PREFILL_KV_TOKENS = 4096
SERVE_SETS = [f"serve.prefill_kv_tokens={PREFILL_KV_TOKENS}"]
REPLAY_SESSIONS = 3
REPLAY_DURATION_S = 6.0
#: Short outputs and idle gaps, a grace that bounds the replay's tail.
REPLAY_SETS = ("workload.max_output_tokens=16", "workload.idle_cap_s=0.5", "workload.grace_s=10")
#: The replay's bound: its warm-up (three cold prompts), the window, the last requests.
REPLAY_BOUND_S = 90.0


@pytest.fixture(scope="module", params=["embedded", "mooncake"])
def deployment(request, tmp_path_factory):
    pool = request.param
    env = require_private_netns() if pool == "mooncake" else {}
    served = start_serve(tmp_path_factory.mktemp(f"e2e-{pool}") / "run", SERVE_SETS, pool=pool, env=env)
    try:
        assert len(served.ready["pool"]) == (2 if pool == "mooncake" else 0)  # a master and a store service
        yield pool, served
    finally:
        status = served.stop()  # asserts every process of router.ready.json is gone
    assert status == 0, served.output()[-4000:]


def test_a_replay_of_real_traces_uses_every_token_source(deployment, tmp_path):
    pool, served = deployment
    doc, records, took_s = start_replay(served.url, tmp_path, sessions=REPLAY_SESSIONS, duration_s=REPLAY_DURATION_S,
                                        sets=REPLAY_SETS).finish(REPLAY_BOUND_S)
    summary = doc["results"][0]
    assert set(SUMMARY_KEYS) - {"rps"} <= set(summary), set(SUMMARY_KEYS) - set(summary)
    assert summary["sessions"] == REPLAY_SESSIONS and summary["duration_s"] == REPLAY_DURATION_S
    assert summary["errors"] == 0 == doc["run"]["errors"], [r["error"] for r in records if r["error"]]
    assert summary["requests"] >= 6 and summary["rejected"] == 0
    assert summary["share_gpu"] > 0 and summary["share_pool"] > 0 and summary["share_computed"] > 0, summary
    assert summary["share_gpu"] + summary["share_pool"] + summary["share_computed"] == pytest.approx(1.0)
    assert summary["throughput_tok_s"] > 0 and 0 < summary["ttft_p50_s"] <= summary["ttft_p90_s"]
    assert summary["restore_stage_s_p50"] > 0 and summary["bytes_moved"] > 0
    done = [r for r in records if not r["error"]]
    assert len(done) == len(records) == doc["run"]["dispatched"]
    for r in done:
        assert r["gpu_tokens"] + r["pool_tokens"] + r["computed_tokens"] == r["in_tokens"], r
        assert r["restore_failed"] is False and r["handoff_bytes"] > 0
    assert any(r["pool_tokens"] > 0 and r["restore_bytes"] > 0 for r in done)


def test_a_multi_turn_session_decodes_as_the_no_cache_recompute(deployment):
    pool, served = deployment
    records, prompts = multi_turn_session(served.url, SERVE_SETS, seed=17 if pool == "embedded" else 18,
                                          user=f"session-{pool}")  # a fresh session on each deployment
    sources = [(r["gpu_tokens"], r["pool_tokens"], r["computed_tokens"]) for r in records]
    assert sources[0] == (0, 0, 600), sources
    assert sources[1][0] >= 592 and sources[1][1] == 0, sources       # turn 1's full pages from the GPU cache
    assert sources[2][1] >= 640 and sources[2][0] == 0, sources       # turn 2's chunks from the pool
    assert [sum(s) for s in sources] == [len(p) for p in prompts]
    assert records[2]["restore_bytes"] > 0 and not records[2]["restore_failed"]


def _pool_samples(text: str) -> dict[str, list[tuple[dict, float]]]:
    from kvpool.backend.pool.metrics import parse_prometheus

    return {k: v for k, v in parse_prometheus(text).items() if k.startswith("kvpool:pool_")}


def _router_pool(url: str) -> dict[str, float]:
    """The router's pool series (one tier, no other label) by name."""
    status, text = get_text(f"{url}/metrics")
    assert status == 200
    out = {}
    for name, samples in _pool_samples(text).items():
        assert len(samples) == 1, (name, samples)
        labels, value = samples[0]
        assert labels == ({} if name == "kvpool:pool_up" else {"tier": "dram"}), (name, labels)
        out[name] = value
    return out


def test_the_pool_series_count_a_request_s_saved_chunks(deployment):
    """The router's pool capacity, use, objects and evictions: the deployment's pool (embedded: the
    stages' pools added up, each the scenario's share; Mooncake: the one pool), and a fresh prompt of
    three chunks adds three objects per stage and their bytes."""
    from kvpool.backend.serve.prefill_stage import pool_capacity_bytes
    from kvpool.policy.kvspec import KVSpec

    pool, served = deployment
    scenario = load_scenario("cpu-tiny", SERVE_SETS)
    cfg = ref_config(scenario)
    spec = KVSpec(model=scenario.model.name, layers=cfg.layers, record_bytes=cfg.record_bytes,
                  stage_layers=tuple(cfg.stage_layers), page_tokens=cfg.page_tokens)
    chunk, pp = scenario.pool.chunk_tokens, scenario.prefill.pp
    chunk_bytes = sum(spec.chunk_object_bytes(s, chunk) for s in range(pp))
    before = _router_pool(served.url)
    want_capacity = pool_capacity_bytes(scenario) * pp  # one prefill instance; Mooncake: the whole pool
    assert before["kvpool:pool_capacity_bytes"] == want_capacity, before
    assert before["kvpool:pool_up"] == 1.0
    rng = random.Random(19 if pool == "embedded" else 20)
    status, body = post(served.url, {"prompt": [rng.randrange(scenario.serve.vocab) for _ in range(3 * chunk + 1)],
                                     "max_tokens": 1})
    assert status == 200 and body["kvpool"]["record"]["save_bytes"] == 3 * chunk_bytes, body
    after = _router_pool(served.url)
    assert after["kvpool:pool_objects"] - before["kvpool:pool_objects"] == 3 * pp, (before, after)
    assert after["kvpool:pool_used_bytes"] - before["kvpool:pool_used_bytes"] >= 3 * chunk_bytes, (before, after)
    assert after["kvpool:pool_used_bytes"] <= after["kvpool:pool_capacity_bytes"]
    assert after["kvpool:pool_evicted_objects_total"] >= before["kvpool:pool_evicted_objects_total"]
    assert get_text(f"{served.url}/health")[1].count('"pool": "up"') == 1

    # the prefill engine's series are per stage; the router's add them up (embedded) or are the one pool's
    engine = json.loads((served.run_dir / "prefill0.ready.json").read_text())["url"]
    status, text = get_text(f"{engine}/metrics")
    per_stage = _pool_samples(text)
    assert status == 200 and sorted(lab["stage"] for lab, _ in per_stage["kvpool:pool_up"]) == ["0", "1"]
    caps = [v for _, v in per_stage["kvpool:pool_capacity_bytes"]]
    objects = [v for _, v in per_stage["kvpool:pool_objects"]]
    if pool == "embedded":
        assert caps == [pool_capacity_bytes(scenario)] * pp and sum(objects) == after["kvpool:pool_objects"]
    else:
        assert caps == [want_capacity] * pp and max(objects) == after["kvpool:pool_objects"]
