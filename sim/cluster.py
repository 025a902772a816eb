"""Placement of instances on servers and NUMA nodes, and the links between them.

Contract:
    * ``place(s)``: the instances on servers and NUMA nodes (``policy.placement``: each instance
      takes whole NUMA nodes, 4 GPUs of one node in the seed; decode instance ``g`` on server
      ``g mod servers``, prefill instances off their group's decode server where the cluster allows).
    * Every GPU has a NIC (``FairLink`` at ``gpu.nic_gb_s`` with the NIC's message rate). Store
      services share the NICs of their server (the seed: "the Store has no NICs of its own"), so
      a restore from a shared multi-server pool also loads the other servers' NICs of the same
      rail (modelled as one link per rail: ``sim.steps.nics``).
"""

from __future__ import annotations

import simpy

from kvpool.policy.placement import Layout
from kvpool.policy.placement import place as place_instances
from kvpool.scenario.model import Scenario
from kvpool.sim.links import FairLink


def place(s: Scenario) -> Layout:
    """The scenario's instances on its servers and NUMA nodes (``policy.placement.place``)."""
    c = s.cluster
    return place_instances(c.servers, c.gpus_per_server, c.numa_per_server,
                           s.decode.instances, s.decode.gpus, s.prefill.instances, s.prefill.gpus)


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
