"""The NICs that carry a prefill rank's pool traffic (restores and saves).

Contract: ``PoolNics(world).transfer(p, rank, nbytes, writes, join)`` moves ``nbytes`` in
``writes`` writes between the pool and rank ``rank`` of prefill ``p``, counted by ``join``. The
rank's own NIC carries every byte. In a shared pool of N > 1 servers the objects lie spread
over every server's services, which have no NICs of their own, so the other N - 1 servers' NICs
on the rank's rail carry their part too: ``nbytes // N`` each, in ``writes // N`` writes (at
least one). Those N - 1 NICs are modelled as one link per rail (``World.pool_rails``), of N - 1
times a NIC's bandwidth and message rate and a NIC's latency, which carries the N - 1 parts
together: ``(N - 1) * (nbytes // N)`` bytes in ``(N - 1) * max(1, writes // N)`` writes, shared
fairly with every other transfer on that rail (every server's ranks on it). Alone, a transfer
takes on it what each of N - 1 NICs took for its part; under load, the rail's remote parts share
N - 1 NICs' worth of bandwidth, without being charged to (or slowing) any one server's NIC. So a
transfer costs two link transfers whatever N is. What it leaves out: a remote NIC's own rank
traffic and the other ranks' parts are not one queue any more (each NIC served both, sharing its
bandwidth between them), and an uneven load across servers is averaged over the rail.
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
        own, rail = self.rank_nics[p.index][rank]
        own.transfer(nbytes, writes, join)
        if rail is not None:
            servers = self.servers
            part = nbytes // servers
            if part:
                others = servers - 1
                rail.transfer(others * part, others * max(1, writes // servers), join)
