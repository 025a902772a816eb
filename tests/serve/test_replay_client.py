"""The replay client against a stand-in server: the workload layer's schedule, the prompts it
sends, the records it keeps, failures counted while the replay goes on, and a clean stop."""

from __future__ import annotations

import asyncio
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from kvpool.backend.serve.prompts import PromptBuilder
from kvpool.backend.serve.replay_client import ReplayError, check_server, merge_server_record, run_replay
from kvpool.workload.load import load_workload
from kvpool.workload.records import RequestRecord
from kvpool.workload.replay import AgentXReplay, run_fixed_latency

sys.path.insert(0, str(Path(__file__).parent))
from replay_standin import StandIn, serving  # noqa: E402

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces" / "kv-cache-tester"
SCALE = 1 / 64


@pytest.fixture(scope="module")
def workload():
    # two plain sessions and one with subagents (spawn and join)
    return [s for f in ("trace_0002.json.gz", "trace_0014.json.gz", "trace_0007.json.gz")
            for s in load_workload(TRACES / f)]


def _replay(workload, **kw):
    args = dict(lanes=3, seed=11, idle_cap_s=0.005, warmup_requests=2, start_fraction_min=0.0, start_fraction_max=0.1,
                recycle=False)
    args.update(kw)
    return AgentXReplay(workload, **args)


def _run(replay, url, **kw):
    async def go():
        model = await check_server(url)
        return await run_replay(replay, url=url, model=model, prompts=PromptBuilder(512, SCALE), request_timeout_s=5.0, **kw)

    return asyncio.run(go())


def _by_thread(dispatches):
    """Each (lane, play, thread)'s requests in order, with what the schedule decided for them."""
    out = defaultdict(list)
    for d in sorted(dispatches, key=lambda d: d.key):
        out[(d.lane, d.play, d.session.id, d.request.thread)].append((d.request.index, d.phase, d.out_tokens, d.scope))
    return dict(out)


@pytest.fixture(scope="module")
def replayed(workload):
    """One replay against a well-behaved stand-in: (result, stand-in)."""
    standin = StandIn(delay_s=0.002)
    with serving(standin) as url:
        result = _run(_replay(workload), url)
    return result, standin


def test_the_schedule_is_the_workload_layers(workload, replayed):
    expected = [s.dispatch for s in run_fixed_latency(_replay(workload), lambda d: 0.02)]
    result, standin = replayed
    got = [o.dispatch for o in result.outcomes]
    assert not result.interrupted and result.errors == 0 and result.cancelled == 0
    assert len(got) == len(expected) > 30
    assert _by_thread(got) == _by_thread(expected)
    assert sum(1 for d in got if d.request.thread > 0) > 0  # subagents were spawned and joined
    assert {d.phase for d in got} >= {"warmup", "profile"}
    # what went over the wire: the builder's prompt, the scheduled output, streamed, EOS ignored
    assert standin.problems == []
    builder = PromptBuilder(512, SCALE)
    sent = {h["x-request-id"]: body for body, h in standin.requests}
    for d in got:
        body = sent[f"replay-{d.key}"]
        assert body["prompt"] == builder.prompt(d)
        assert body["max_tokens"] == d.out_tokens
        assert body["model"] == "standin"


def test_records_take_the_clients_clock_and_the_servers_sources(replayed):
    result, _ = replayed
    recs = result.records
    for o, r in zip(result.outcomes, recs):
        d = o.dispatch
        assert r.key == d.key and r.session == d.session.id and r.thread == d.request.thread
        assert r.measured == d.measured and r.out_tokens == d.out_tokens
        assert r.in_tokens == PromptBuilder(512, SCALE).prompt_tokens(d)
        assert 0 < r.arrival_s < r.first_token_s <= r.end_s < result.wall_s + 1
        assert r.gpu_tokens + r.computed_tokens == r.in_tokens  # the stand-in's sources
        assert r.handoff_writes == 3 and r.save_bytes == 1152 * r.in_tokens
        # the server's prefill times moved onto the client's clock (server arrival 100.0)
        assert r.prefill_start_s == pytest.approx(r.arrival_s + 0.5)
    assert sum(r.gpu_tokens for r in recs) > 0 and sum(r.computed_tokens for r in recs) > 0


def test_merge_keeps_well_typed_server_fields_only():
    rec = RequestRecord(5, arrival_s=2.0, in_tokens=10)
    merge_server_record(rec, {"gpu_tokens": 7, "pool_tokens": True, "computed_tokens": "3", "restore_stage_s": [0.1, 1],
                              "restore_bytes": 2.5, "handoff_bytes": 10**3, "save_bytes": None,
                              "restore_spread_s": float("nan"), "in_tokens": 99, "end_s": 50.0, "key": "x",
                              "rejected": "gate", "arrival_s": 1.0, "prefill_end_s": 1.5})
    assert (rec.gpu_tokens, rec.pool_tokens, rec.computed_tokens) == (7, 0, 0)
    assert rec.restore_stage_s == [0.1, 1.0] and rec.restore_spread_s == 0.0
    assert (rec.restore_bytes, rec.handoff_bytes, rec.save_bytes) == (0, 1000, 0)
    merge_server_record(rec, {"restore_stage_s": [0.2, float("inf")]})
    assert rec.restore_stage_s == [0.1, 1.0]
    # counts and times a server cannot have measured: negative ones (an instance may be -1: none)
    merge_server_record(rec, {"gpu_tokens": -5, "handoff_bytes": -1, "restore_spread_s": -0.5, "restore_stage_s": [-1.0],
                              "handoff_s": float("inf"), "prefill": -1, "decode": -2})
    assert (rec.gpu_tokens, rec.handoff_bytes, rec.restore_spread_s, rec.restore_stage_s) == (7, 1000, 0.0, [0.1, 1.0])
    assert (rec.prefill, rec.decode, rec.handoff_s) == (-1, RequestRecord(0).decode, 0.0)
    assert (rec.key, rec.in_tokens, rec.end_s, rec.rejected) == (5, 10, 0.0, "gate")
    assert rec.prefill_end_s == pytest.approx(2.5)


def test_failures_are_counted_and_the_replay_goes_on(workload):
    faults = {3: "http500", 7: "break", 11: "hang", 15: "reject", 19: "nodone", 23: "event_error", 27: "bad_usage"}
    standin = StandIn(delay_s=0.002, fault=faults.get, hang_s=5.0)
    replay = _replay(workload)
    with serving(standin) as url:
        result = asyncio.run(run_replay(replay, url=url, prompts=PromptBuilder(512, SCALE), request_timeout_s=1.5))
    expected = [s.dispatch for s in run_fixed_latency(_replay(workload), lambda d: 0.02)]
    assert len(result.outcomes) == len(expected)  # every request was still dispatched
    assert result.errors == 6 and not result.interrupted
    errors = {o.error.split(":")[0] for o in result.outcomes if o.failed}
    assert errors == {"HTTP 500", "stream broken", "timed out after 1.5 s", "stream ended before [DONE]", "stream error",
                      "bad answer"}
    bad = next(o.error for o in result.outcomes if o.error.startswith("bad answer"))
    assert "usage.completion_tokens" in bad and "max_tokens" in bad
    failed = [o.record for o in result.outcomes if o.failed]
    assert all(r.end_s == 0.0 for r in failed)
    rejected = [o.record for o in result.outcomes if o.record.rejected]
    assert len(rejected) == 1 and rejected[0].rejected == "input cap"
    assert "HTTP 500: decode instance 0 died" in next(o.error for o in result.outcomes if o.error.startswith("HTTP"))


def test_a_stop_cancels_what_runs_and_keeps_what_finished(workload):
    standin = StandIn(delay_s=0.3)

    async def go(url):
        stop = asyncio.Event()
        task = asyncio.create_task(run_replay(_replay(workload), url=url, prompts=PromptBuilder(512, SCALE),
                                              request_timeout_s=5.0, stop=stop))
        await asyncio.sleep(1.0)
        stop.set()
        return await asyncio.wait_for(task, 5.0)

    with serving(standin) as url:
        result = asyncio.run(go(url))
    assert result.interrupted
    done = [o for o in result.outcomes if not o.error]
    cancelled = [o for o in result.outcomes if o.cancelled]
    assert done and cancelled and result.errors == 0
    assert all(o.error == "cancelled: interrupted" and o.record.end_s == 0.0 for o in cancelled)


def test_no_server_is_a_replay_error():
    with serving(StandIn()) as url:
        pass  # stopped: nothing listens there now
    with pytest.raises(ReplayError, match="cannot reach"):
        asyncio.run(check_server(url, timeout_s=2.0))
