"""A fingerprint of the simulator's results: one SHA-256 over small runs of several configurations.

Speed work must not change results. Each configuration of ``kvpool.sim.fingerprint.CONFIGS`` is
simulated and hashed (what a digest covers: that module's docstring). Prints one line per
configuration and the combined hash last; ``--json`` prints them as one object. The expected
digests are the golden file of ``tests/sim/test_fingerprint.py``.

    .venv/bin/python bench/sim_fingerprint.py [--only NAME ...] [--json]
"""

from __future__ import annotations

import argparse
import json

from kvpool.sim.fingerprint import CONFIGS, combined, fingerprint, simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, choices=list(CONFIGS), help="configurations to run (default: all)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    names = a.only or list(CONFIGS)
    out = {}
    for name in names:
        sim, records, cpu_s = simulate(name)
        out[name] = {"sha256": fingerprint(sim, records), "requests": len(records),
                     "events": next(sim.env._eid), "cpu_s": round(cpu_s, 2)}
        if not a.json:
            o = out[name]
            print(f"{name:24s} {o['sha256'][:16]}  requests={o['requests']} events={o['events']} cpu={o['cpu_s']}s",
                  flush=True)
    total = combined({name: o["sha256"] for name, o in out.items()})
    if a.json:
        print(json.dumps({"configs": out, "sha256": total}, indent=2))
    else:
        print(f"{'ALL':24s} {total}")


if __name__ == "__main__":
    main()
