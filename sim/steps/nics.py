"""The NICs that carry a prefill rank's pool traffic (restores and saves).

Contract: ``PoolNics(world).transfer(p, rank, nbytes, writes, join)`` moves ``nbytes`` in
``writes`` writes between the pool and rank ``rank`` of prefill ``p``, counted by ``join``: the
rank's own NIC carries every byte; in a shared multi-server pool, the NICs of the other servers
on the same rail carry ``nbytes // servers`` each (``writes // servers``, at least one).
"""

from __future__ import annotations

from kvpool.sim.instances import PrefillInstance
from kvpool.sim.links import Join
from kvpool.sim.world import World


class PoolNics:
    def __init__(self, world: World) -> None:
        self.rank_nics = world.rank_nics
        self.servers = world.s.cluster.servers

    def transfer(self, p: PrefillInstance, rank: int, nbytes: int, writes: int, join: Join) -> None:
        own, remotes = self.rank_nics[p.index][rank]
        own.transfer(nbytes, writes, join)
        if remotes:
            servers = self.servers
            share = nbytes // servers
            if share:
                for link in remotes:
                    link.transfer(share, max(1, writes // servers), join)
