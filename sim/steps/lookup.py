"""The lookup step: where a prompt's tokens come from (GPU prefix cache, pool, computed).

Contract: ``Lookup(world)(r)`` takes a routed request admitted to its prefill's pages
(``r.prefill``, ``r.prompt``, ``r.pages`` set); its GPU hit is the pages its admission reused
(``sim.steps.pages``); it checks every rank x chunk group of ``r.prompt.groups`` in the pool in one batched call
(``SimPool.lookup_runs``; with an SSD tier the presence rows, a chunk on the SSD counting for
every stage) and decides with ``policy.hits.compute_hits``. It fills ``r.hits`` and
``r.in_dram``, makes ``r.prefill_request`` (``policy.prefill_request``: told the hit, it decides
the load, the compute and the save) and fills the record's token sources from it and
``prefill_start_s``.
"""

from __future__ import annotations

import numpy as np

from kvpool.policy.hits import compute_hits
from kvpool.policy.prefill_request import PrefillRequest
from kvpool.sim.request import Request
from kvpool.sim.world import World


class Lookup:
    def __init__(self, world: World) -> None:
        s = world.s
        self.env = world.env
        self.pool = world.pool
        self.chunk_tokens = world.chunk_tokens
        self.page_tokens = s.model.page_tokens
        self.min_load_tokens = s.pool.min_load_tokens

    def __call__(self, r: Request) -> None:
        now = self.env.now
        p, prompt, rec = r.prefill, r.prompt, r.rec
        gpu_tokens = p.pages.gpu_tokens(r)
        groups = prompt.groups
        pool = self.pool
        present = runs = None
        if pool is not None and groups.ids.size:
            if pool.ssd is None:  # each rank's leading run is all the hit needs
                runs = pool.lookup_runs(p.server, p.ranks, groups, now)
            else:  # a chunk on the SSD tier counts for every stage
                present = pool.lookup(p.server, p.ranks, groups, now)
                on_ssd = pool.ssd_lookup(p.server, groups, now)
                r.in_dram = np.logical_and.reduce(present)
                present = present | on_ssd  # [rank, chunk]
        hits = r.hits = compute_hits(rec.in_tokens, gpu_tokens, present, chunk_tokens=self.chunk_tokens,
                                     page_tokens=self.page_tokens, min_load_tokens=self.min_load_tokens,
                                     stage_runs=runs)
        life = r.prefill_request = PrefillRequest(rec.in_tokens, self.chunk_tokens)
        life.looked_up(hits, answered=True)  # the simulated pool always answers
        life.account.write(rec)
        rec.prefill_start_s = now
