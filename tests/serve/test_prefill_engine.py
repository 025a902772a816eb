"""The prefill engine and its stages as real processes (cpu-tiny plan), handing KV to decode ranks
in this process: the landed KV and the first token equal a single-process ``RefModel.prefill``; a
shared prefix hits the GPU prefix cache; an evicted prefix is restored from the pool; requests
that arrive together share chunked-prefill steps; bad requests get a 4xx with a JSON reason."""

from __future__ import annotations

import re
import threading
import time

import pytest

from prefill_testing import assert_matches_reference, prefill, prompt, running, sources
from raw_http import MALFORMED, error_answers

#: 40 pages of prefill KV (so a few prompts evict the GPU prefix cache), 128-token steps.
OVERRIDES = ["serve.prefill_kv_tokens=640", "prefill.max_batched_tokens=128"]
KV_TOKENS = 640


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with running(tmp_path_factory.mktemp("prefill"), OVERRIDES) as deployed:
        yield deployed


def test_first_prefill_equals_the_single_process_reference(served):
    dep, decode, ref = served
    tokens = prompt(200, 1)
    body = prefill(dep, decode, "ref-1", tokens)
    assert_matches_reference(decode, ref, "ref-1", tokens, body)
    assert body["descriptor"] == {"decode_instance": 0, "stages": 2}
    rec = body["record"]
    assert rec["key"] == "ref-1" and rec["in_tokens"] == 200 and sum(sources(body)) == 200
    assert rec["handoff_bytes"] == 200 * 4 * 1152            # every token of every layer crosses once
    assert rec["save_bytes"] == 3 * 64 * 4 * 1152            # its 3 full 64-token chunks, both stages
    assert 0 <= rec["prefill_start_s"] <= rec["prefill_end_s"]
    assert rec["handoff_s"] > 0 and rec["save_s"] > 0         # each its own time; the answer waited for both


def test_a_shared_prefix_hits_the_gpu_prefix_cache(served):
    dep, decode, ref = served
    base = prompt(200, 2)
    prefill(dep, decode, "share-a", base)
    tokens = prompt(230, 3, prefix=base[:160])
    body = prefill(dep, decode, "share-b", tokens)
    assert sources(body) == (160, 0, 70)                      # the 10 shared pages; the rest computed
    assert_matches_reference(decode, ref, "share-b", tokens, body)


def test_an_evicted_prefix_is_restored_from_the_pool(served):
    dep, decode, ref = served
    tokens = prompt(200, 4)
    first = prefill(dep, decode, "evict-a", tokens)
    assert sources(first)[0] == 0
    for i in range(4):                                        # 4 x 13 pages > the 40 pages: evicts it
        prefill(dep, decode, f"evict-fill-{i}", prompt(200, 100 + i))
    _, before = time_accounts(dep)
    body = prefill(dep, decode, "evict-b", tokens)
    _, after = time_accounts(dep)
    gpu, pool, computed = sources(body)
    assert gpu == 0 and pool == 192 and computed == 8          # 3 chunks of 64 from the pool
    # while its chunks load, the engine holds nothing it could compute
    spent = {name: after[name] - before[name] for name in after}
    assert spent["loading_only"] > 0 and spent["computable"] > 0
    assert spent["loading_only"] + spent["computable"] == pytest.approx(spent["pending"], rel=1e-9)
    rec = body["record"]
    assert rec["restore_bytes"] == 3 * 64 * 4 * 1152 and len(rec["restore_stage_s"]) == 2
    assert rec["save_bytes"] == 0 and rec["save_s"] == 0       # the pool holds every full chunk already
    assert_matches_reference(decode, ref, "evict-b", tokens, body)
    status, text = dep.get("/metrics")
    assert status == 200
    pool_total = float(re.search(r'^kvpool:prompt_tokens_by_source_total\{source="pool"\} (\S+)$', text, re.M).group(1))
    assert pool_total >= 192


def test_requests_that_arrive_together_share_steps(served):
    dep, decode, ref = served
    prompts = {f"batch-{i}": prompt(150, 200 + i) for i in range(4)}
    for rid, tokens in prompts.items():
        decode.expect(rid, len(tokens))
    answers: dict[str, tuple[int, dict]] = {}

    def post(rid: str) -> None:
        answers[rid] = dep.post("/prefill", {"request_id": rid, "token_ids": prompts[rid], "decode_instance": 0})

    threads = [threading.Thread(target=post, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for rid, tokens in prompts.items():
        status, body = answers[rid]
        assert status == 200, body
        assert decode.wait(rid) == ["ready"] * decode.ranks_n
        assert_matches_reference(decode, ref, rid, tokens, body)
    _, text = dep.get("/metrics")
    alone = float(re.search(r'^kvpool:prefill_step_requests_bucket\{le="1.0"\} (\S+)$', text, re.M).group(1))
    steps = float(re.search(r"^kvpool:prefill_step_requests_count (\S+)$", text, re.M).group(1))
    assert steps > alone, "no step packed chunks of two requests"


def test_bad_requests_get_a_4xx_with_a_json_reason(served):
    dep, _, _ = served
    ok = {"request_id": "bad", "token_ids": [1, 2, 3], "decode_instance": 0}
    cases = [
        (b"{not json", 400, "not JSON"),
        ({**ok, "extra": 1}, 400, "unknown field(s) extra"),
        ({**ok, "token_ids": [1, "a"]}, 400, "token_ids[1]"),
        ({**ok, "token_ids": [1, 512]}, 400, "token_ids[1]"),
        ({**ok, "token_ids": []}, 400, "token_ids"),
        ({**ok, "decode_instance": 3}, 400, "decode_instance"),
        ({**ok, "token_ids": [1] * (KV_TOKENS + 1)}, 413, "serve.prefill_kv_tokens"),
    ]
    for body, status, reason in cases:
        got, answer = dep.post("/prefill", body)
        assert got == status and reason in answer["error"], (body if isinstance(body, bytes) else list(body), answer)
    status, text = dep.get("/health")
    assert status == 200 and '"status": "ok"' in text


def test_malformed_http_is_a_4xx_with_a_json_error(served):
    """What aiohttp refuses before any route (a request line, a header, framing) or a path the
    engine does not serve: a 4xx ``{"error": reason}``, and the engine serves on."""
    dep, _, _ = served
    for what, data in MALFORMED.items():
        for status, err in error_answers(dep.url, data):
            assert 400 <= status < 500 and isinstance(err, str) and err and "\n" not in err, (what, status, err)
    status, text = dep.get("/health")
    assert status == 200 and '"status": "ok"' in text


def test_metrics_name_every_source_and_the_denominator(served):
    dep, _, _ = served
    status, text = dep.get("/metrics")
    assert status == 200
    for name in ('kvpool:prompt_tokens_by_source_total{source="gpu"}', 'kvpool:prompt_tokens_by_source_total{source="pool"}',
                 'kvpool:prompt_tokens_by_source_total{source="computed"}', "kvpool:prompt_tokens_total",
                 "kvpool:restore_bytes_total", "kvpool:restore_seconds_count", "kvpool:save_bytes_total", "kvpool:save_seconds_count",
                 "kvpool:handoff_bytes_total", "kvpool:handoff_seconds_count", "kvpool:prefill_kv_usage_perc"):
        assert name in text, name
    sums = {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^kvpool:prompt_tokens_by_source_total\{source="(\w+)"\} (\S+)$', text, re.M)}
    total = float(re.search(r"^kvpool:prompt_tokens_total (\S+)$", text, re.M).group(1))
    assert total > 0 and sum(sums.values()) == total


def time_accounts(dep) -> tuple[dict[int, float], dict[str, float]]:
    """The engine's per-stage forward seconds and its other time accounts (pending, computable,
    loading only, steps in flight), from ``GET /metrics``."""
    _, text = dep.get("/metrics")
    accounts = {name: float(re.search(rf"^kvpool:prefill_{name}_seconds (\S+)$", text, re.M).group(1))
                for name in ("pending", "computable", "loading_only", "steps_in_flight")}
    return stage_accounts(text, "forward"), accounts


def stage_accounts(text: str, name: str) -> dict[int, float]:
    """``kvpool:prefill_stage_NAME_seconds`` by stage, from the metrics ``text``."""
    return {int(m.group(1)): float(m.group(2)) for m in
            re.finditer(rf'^kvpool:prefill_stage_{name}_seconds\{{stage="(\d+)"\}} (\S+)$', text, re.M)}


def test_each_stage_forward_pass_lies_inside_the_time_the_engine_held_work(served):
    dep, decode, _ = served
    forward_before, before = time_accounts(dep)
    t0 = time.monotonic()
    prefill(dep, decode, "timed-1", prompt(300, 40))   # three 128-token steps through two stages
    elapsed_s = time.monotonic() - t0
    forward_after, after = time_accounts(dep)
    spent = {name: after[name] - before[name] for name in after}
    assert sorted(forward_after) == [0, 1]
    for stage, f in forward_after.items():
        assert 0 < f - forward_before[stage] <= spent["pending"], (stage, forward_before, forward_after, spent)
    assert spent["pending"] <= elapsed_s
    # a step is in the pipeline for the whole compute (at most two: one per stage)
    assert 0 < spent["steps_in_flight"] <= 2 * spent["pending"]
    # a fresh prompt admitted at once neither loads nor waits for pages: computable all along
    assert spent["loading_only"] == 0
    assert spent["computable"] == pytest.approx(spent["pending"], rel=1e-9)


def test_each_compute_call_splits_into_the_layers_the_waits_and_the_hop(served):
    dep, decode, _ = served
    names = ("forward", "queued", "handled", "round_trip")
    before = {n: stage_accounts(dep.get("/metrics")[1], n) for n in names}
    prefill(dep, decode, "timed-2", prompt(300, 41))   # three 128-token steps through two stages
    text = dep.get("/metrics")[1]
    spent = {n: {s: v - before[n][s] for s, v in stage_accounts(text, n).items()} for n in names}
    for stage in (0, 1):
        forward, queued, handled, trip = (spent[n][stage] for n in names)
        # the layers and the wait lie inside the stage's handling, which lies inside the round trip
        assert forward > 0 and queued >= 0 and forward + queued <= handled < trip, (stage, spent)
