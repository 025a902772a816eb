"""Replay schedules: exact timelines on hand-made traces, warm-up, caps, lanes, determinism."""

from __future__ import annotations

import pytest
from trace_builders import req, spawn_join_trace, sub, trace

from kvpool.workload import Workload
from kvpool.workload.replay import AgentXReplay, ProductionReplay, run_fixed_latency
from kvpool.workload.weka import session_from_weka


def _wl(*docs) -> Workload:
    return Workload(tuple(session_from_weka(d) for d in docs))


def _timeline(log):
    return [(x.dispatch.request.source, x.start_s, x.dispatch.phase) for x in log]


def _plain(w, **kw) -> AgentXReplay:
    kw.setdefault("warmup", False)
    kw.setdefault("recycle", False)
    return AgentXReplay(w, lanes=1, seed=0, **kw)


def test_end_to_start_pacing_spawn_and_join_gating():
    w = _wl(spawn_join_trace())
    lat = lambda d: 5.0 if d.request.thread == 1 else 1.0  # noqa: E731  the first subagent is slow live
    log = run_fixed_latency(_plain(w, idle_cap_s=None), lat)
    assert _timeline(log) == [
        ("requests[0]", 0.0, "profile"),
        ("requests[1]", 9.0, "profile"),  # 1 s live + recorded gap 10 - (0 + 2)
        ("requests[2].requests[0]", 10.5, "profile"),  # spawn: anchor end + 0.5 s
        ("requests[2].requests[1]", 17.5, "profile"),  # 15.5 + recorded 2 s gap
        ("requests[3]", 26.0, "profile"),  # join: subagent end 22.5 + 3.5 s gap (prev alone: 18)
        ("requests[4].requests[0]", 28.0, "profile"),  # background subagent: anchor end 27 + 1 s
        ("requests[5]", 35.0, "profile"),  # 27 + gap 8, without waiting for the background one
    ]


def test_tree_idle_cap_shortens_long_pauses_only_when_nothing_is_in_flight():
    w = _wl(trace("p", [req(0.0, 64, api=1.0), req(1000.0, 128, api=1.0), req(1002.0, 192)]))
    capped = run_fixed_latency(_plain(w, idle_cap_s=300.0), lambda d: 1.0)
    free = run_fixed_latency(_plain(w, idle_cap_s=None), lambda d: 1.0)
    assert [x.start_s for x in capped] == [0.0, 301.0, 303.0]
    assert [x.start_s for x in free] == [0.0, 1000.0, 1002.0]


def test_background_subagent_in_flight_delays_the_idle_cap():
    doc = trace(
        "bg",
        [
            req(0.0, 64, [1], api=1.0),
            sub(1.0, [req(0.0, 64, [9], api=1.0)], duration_ms=5_000_000),
            req(1000.0, 128, [1, 2], api=1.0),
        ],
    )
    w = _wl(doc)
    lat = lambda d: 500.0 if d.request.thread == 1 else 1.0  # noqa: E731
    log = run_fixed_latency(_plain(w, idle_cap_s=300.0), lat)
    starts = {x.dispatch.request.source: x.start_s for x in log}
    # tree busy until the subagent ends at 501 s; then the 999 s pause is capped: 501 + 300
    assert starts["requests[2]"] == 801.0


def test_system_idle_cap_moves_every_timer():
    w = _wl(trace("p", [req(0.0, 64, api=1.0), req(100.0, 128, api=1.0)]))
    log = run_fixed_latency(_plain(w, idle_cap_s=None, system_idle_cap_s=10.0), lambda d: 1.0)
    assert [x.start_s for x in log] == [0.0, 11.0]


def _ten_turns(tid="w"):
    return trace(tid, [req(10.0 * k, 64 * (k + 1), api=1.0) for k in range(10)])


def test_warmup_primer_extra_requests_and_barrier():
    w = _wl(_ten_turns())
    r = AgentXReplay(w, lanes=1, seed=0, warmup_requests=2, start_fraction_min=0.5, start_fraction_max=0.5, recycle=False)
    log = run_fixed_latency(r, lambda d: 1.0)
    tl = _timeline(log)
    # t* = 0.5 * 91 s = 45.5 s -> first profiling-side request is t=50 (index 5); primer = index 4
    assert tl[:4] == [
        ("requests[4]", 0.0, "primer"),
        ("requests[5]", 1.0, "warmup"),
        ("requests[6]", 2.0, "warmup"),
        ("requests[7]", 3.0, "profile"),  # barrier at 3 s: earliest pending starts at once
    ]
    assert tl[4] == ("requests[8]", 13.0, "profile")  # then recorded gaps (10 - 1 s)
    assert [x.dispatch.out_tokens for x in log[:3]] == [1, 1, 1]
    assert r.profile_start_s == 3.0
    assert not any(x.dispatch.measured for x in log[:3]) and all(x.dispatch.measured for x in log[3:])


def test_barrier_keeps_relative_offsets_across_lanes():
    a = trace("a", [req(0.0, 64, api=1.0), req(10.0, 128, api=1.0), req(40.0, 192, api=1.0), req(50.0, 256)])
    b = trace("b", [req(0.0, 64, api=1.0), req(10.0, 128, api=1.0), req(15.0, 192, api=1.0), req(60.0, 256)])
    r = AgentXReplay(_wl(a, b), lanes=2, seed=0, warmup_requests=0, start_fraction_min=0.2, start_fraction_max=0.2, recycle=False)
    log = run_fixed_latency(r, lambda d: 1.0)
    starts = {(x.dispatch.session.id, x.dispatch.request.source): x.start_s for x in log}
    # both primers (index 1) end at 1 s; next-turn delays 29 s (a) and 4 s (b): b first, a 25 s later
    assert starts[("b", "requests[2]")] == 1.0 and starts[("a", "requests[2]")] == 26.0


def test_lane_takes_the_next_trace_with_a_fresh_scope():
    w = _wl(trace("a", [req(0.0, 64), req(5.0, 128)]), trace("b", [req(0.0, 64)]))
    r = AgentXReplay(w, lanes=1, seed=0, warmup=False, duration_s=100.0)
    log = run_fixed_latency(r, lambda d: 1.0, max_dispatches=6)
    assert [(x.dispatch.session.id, x.dispatch.play) for x in log] == [("a", 0), ("a", 0), ("b", 1), ("a", 2), ("a", 2), ("b", 3)]
    assert len({x.dispatch.scope for x in log}) == 4


def test_traces_over_the_context_limit_are_skipped():
    w = _wl(trace("small", [req(0.0, 1000)]), trace("big", [req(0.0, 5000)]))
    r = AgentXReplay(w, lanes=2, seed=0, max_context_tokens=2000, warmup=False, recycle=False)
    assert r.skipped_traces == ["big"]
    assert {x.dispatch.session.id for x in run_fixed_latency(r, lambda d: 1.0)} == {"small"}
    with pytest.raises(ValueError, match="every trace"):
        AgentXReplay(w, lanes=1, seed=0, max_context_tokens=10)


def test_duration_stops_dispatching_and_output_cap_applies_to_main_only():
    w = _wl(spawn_join_trace())
    r = AgentXReplay(w, lanes=1, seed=0, warmup=False, duration_s=15.0, max_output_tokens=3, idle_cap_s=None)
    log = run_fixed_latency(r, lambda d: 1.0)
    assert max(x.start_s for x in log) < 15.0
    assert {x.dispatch.request.thread: x.dispatch.out_tokens for x in log} == {0: 3, 1: 10}


def test_agentx_is_deterministic_per_seed():
    docs = [_ten_turns(f"t{k}") for k in range(4)]
    runs = [
        _timeline(run_fixed_latency(AgentXReplay(_wl(*docs), lanes=3, seed=s, duration_s=200.0), lambda d: 1.5))
        for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_production_replay_poisson_lanes_first_turn_cold():
    docs = [_ten_turns(f"t{k}") for k in range(3)]
    mk = lambda seed: ProductionReplay(_wl(*docs), lanes=3, rps=0.5, seed=seed, duration_s=400.0)  # noqa: E731
    log = run_fixed_latency(mk(7), lambda d: 1.0)
    assert 150 <= len(log) <= 250  # ~ 0.5/s over 400 s
    firsts = {}  # the first dispatch of every play (a lane's start, then each session it takes next)
    for x in log:
        firsts.setdefault(x.dispatch.play, x.dispatch)
    assert len({d.lane for d in firsts.values()}) == 3 and len(firsts) > 3  # sessions were replaced
    assert all(d.phase == "cold" and d.request.index == 0 for d in firsts.values() if d.play >= 3)
    assert [x.dispatch for x in log if x.dispatch.phase == "cold"] == list(firsts.values())
    gaps = [b.start_s - a.start_s for a, b in zip(log, log[1:])]
    assert min(gaps) >= 0 and 1.5 < sum(gaps) / len(gaps) < 2.5
    assert _timeline(log) == _timeline(run_fixed_latency(mk(7), lambda d: 1.0))
    assert _timeline(log) != _timeline(run_fixed_latency(mk(8), lambda d: 1.0))


def test_documented_simpy_driver_matches_the_reference_loop():
    simpy = pytest.importorskip("simpy")
    w = _wl(spawn_join_trace(), _ten_turns("a"), _ten_turns("b"))
    lat = lambda d: 0.5 + d.in_tokens / 1000  # noqa: E731

    def mk():
        return AgentXReplay(w, lanes=2, seed=3, duration_s=300.0, warmup_requests=1, system_idle_cap_s=10.0)

    env = simpy.Environment()
    log = []

    def serve(d):
        start = env.now
        yield env.timeout(lat(d))
        log.append((d.session.id, d.request.source, start, env.now, d.phase))

    def driver(env, replay, serve):
        wakeup = [env.event()]

        def run(d):
            yield env.process(serve(d))
            issue(replay.finished(d.key, env.now))
            if not wakeup[0].triggered:
                wakeup[0].succeed()

        def issue(w):
            for d in w.ready:
                env.process(run(d))
            return w

        w = issue(replay.start(env.now))
        while not w.done:
            timer = env.timeout(w.next_due_s - env.now) if w.next_due_s is not None else env.event()
            yield wakeup[0] | timer
            wakeup[0] = env.event()
            w = issue(replay.poll(env.now))

    env.process(driver(env, mk(), serve))
    env.run(until=1000)
    ref = [(x.dispatch.session.id, x.dispatch.request.source, x.start_s, x.end_s, x.dispatch.phase)
           for x in run_fixed_latency(mk(), lat)]  # fmt: skip
    rounded = lambda rows: sorted((a, b, round(c, 6), round(d, 6), e) for a, b, c, d, e in rows)  # noqa: E731
    assert rounded(log) == rounded(ref)
    assert len(log) > 20
