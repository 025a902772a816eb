"""One per-request record type in both worlds: a record the simulator's lifecycle filled and one
the store connector filled are the same type, go through the same ``summarize``, and the
connector's Prometheus export counts the same token fields of both."""

from __future__ import annotations

import pytest

from kvpool.backend.connector_metrics import ConnectorMetrics
from kvpool.backend.pool import EmbeddedPool
from kvpool.sim.fingerprint import simulate
from kvpool.workload.records import RequestRecord, summarize

from connector_testing import CHUNK, Engine, prompt
from test_connector_restore import sample

pytestmark = pytest.mark.timeout(120)

TOKENS = prompt(4 * CHUNK + 30, seed=11)
TOKEN_FIELDS = ("gpu_tokens", "pool_tokens", "ssd_tokens", "computed_tokens")


def _connector_record() -> RequestRecord:
    """A request the connector served from the pool, its timing filled as a replay client would."""
    e = Engine(EmbeddedPool(64 << 20), "records")
    try:
        e.serve("first", TOKENS)
        rec = e.serve("second", TOKENS).metrics
    finally:
        e.close()
    rec.arrival_s, rec.first_token_s, rec.end_s, rec.out_tokens = 1.0, 1.5, 3.5, 41
    return rec


def _simulated_records() -> list[RequestRecord]:
    _, records, _ = simulate("1p1d-56")
    return [r for r in records if r.pool_tokens and r.measured and not r.rejected and r.end_s > 0][:20]


def test_one_record_from_each_world_goes_through_the_same_metrics() -> None:
    real = _connector_record()
    simulated = _simulated_records()
    assert type(real) is RequestRecord and all(type(r) is RequestRecord for r in simulated)
    assert real.key == "second" and real.in_tokens == len(TOKENS) and real.lookup_answered
    assert (real.gpu_tokens, real.pool_tokens, real.computed_tokens) == (0, 4 * CHUNK, 30)
    assert len(simulated) == 20 and all(r.lookup_answered for r in simulated)

    # the connector's record alone: the metrics of docs/metrics.md from its fields
    m = summarize([real], gpus=2)
    assert m["requests"] == 1 and m["prompt_tokens"] == len(TOKENS) and m["output_tokens"] == 41
    assert m["share_pool"] == 4 * CHUNK / len(TOKENS) and m["share_computed"] == 30 / len(TOKENS)
    assert m["ttft_p50_s"] == 0.5 and m["throughput_tok_s"] == (len(TOKENS) + 41) / 2.5
    assert m["gen_speed_per_user_tok_s_p50"] == 41 / 2.0
    assert m["bytes_moved"] == real.restore_bytes + real.save_bytes > 0
    assert m["restore_stage_s_p50"] > 0 and m["restore_spread_s_mean"] == real.restore_spread_s

    # both worlds' records in one run summary, and in one Prometheus export
    both = simulated + [real]
    m = summarize(both, gpus=2)
    prompt_tokens = sum(r.in_tokens for r in both)
    assert m["requests"] == 21 and m["prompt_tokens"] == prompt_tokens
    assert m["share_pool"] == sum(r.pool_tokens + r.ssd_tokens for r in both) / prompt_tokens
    assert m["share_gpu"] == sum(r.gpu_tokens for r in both) / prompt_tokens
    export = ConnectorMetrics()
    for r in both:
        export.observe(r)
    text = export.text()
    for name in TOKEN_FIELDS:
        assert sample(text, f"kvpool_connector_{name}_total") == sum(getattr(r, name) for r in both)
    assert sample(text, "kvpool_connector_requests_total", outcome="loaded") == 21
    assert sample(text, "kvpool_connector_restore_bytes_total") == sum(r.restore_bytes for r in both)
    assert sample(text, "kvpool_connector_save_bytes_total") == sum(r.save_bytes for r in both)
    assert sum(getattr(r, name) for r in both for name in TOKEN_FIELDS) == prompt_tokens
