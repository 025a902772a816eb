"""A simulation to count instructions of under valgrind (see docs/sim-speed.md, Measuring).

Builds the workload of one load point and, unless ``--no-run``, simulates it; prints the number of
requests. Run it twice under ``valgrind --tool=callgrind`` with ``PYTHONHASHSEED=0``, with and
without ``--no-run``: the difference of the two instruction totals is the simulation's, a measure
that does not depend on how busy the machine is.

    .venv/bin/python bench/sim_instructions.py [--scenario mi355x-1p1d] [--sessions 112] [--duration 300] [--no-run]
"""

from __future__ import annotations

import argparse

from kvpool.scenario import load_scenario
from kvpool.sim.engine import Simulation
from kvpool.sim.run import make_replay, workload_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="mi355x-1p1d")
    ap.add_argument("--sessions", type=float, default=112)
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--no-run", action="store_true", help="build the workload only (the baseline)")
    a = ap.parse_args()
    s = load_scenario(a.scenario, [f"workload.duration_s={a.duration}"])
    sim = Simulation(s, make_replay(s, workload_for(s), a.sessions))
    if not a.no_run:
        print(len(sim.run()))


if __name__ == "__main__":
    main()
