"""The normalized model: spawn, join, background subagents, gaps, time order, block ids."""

from __future__ import annotations

import numpy as np
from trace_builders import req, spawn_join_trace, sub, trace

from kvpool.workload.weka import session_from_weka, session_to_weka


def _by_source(s):
    return {r.source: r for r in s.requests}


def test_spawn_is_anchored_on_the_preceding_parent_turn():
    s = session_from_weka(spawn_join_trace())
    r = _by_source(s)
    first_inner = r["requests[2].requests[0]"]
    (dep,) = first_inner.deps
    assert dep.kind == "spawn" and dep.request == r["requests[1]"].index
    assert dep.gap_s == 0.5  # spawn at 12.5 s, anchor ended at 10 + 2 s


def test_join_gates_the_first_parent_turn_at_or_after_the_subagent_end():
    s = session_from_weka(spawn_join_trace())
    r = _by_source(s)
    deps = {d.kind: d for d in r["requests[3]"].deps}
    assert deps["join"].request == r["requests[2].requests[1]"].index
    assert deps["join"].gap_s == 20.0 - (15.5 + 1.0)
    assert deps["prev"].gap_s == 20.0 - 12.0
    assert s.threads[1].join_request == r["requests[3]"].index


def test_subagent_without_a_later_parent_turn_after_its_end_runs_in_background():
    s = session_from_weka(spawn_join_trace())
    bg = s.threads[2]
    assert bg.background and not s.threads[1].background
    assert all(d.kind != "join" for d in s.requests[_by_source(s)["requests[5]"].index].deps)


def test_inner_times_relative_or_absolute_are_detected():
    rel = session_from_weka(spawn_join_trace())
    doc = spawn_join_trace()
    for q in doc["requests"][2]["requests"]:
        q["t"] += 12.5
    for q in doc["requests"][4]["requests"]:
        q["t"] += 23.0
    ab = session_from_weka(doc)
    assert [r.t_s for r in rel.requests] == [r.t_s for r in ab.requests]
    assert [r.t_s for r in rel.requests] == sorted(r.t_s for r in rel.requests)


def test_subagent_with_no_preceding_parent_turn_is_dropped():
    s = session_from_weka(trace("d", [sub(0.0, [req(0.0, 64, [7])]), req(1.0, 64, [1])]))
    assert len(s.threads) == 1 and s.dropped_subagents == 1


def test_block_ids_roundtrip_through_the_compact_store_and_keyframes():
    rng = np.random.default_rng(1)
    reqs, ids, nxt = [], [], 1000
    for k in range(150):  # > 2 keyframes; some turns rewrite history (only a prefix matches)
        if k % 37 == 36:
            ids = ids[: len(ids) // 3]
        grow = int(rng.integers(1, 5))
        ids = ids + list(range(nxt, nxt + grow))
        nxt += grow
        reqs.append(req(float(k), 64 * len(ids), list(ids)))
    s = session_from_weka(trace("k", reqs))
    for i, r in enumerate(reqs):
        assert s.block_ids(i).tolist() == r["hash_ids"]
    assert s.blocks.nbytes() < 8 * sum(len(r["hash_ids"]) for r in reqs) / 4
    # with other requests' lists at hand (any subset), the walk stops there: the same lists
    for keep in (range(0, 150, 2), range(0, 150, 7), range(150)):
        known = {i: s.block_ids(i) for i in keep}
        for i, r in enumerate(reqs):
            assert s.blocks.block_ids(i, known).tolist() == r["hash_ids"]


def test_weka_writer_roundtrips_deps_and_ids():
    s = session_from_weka(spawn_join_trace())
    s2 = session_from_weka(session_to_weka(s))
    assert [(r.t_s, r.in_tokens, r.deps) for r in s.requests] == [(r.t_s, r.in_tokens, r.deps) for r in s2.requests]
    assert all(np.array_equal(s.block_ids(i), s2.block_ids(i)) for i in range(len(s.requests)))


def test_workload_layer_imports_nothing_of_the_simulator():
    """The simulator and production mode's replay client share the workload layer: every module
    but the preset fitting imports without SimPy, scipy, torch or any of ``kvpool.sim``."""
    import pkgutil
    import subprocess
    import sys

    import kvpool.workload

    names = sorted(m.name for m in pkgutil.iter_modules(kvpool.workload.__path__, "kvpool.workload."))
    assert "kvpool.workload.replay" in names and "kvpool.workload.synth" in names
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('simpy', 'scipy', 'torch') or name.startswith('kvpool.sim'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"import {', '.join(n for n in names if n != 'kvpool.workload.fit')}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
