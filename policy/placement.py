"""Placement of prefill and decode instances on servers and NUMA nodes (pure: stdlib only).

Contract:
    * Servers -> NUMA nodes -> GPUs; each instance takes whole, consecutive NUMA nodes of one server
      (``gpus_per_server / numa_per_server`` GPUs each, a whole number). Decode instance ``g`` goes to server
      ``g mod servers``; prefill instances fill the remaining NUMA nodes server by server, assigned
      round-robin to the decode groups and, where the cluster allows, never on their own group's
      decode server (the seed's placement). ``prefill_group(i, decode_instances)`` is prefill
      instance ``i``'s group; ``policy.routing`` reads the groups from it in both worlds.
    * ``place(...)`` returns the ``Layout``; ``PlacementError`` (a ``ValueError``) when there are
      more NUMA nodes than GPUs per server, when they do not divide the GPUs of a server evenly, or
      when the instances do not fit. The scenario model calls it
      to refuse a deployment that cannot be placed; the simulator calls it to build the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class PlacementError(ValueError):
    """The instances cannot be placed on the cluster's NUMA nodes."""


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


def prefill_group(instance: int, decode_instances: int) -> int:
    """The decode group prefill instance ``instance`` serves: round-robin over the decode instances."""
    return instance % max(1, decode_instances)


def place(servers: int, gpus_per_server: int, numa_per_server: int,
          decode_instances: int, decode_gpus: int, prefill_instances: int, prefill_gpus: int) -> Layout:
    """The layout of the instances (see the module docstring)."""
    if numa_per_server > gpus_per_server:
        raise PlacementError(f"cluster.numa_per_server ({numa_per_server}) exceeds cluster.gpus_per_server "
                             f"({gpus_per_server}): every NUMA node holds at least one GPU")
    if gpus_per_server % numa_per_server:
        raise PlacementError(f"cluster.numa_per_server ({numa_per_server}) must divide cluster.gpus_per_server "
                             f"({gpus_per_server}): every NUMA node of a server holds the same number of GPUs")
    per_numa = gpus_per_server // numa_per_server
    free = [(srv, n) for srv in range(servers) for n in range(numa_per_server)]

    def take(role: str, gpus: int, prefer: list[tuple[int, int]]) -> Placement:
        need = max(1, -(-gpus // per_numa))
        if need > numa_per_server:
            raise PlacementError(
                f"a {role} instance of {gpus} GPUs is larger than one server (cluster.gpus_per_server = "
                f"{gpus_per_server}); an instance runs on the GPUs of one server")
        for srv, n in prefer:
            run = [(srv, n + k) for k in range(need)]
            if all(r in free for r in run):
                for r in run:
                    free.remove(r)
                ids = [srv * gpus_per_server + (n + k) * per_numa + j for k in range(need) for j in range(per_numa)]
                return Placement(srv, n, ids[:gpus])
        raise PlacementError(
            f"the instances do not fit the NUMA nodes: each instance takes whole NUMA nodes of one server "
            f"({per_numa} GPUs each: cluster.gpus_per_server / cluster.numa_per_server), and no {need} free "
            f"consecutive node(s) are left for a {role} instance of {gpus} GPUs "
            f"({decode_instances} decode x {decode_gpus} + {prefill_instances} prefill x {prefill_gpus} GPUs "
            f"on {servers} server(s) of {numa_per_server} nodes)")

    lay = Layout()
    for g in range(decode_instances):
        srv = g % servers
        pl = take("decode", decode_gpus, [x for x in free if x[0] == srv] + free)
        pl.group = g
        lay.decode.append(pl)
    for i in range(prefill_instances):
        g = prefill_group(i, decode_instances)
        dec_server = lay.decode[g].server if lay.decode else -1
        prefer = [x for x in free if x[0] != dec_server] + [x for x in free if x[0] == dec_server]
        pl = take("prefill", prefill_gpus, prefer)
        pl.group = g
        lay.prefill.append(pl)
    return lay
