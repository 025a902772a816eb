"""Real kv-cache-tester traces: the reference's published statistics of its 178-trace subset.

Needs the full corpus (tests/workload/trace_builders.py: ``CORPUS_KV_TRACES``). The subset (the
reference agentx-traces.md §5.2): the 17 traces with subagents plus the 161
without subagents that are smaller than 100 KB uncompressed (gzip's size trailer says it).
"""

from __future__ import annotations

import shutil
import struct

import pytest
from trace_builders import CORPUS_KV_TRACES, needs_corpus

from kvpool.workload import load_workload, workload_stats
from kvpool.workload.replay import AgentXReplay, run_fixed_latency

WITH_SUBAGENTS = {
    "0003": 2, "0004": 2, "0010": 4, "0014": 1, "0017": 1, "0020": 1, "0254": 5, "0256": 12, "0267": 6,
    "0270": 3, "0274": 3, "0276": 4, "0277": 4, "0279": 2, "0282": 3, "0291": 2, "0295": 8,
}  # fmt: skip


pytestmark = needs_corpus(CORPUS_KV_TRACES)


@pytest.fixture(scope="module")
def subset(tmp_path_factory):
    d = tmp_path_factory.mktemp("subset178")
    for f in sorted(CORPUS_KV_TRACES.glob("trace_*.json.gz")):
        tid = f.name[6:10]
        size = struct.unpack("<I", f.read_bytes()[-4:])[0]
        if tid in WITH_SUBAGENTS or size < 100_000:
            shutil.copy(f, d / f.name)
    return load_workload(d)


@pytest.fixture(scope="module")
def stats(subset):
    return workload_stats(subset)


def test_subset_counts(subset, stats):
    assert stats["traces"] == 178
    assert (stats["requests"], stats["main_requests"], stats["subagent_requests"]) == (5662, 4986, 676)
    assert (stats["subagent_groups"], stats["sessions_with_subagents"]) == (63, 17)
    groups = {s.id[6:]: len(s.threads) - 1 for s in subset if len(s.threads) > 1}
    assert groups == WITH_SUBAGENTS


def test_subset_published_distributions(stats):
    assert stats["input_tokens_all_p50"] == pytest.approx(77_501, abs=1)
    assert stats["input_tokens_main_p50"] == pytest.approx(86_920.5, abs=0.5)
    assert stats["input_tokens_sub_p50"] == pytest.approx(45_136.5, abs=0.5)
    assert stats["input_tokens_max"] == 320_572
    assert stats["output_tokens_main_p50"] == 261
    assert stats["new_tokens_p50"] == pytest.approx(1_020.5, abs=0.5)
    assert stats["main_turns_per_session_p50"] == 10
    assert stats["reuse_ceiling"] == pytest.approx(0.931, abs=0.0005)
    assert stats["overlap_prev_main"] == pytest.approx(0.959, abs=0.0005)
    assert stats["pause_p50_s"] == pytest.approx(11.4, abs=0.05)
    assert stats["pause_over_300s_fraction"] == pytest.approx(0.063, abs=0.0005)
    assert stats["peak_context_p50"] == pytest.approx(82_560, abs=1)
    assert stats["api_time_p50_s"] == pytest.approx(6.77, abs=0.005)


def test_real_subagents_spawn_before_and_join_after(subset):
    s = subset.by_id("trace_0256")
    for th in s.threads[1:]:
        first = s.requests[th.requests[0]]
        assert [d.kind for d in first.deps] == ["spawn"]
        assert s.requests[th.spawn_request].thread == th.parent
        if th.join_request is not None:
            last = s.requests[th.requests[-1]]
            assert s.requests[th.join_request].t_s >= last.t_s
            assert any(d.kind == "join" and d.request == last.index for d in s.requests[th.join_request].deps)


def test_agentx_replay_over_real_traces_keeps_lanes_busy(subset):
    r = AgentXReplay(subset, lanes=8, seed=42, duration_s=1800.0, warmup_requests=3)
    log = run_fixed_latency(r, lambda d: 2.0 + d.in_tokens / 50_000)
    measured = [x for x in log if x.dispatch.measured]
    assert r.profile_start_s is not None and len(measured) > 100
    assert all(x.start_s < r.profile_start_s + 1800.0 for x in measured)
    assert sum(x.dispatch.phase == "primer" for x in log) >= 8
    assert len({x.dispatch.lane for x in measured}) == 8
