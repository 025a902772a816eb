"""Simulator speed: simulated seconds and requests per wall (and CPU) second for one load point.

Prints one JSON object. The limit it is measured against is real time (the ratio
``sim_s_per_wall_s`` must exceed 1 to be useful at all; the goal for a 112-session hour of
mi355x-1p1d is >= 700x on one core) and, in the same run, a bare SimPy loop of the same number
of events (``simpy_events_per_s``), the floor of any SimPy model on this machine.

    .venv/bin/python bench/sim_speed.py [--scenario mi355x-1p1d] [--sessions 112] [--duration 3600] [--traces PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import simpy

from kvpool.scenario import load_scenario
from kvpool.sim.engine import Simulation
from kvpool.sim.run import make_replay, workload_for


def bare_simpy(events: int) -> float:
    """Events per second of a minimal SimPy process that only waits."""
    env = simpy.Environment()

    def proc():
        for _ in range(events):
            yield env.timeout(1.0)

    env.process(proc())
    t = time.perf_counter()
    env.run()
    return events / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="mi355x-1p1d")
    ap.add_argument("--sessions", type=float, default=112)
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--traces", default=None)
    a = ap.parse_args()
    s = load_scenario(a.scenario, [f"workload.duration_s={a.duration}"])
    t0 = time.perf_counter()
    w = workload_for(s, a.traces)
    load_s = time.perf_counter() - t0
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sim = Simulation(s, make_replay(s, w, a.sessions))
    t, c = time.perf_counter(), time.process_time()
    records = sim.run()
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    events = next(sim.env._eid)  # SimPy numbers every scheduled event
    print(json.dumps({
        "scenario": s.name, "sessions": a.sessions, "duration_s": a.duration,
        "requests": len(records), "simulated_s": sim.env.now, "events": events,
        "wall_s": wall, "cpu_s": cpu, "workload_load_s": load_s,
        "sim_s_per_wall_s": sim.env.now / wall, "sim_s_per_cpu_s": sim.env.now / cpu,
        "requests_per_wall_s": len(records) / wall,
        "simpy_events_per_s": bare_simpy(min(events, 500_000)), "model_events_per_s": events / wall,
        "peak_rss_mib_after_workload": rss0 / 1024,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }, indent=2))


if __name__ == "__main__":
    main()
