"""The save step: a prompt's new chunks go to the pool, in the background.

Contract: ``Save(world, nics)(r, groups, lost, done)`` for the chunk groups of ``r``'s prompt that the pool
did not hold (a part of ``r.prompt.groups``): every rank packs its objects (in parallel: the largest rank's pack time,
``CostModel.pack_s``), sends them over its NICs (``PoolNics``) and, once every byte has landed,
puts them with their group ids (``SimPool.save``: ``policy.grouptable`` eviction); the record's
``save_bytes`` grows then, ``save_s`` is the time since the call, and the pool's time series is
sampled, ``r.prefill_request`` is told whether it was stored, then ``done()`` (the prefill's
pages and its first token wait for it). A save that fails (``lost``, ``[faults]``) moves its
bytes and puts nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.policy.grouptable import GroupIds
from kvpool.sim.events import call_later
from kvpool.sim.links import Join
from kvpool.sim.request import Request
from kvpool.sim.steps.nics import PoolNics
from kvpool.sim.world import World


class Save:
    def __init__(self, world: World, nics: PoolNics) -> None:
        self.world = world
        self.env = world.env
        self.pool = world.pool
        self.nics = nics
        self.rank_bytes = world.rank_bytes
        self.pack_s = world.cost.pack_s

    def __call__(self, r: Request, groups: GroupIds, lost: bool, done: Callable[[], None]) -> None:
        env, p, rec = self.env, r.prefill, r.rec
        start = env.now
        chunks = int(groups.ids.size)
        nbytes = [chunks * b for b in self.rank_bytes]

        def put() -> None:
            rec.save_bytes += sum(nbytes)
            rec.save_s = env.now - start
            if not lost:
                self.pool.save(p.server, p.ranks, groups, env.now)
                self.world.sample_pool()
            r.prefill_request.saved(not lost)
            done()

        def send(_e) -> None:
            j = Join(env, put)
            for rank in range(p.ranks):
                self.nics.transfer(p, rank, nbytes[rank], chunks, j)

        call_later(env, self.pack_s(max(nbytes)), send)  # every rank packs in parallel
