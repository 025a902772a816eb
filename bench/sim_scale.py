"""Simulator scale: requests per CPU second and peak memory as the four-server cluster grows.

The cluster of ``mi350x-6p2d-shared`` scaled N-fold: N servers, 3N/2 prefill and N/2 decode
instances, 28N AgentX sessions, 900 simulated seconds. Each point runs in a fresh process, so its
peak RSS is its own. The goal it is measured against: the simulator's cost per request does not
grow with the cluster (>= 1,500 requests per CPU second at N = 32, 896 sessions) and peak memory
stays <= 2 GiB, linear in the work. Prints one JSON object: per point the requests, CPU seconds,
requests per CPU second, SimPy events (per request, and CPU per event: what the requests asked
of the simulator, and what each cost), peak RSS, and the ratio of each point's requests per CPU
second to the smallest point's (1.0: no growth in cost per request).

    .venv/bin/python bench/sim_scale.py [--servers 4,8,16,32] [--duration 900] [--scenario mi350x-6p2d-shared]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

GOAL_REQUESTS_PER_CPU_S = 1500.0
GOAL_PEAK_RSS_MIB = 2048.0


def overrides(servers: int, duration_s: float) -> list[str]:
    """The scenario overrides of the N-fold cluster."""
    if servers % 2:
        raise SystemExit(f"error: --servers: each N must be even (3N/2 prefill, N/2 decode instances), got {servers}")
    return [f"cluster.servers={servers}", f"prefill.instances={3 * servers // 2}",
            f"decode.instances={servers // 2}", f"workload.duration_s={duration_s}"]


def run_one(scenario: str, servers: int, duration_s: float) -> dict:
    """One point, in this process (the child's side): every request simulated counts."""
    from kvpool.scenario import load_scenario
    from kvpool.sim.engine import Simulation
    from kvpool.sim.run import make_replay, workload_for

    s = load_scenario(scenario, overrides(servers, duration_s))
    sessions = 28 * servers
    workload = workload_for(s)
    c = time.process_time()
    sim = Simulation(s, make_replay(s, workload, sessions))
    records = sim.run()
    cpu_s = time.process_time() - c
    return {
        "servers": servers, "sessions": sessions, "requests": len(records), "cpu_s": cpu_s,
        "events": next(sim.env._eid),  # SimPy numbers every scheduled event (the work the requests made)
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="4,8,16,32", help="cluster sizes N, comma-separated (even)")
    ap.add_argument("--duration", type=float, default=900.0, help="simulated seconds per point")
    ap.add_argument("--scenario", default="mi350x-6p2d-shared")
    ap.add_argument("--point", type=int, default=None, help=argparse.SUPPRESS)  # the child's side
    a = ap.parse_args()
    if a.point is not None:
        print(json.dumps(run_one(a.scenario, a.point, a.duration)))
        return
    try:
        sizes = [int(x) for x in a.servers.split(",")]
    except ValueError:
        raise SystemExit(f"error: --servers: comma-separated integers, got {a.servers!r}") from None
    points = []
    for n in sizes:
        overrides(n, a.duration)  # checked before a child starts
        print(f"[sim_scale] N={n} ({28 * n} sessions) ...", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, __file__, "--point", str(n), "--duration", str(a.duration),
                              "--scenario", a.scenario], check=True, capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": "0"})
        p = json.loads(out.stdout.strip().splitlines()[-1])
        p["requests_per_cpu_s"] = p["requests"] / p["cpu_s"] if p["cpu_s"] > 0 else 0.0
        p["events_per_request"] = p["events"] / p["requests"] if p["requests"] else 0.0
        p["cpu_us_per_event"] = 1e6 * p["cpu_s"] / p["events"] if p["events"] else 0.0
        points.append(p)
    base = points[0]["requests_per_cpu_s"] if points else 0.0
    for p in points:
        p["cost_ratio_to_smallest"] = base / p["requests_per_cpu_s"] if p["requests_per_cpu_s"] else None
    last = points[-1] if points else {}
    print(json.dumps({
        "scenario": a.scenario, "duration_s": a.duration, "points": points,
        "goal": {"requests_per_cpu_s_at_largest": GOAL_REQUESTS_PER_CPU_S, "peak_rss_mib": GOAL_PEAK_RSS_MIB},
        "meets_goal": bool(last) and last["requests_per_cpu_s"] >= GOAL_REQUESTS_PER_CPU_S
        and max(p["peak_rss_mib"] for p in points) <= GOAL_PEAK_RSS_MIB,
    }, indent=2))


if __name__ == "__main__":
    main()
