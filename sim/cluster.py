"""Placement of instances on servers and NUMA nodes, and the links between them.

Contract:
    * Servers -> NUMA nodes -> GPUs; each instance takes whole NUMA nodes (4 GPUs of one node in
      the seed). Decode instance ``g`` goes to server ``g mod servers``; prefill instances fill the
      remaining NUMA nodes server by server, assigned round-robin to the decode groups and, where
      the cluster allows, never on their own group's decode server (the seed's placement).
    * Every GPU has a NIC (``FairLink`` at ``gpu.nic_gb_s`` with the NIC's message rate). Store
      services share the NICs of their server (the seed: "the Store has no NICs of its own"), so
      a restore from a shared multi-server pool also loads the other servers' NICs of the same
      rail (modelled as one link per rail: ``sim.steps.nics``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import simpy

from kvpool.scenario.model import Scenario
from kvpool.sim.links import FairLink


@dataclass
class Placement:
    server: int
    numa: int
    gpus: list[int]  # global GPU indices
    group: int = 0


@dataclass
class Layout:
    prefill: list[Placement] = field(default_factory=list)
    decode: list[Placement] = field(default_factory=list)


def place(s: Scenario) -> Layout:
    c = s.cluster
    per_numa = c.gpus_per_server // c.numa_per_server
    slots = [(srv, n) for srv in range(c.servers) for n in range(c.numa_per_server)]
    free = list(slots)

    def take(gpus: int, prefer: list[tuple[int, int]]) -> Placement:
        need = max(1, -(-gpus // per_numa))
        for i, (srv, n) in enumerate(prefer):
            run = [(srv, n + k) for k in range(need)]
            if all(r in free for r in run):
                for r in run:
                    free.remove(r)
                ids = [srv * c.gpus_per_server + (n + k) * per_numa + j for k in range(need) for j in range(per_numa)]
                return Placement(srv, n, ids[:gpus])
        raise ValueError("the cluster has too few free NUMA nodes for the instances (check cluster and instance sizes)")

    lay = Layout()
    for g in range(s.decode.instances):
        srv = g % c.servers
        pl = take(s.decode.gpus, [x for x in free if x[0] == srv] + free)
        pl.group = g
        lay.decode.append(pl)
    groups = max(1, s.decode.instances)
    for i in range(s.prefill.instances):
        g = i % groups
        dec_server = lay.decode[g].server if lay.decode else -1
        prefer = [x for x in free if x[0] != dec_server] + [x for x in free if x[0] == dec_server]
        pl = take(s.prefill.gpus, prefer)
        pl.group = g
        lay.prefill.append(pl)
    return lay


class Network:
    """One NIC link per GPU."""

    def __init__(self, env: simpy.Environment, s: Scenario) -> None:
        g = s.gpu
        n = s.cluster.servers * s.cluster.gpus_per_server
        self.nic = [
            FairLink(env, g.nic_gb_s * 1e9, latency_s=g.nic_latency_us * 1e-6, writes_per_s=g.nic_writes_per_s, name=f"nic{i}")
            for i in range(n)
        ]

    def bytes_moved(self) -> int:
        return sum(link.bytes_moved for link in self.nic)
