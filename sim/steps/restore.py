"""The restore step: the pool's chunks of the hit travel to every prefill rank.

Contract: ``Restore(world, nics)(r, then)`` for a request whose lookup found pool tokens
(``r.hits.pool_tokens > 0``). Chunks found only on the SSD tier are read first (the server's SSD
link, every rank's bytes), promoted back to DRAM, and then travel like the others. The loaded
groups are pinned in the pool while they travel. Every rank loads its objects on one of its
stage's load workers, after the forwards queued ahead of its stage (``stage x step time``):
its bytes over its NICs (``PoolNics``), then the read and unpack time
(``CostModel.pool_load_s``). ``then()`` is called once every rank is done, with the record's
``restore_stage_s``, ``restore_spread_s``, ``restore_bytes`` and ``ssd_tokens`` set.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.sim.events import call_later
from kvpool.sim.instances import PrefillInstance
from kvpool.sim.links import Join
from kvpool.sim.request import Request
from kvpool.sim.steps.nics import PoolNics
from kvpool.sim.world import World
from kvpool.workload.records import RequestRecord


class Restore:
    def __init__(self, world: World, nics: PoolNics) -> None:
        self.env = world.env
        self.pool = world.pool
        self.nics = nics
        self.chunk_tokens = world.chunk_tokens
        self.rank_stage = world.rank_stage
        self.rank_bytes = world.rank_bytes
        self.chunk_bytes = sum(world.rank_bytes)  # one chunk, every rank's object
        self.ssd_links = world.ssd_links
        self.load_s = world.cost.pool_load_s

    def __call__(self, r: Request, then: Callable[[], None]) -> None:
        hits, p, rec = r.hits, r.prefill, r.rec
        pool = self.pool
        load = r.prompt.groups.part(hits.load_first_chunk, hits.load_end_chunk)

        def restore() -> None:
            pool.pin(p.server, p.ranks, load)
            self._load(rec, p, load.ids.size, restored)

        def restored() -> None:
            pool.unpin(p.server, p.ranks, load)
            then()

        if r.in_dram is None:
            restore()
            return
        on_ssd = load.where(~r.in_dram[hits.load_first_chunk:hits.load_end_chunk])
        n_ssd = int(on_ssd.ids.size)
        if not n_ssd:
            restore()
            return
        rec.ssd_tokens = min(hits.pool_tokens, n_ssd * self.chunk_tokens)
        rec.pool_tokens -= rec.ssd_tokens

        def promote(_e) -> None:
            pool.save(p.server, p.ranks, on_ssd, self.env.now)  # back in DRAM
            restore()

        self.ssd_links[p.server].transfer(n_ssd * self.chunk_bytes, n_ssd).callbacks.append(promote)

    def _load(self, rec: RequestRecord, p: PrefillInstance, chunks: int, then: Callable[[], None]) -> None:
        """Every rank of ``p`` loads its objects of ``chunks`` chunks (see the module docstring);
        ``then()`` when the last rank is done. One rank: delay -> worker -> links -> read +
        unpack -> worker free."""
        env = self.env
        ranks = p.ranks
        starts, ends = [0.0] * ranks, [0.0] * ranks
        left = [ranks]
        load_s = self.load_s

        def finish(rank: int) -> None:
            ends[rank] = env.now
            p.loaders[rank].release()
            left[0] -= 1
            if not left[0]:
                rec.restore_stage_s = [e - b for b, e in zip(starts, ends)]
                rec.restore_spread_s = max(ends) - min(starts)
                then()

        def start(rank: int) -> None:
            starts[rank] = env.now
            nbytes = chunks * self.rank_bytes[rank]
            rec.restore_bytes += nbytes
            self.nics.transfer(p, rank, nbytes, chunks,
                               Join(env, lambda: call_later(env, load_s(nbytes), lambda _f: finish(rank))))

        for rank in range(ranks):
            delay = self.rank_stage[rank] * p.step_s  # the forwards queued ahead of this stage
            submit = p.loaders[rank].submit
            if delay:
                call_later(env, delay, lambda _e, r=rank, sub=submit: sub(lambda: start(r)))
            else:
                submit(lambda r=rank: start(r))
