"""Production replay: a lane that starts inside a session marks cold every thread it joins midway."""

from trace_builders import req, sub, trace

from kvpool.workload.model import Workload
from kvpool.workload.replay import ProductionReplay, run_fixed_latency
from kvpool.workload.weka import session_from_weka


def session():
    # main m0 m1 m2, a subagent (s0 s1 s2) spawned after m0, then main m3 m4
    return session_from_weka(trace("c", [
        req(0.0, 128, [1, 2]),
        sub(1.0, [req(0.0, 64, [10]), req(2.0, 128, [10, 11]), req(4.0, 192, [10, 11, 12])], duration_ms=6000),
        req(10.0, 192, [1, 2, 3]),
        req(20.0, 256, [1, 2, 3, 4]),
        req(30.0, 320, [1, 2, 3, 4, 5]),
    ]))


def test_threads_joined_midway_are_cold_once():
    s = session()
    # start exactly at the 3rd request in time order (fraction 0.4 of 6 requests -> position 2)
    rp = ProductionReplay(Workload((s,)), lanes=1, rps=100.0, seed=3, duration_s=0.2,
                          start_fraction_min=0.4, start_fraction_max=0.4)
    served = run_fixed_latency(rp, lambda d: 0.01)
    later = [x.dispatch for x in served if x.dispatch.play > 0]  # the session again, from turn 0
    assert later and later[0].phase == "cold" and all(d.phase == "profile" for d in later[1:] if d.play == later[0].play)
    threads = [(x.dispatch.request.thread, x.dispatch.phase) for x in served if x.dispatch.play == 0]
    first_thread = threads[0][0]
    assert threads[0][1] == "cold"
    # every thread that had requests before the start position is cold on its first dispatch only
    skipped = {r.thread for r in s.requests[:2]}
    seen = {first_thread}
    for thread, phase in threads[1:]:
        if thread in skipped and thread not in seen:
            assert phase == "cold"
        else:
            assert phase == "profile"
        seen.add(thread)
    assert any(p == "profile" for _, p in threads)
