"""A fingerprint of the simulator's results: one SHA-256 per small run of a fixed configuration.

Contract:
    * ``CONFIGS`` names the configurations (scenario, load, overrides); ``simulate(name)`` runs one,
      ``fingerprint(sim, records)`` is its digest.
    * A digest covers the simulator's fields of every request record (``RECORD_FIELDS``, floats by
      ``repr``, exact), the pool's
      counters (used bytes, evicted groups, per-table state sizes), the prefill pages' counters
      (cached, held, evicted), the key space's counters, the links' byte counts and the run's time
      series. Equal digests mean equal results; speed work must leave every digest unchanged.
    * ``combined(digests)`` is the one hash over the configurations, in ``CONFIGS`` order.
    * The expected digests live in ``tests/sim/golden/fingerprint.json``, which
      ``tests/sim/test_fingerprint.py`` compares against (and regenerates on request).
    * ``RECORD_FIELDS`` is a fixed list, not every field of ``RequestRecord``: a field the
      simulator does not set (``lookup_answered``, the backend's) leaves the digests alone, and a
      new record field joins the fingerprint only together with a regenerated golden file.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping

from kvpool.scenario import load_scenario
from kvpool.sim.engine import Simulation
from kvpool.sim.run import make_replay, workload_for
from kvpool.workload.records import RequestRecord

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

#: The ``RequestRecord`` fields a digest covers, in this order (see the module docstring).
RECORD_FIELDS = (
    "key", "session", "thread", "measured", "arrival_s", "in_tokens", "out_tokens", "prefill", "decode",
    "gpu_tokens", "pool_tokens", "ssd_tokens", "computed_tokens", "restore_stage_s", "restore_spread_s",
    "restore_failed", "prefill_start_s", "prefill_end_s", "handoff_s", "first_token_s", "end_s",
    "restore_bytes", "save_bytes", "handoff_bytes", "handoff_writes", "rejected",
)


def _feed(h, *values) -> None:
    h.update(repr(values).encode())
    h.update(b"\n")


def fingerprint(sim: Simulation, records: list[RequestRecord]) -> str:
    """The digest of a finished simulation and its records."""
    h = hashlib.sha256()
    _feed(h, len(records), sim.env.now)
    for r in records:
        _feed(h, *[getattr(r, k) for k in RECORD_FIELDS])
    if sim.pool is not None:
        pool = sim.pool
        _feed(h, "pool", pool.capacity_bytes, pool.used_bytes, pool.evicted_groups)
        for row in pool.tables:
            for t in row:
                _feed(h, "table", t.used_bytes, t.evicted_groups, t.evicted_bytes, t.evict_passes, t.objects)
        for t in pool.ssd or []:
            _feed(h, "ssd", t.used_bytes, t.evicted_groups, t.evicted_bytes, t.evict_passes, t.objects)
    for p in sim.prefills:
        c = p.pages.cache
        _feed(h, "prefill", p.index, c.cached_pages, c.held_pages, c.evictions, p.computed_tokens, p.busy_s)
    for d in sim.decodes:
        _feed(h, "decode", d.index, d.reserved_tokens)
    _feed(h, "keys", sim.keys.groups, sim.keys.hashed_chunks)
    _feed(h, "nics", [link.bytes_moved for link in sim.net.nic], [link.bytes_moved for link in sim.ssd_links])
    tl = sim.timeline
    _feed(h, "timeline", tl.pool_t, tl.pool_used, tl.pool_evicted, tl.decode_t, tl.decode_occ)
    return h.hexdigest()


def simulate(name: str) -> tuple[Simulation, list[RequestRecord], float]:
    """Simulate configuration ``name``: the finished simulation, its records and the run's CPU seconds."""
    scenario, load, overrides = CONFIGS[name]
    s = load_scenario(scenario, overrides)
    sim = Simulation(s, make_replay(s, workload_for(s), load))
    c = time.process_time()
    records = sim.run()
    return sim, records, time.process_time() - c


def combined(digests: Mapping[str, str]) -> str:
    """One hash over the configurations' digests (``name:digest`` lines in the given order)."""
    total = hashlib.sha256()
    for name, digest in digests.items():
        total.update(f"{name}:{digest}\n".encode())
    return total.hexdigest()
