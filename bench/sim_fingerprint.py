"""A fingerprint of the simulator's results: one SHA-256 over small runs of several configurations.

Speed work must not change results. Each configuration is simulated and hashed: every field of
every request record (floats by ``repr``, exact), the pool's counters (used bytes, evicted groups,
per-table state sizes), the GPU caches' counters (blocks held, evicted), the key space's counters,
the links' byte counts and the run's time series. Prints one line per configuration and the
combined hash last; ``--json`` prints them as one object.

    .venv/bin/python bench/sim_fingerprint.py [--only NAME ...] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import fields

from kvpool.scenario import load_scenario
from kvpool.sim.engine import Simulation
from kvpool.sim.metrics import RequestRecord
from kvpool.sim.run import make_replay, workload_for

#: name -> (scenario, load, overrides)
CONFIGS: dict[str, tuple[str, float, list[str]]] = {
    "1p1d-56": ("mi355x-1p1d", 56, ["workload.duration_s=600"]),
    "1p1d-112": ("mi355x-1p1d", 112, ["workload.duration_s=600"]),
    "6p2d-shared-112": ("mi350x-6p2d-shared", 112, ["workload.duration_s=300"]),
    "6p2d-split-112": ("mi350x-6p2d-split", 112, ["workload.duration_s=300"]),
    "tp4-replay-split-0.8": ("mi350x-6p2d-tp4-replay-split", 0.8, ["workload.duration_s=300"]),
    "1p1d-ssd": ("mi355x-1p1d", 112, ["workload.duration_s=600", "pool.ssd.enabled=true",
                                       "pool.ssd.gib_per_server=1024", "pool.gib_per_service=96"]),
    "1p1d-lfu": ("mi355x-1p1d", 112, ["workload.duration_s=600", "pool.eviction_policy=lfu",
                                       "pool.gib_per_service=96"]),
    "1p1d-gate": ("mi355x-1p1d", 112, ["workload.duration_s=300", "gate.enabled=true",
                                        "gate.tokens_per_decode=2000000"]),
}

_RECORD_FIELDS = [f.name for f in fields(RequestRecord)]


def _feed(h, *values) -> None:
    h.update(repr(values).encode())
    h.update(b"\n")


def fingerprint(sim: Simulation, records: list[RequestRecord]) -> str:
    h = hashlib.sha256()
    _feed(h, len(records), sim.env.now)
    for r in records:
        _feed(h, *[getattr(r, k) for k in _RECORD_FIELDS])
    if sim.pool is not None:
        pool = sim.pool
        _feed(h, "pool", pool.capacity_bytes, pool.used_bytes, pool.evicted_groups)
        for row in pool.tables:
            for t in row:
                _feed(h, "table", t.used_bytes, t.evicted_groups, t.evicted_bytes, t.evict_passes, t.objects)
        for t in pool.ssd or []:
            _feed(h, "ssd", t.used_bytes, t.evicted_groups, t.evicted_bytes, t.evict_passes, t.objects)
    for p in sim.prefills:
        _feed(h, "prefill", p.index, p.cache.blocks, p.cache.evicted_blocks, p.computed_tokens, p.busy_s)
    for d in sim.decodes:
        _feed(h, "decode", d.index, d.reserved_tokens)
    _feed(h, "keys", sim.keys.groups, sim.keys.hashed_chunks)
    _feed(h, "nics", [link.bytes_moved for link in sim.net.nic], [link.bytes_moved for link in sim.ssd_links])
    tl = sim.timeline
    _feed(h, "timeline", tl.pool_t, tl.pool_used, tl.pool_evicted, tl.decode_t, tl.decode_occ)
    return h.hexdigest()


def run_config(name: str) -> tuple[str, dict]:
    scenario, load, overrides = CONFIGS[name]
    s = load_scenario(scenario, overrides)
    w = workload_for(s)
    sim = Simulation(s, make_replay(s, w, load))
    c = time.process_time()
    records = sim.run()
    cpu = time.process_time() - c
    return fingerprint(sim, records), {"requests": len(records), "events": next(sim.env._eid), "cpu_s": round(cpu, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="configurations to run (default: all)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    names = a.only or list(CONFIGS)
    total = hashlib.sha256()
    out = {}
    for name in names:
        digest, info = run_config(name)
        total.update(f"{name}:{digest}\n".encode())
        out[name] = {"sha256": digest, **info}
        if not a.json:
            print(f"{name:24s} {digest[:16]}  requests={info['requests']} events={info['events']} cpu={info['cpu_s']}s",
                  flush=True)
    if a.json:
        print(json.dumps({"configs": out, "sha256": total.hexdigest()}, indent=2))
    else:
        print(f"{'ALL':24s} {total.hexdigest()}")


if __name__ == "__main__":
    main()
