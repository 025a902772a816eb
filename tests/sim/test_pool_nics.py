"""sim.steps.nics: a prefill rank's pool traffic on its own NIC and, in a shared pool of several
servers, on its rail's one link for the other servers' NICs, whatever the number of servers."""

import pytest

from kvpool.scenario import load_scenario
from kvpool.sim.links import Join
from kvpool.sim.steps.nics import PoolNics
from kvpool.sim.world import World


def _world(scenario: str, servers: int) -> World:
    return World(load_scenario(scenario, [f"cluster.servers={servers}", f"prefill.instances={3 * servers // 2}",
                                          f"decode.instances={servers // 2}"]))


@pytest.mark.parametrize("servers", [2, 4, 16])
def test_a_transfer_loads_its_nic_and_its_rails_link_for_the_other_servers(servers):
    w = _world("mi350x-6p2d-shared", servers)
    g = w.s.gpu
    assert len(w.pool_rails) == w.s.cluster.gpus_per_server
    p, rank, nbytes, writes = w.prefills[-1], 1, 8_000_003, 17
    done = []
    join = Join(w.env, lambda: done.append(w.env.now))
    PoolNics(w).transfer(p, rank, nbytes, writes, join)
    join.close()
    w.env.run()
    gpu = p.rank_gpu(rank)
    rail = w.pool_rails[gpu % w.s.cluster.gpus_per_server]
    others, part = servers - 1, nbytes // servers
    assert [link.bytes_moved for link in w.net.nic] == [nbytes if i == gpu else 0 for i in range(len(w.net.nic))]
    assert [link.bytes_moved for link in w.pool_rails] == [others * part if link is rail else 0 for link in w.pool_rails]
    nic_bps, lat = g.nic_gb_s * 1e9, g.nic_latency_us * 1e-6
    own_s = (nbytes + writes * nic_bps / g.nic_writes_per_s) / nic_bps + lat
    # the rail's link alone: what each of the other NICs takes for its part
    rail_s = (part + max(1, writes // servers) * nic_bps / g.nic_writes_per_s) / nic_bps + lat
    assert rail_s < own_s and done == [pytest.approx(own_s, rel=1e-12)]
    assert rail.busy_s == pytest.approx(rail_s, rel=1e-12)


@pytest.mark.parametrize("scenario, overrides", [
    ("mi350x-6p2d-split", []),  # each server its own pool
    ("mi350x-6p2d-shared", ["cluster.servers=1", "prefill.instances=1", "decode.instances=1"]),  # one server
])
def test_without_a_shared_multi_server_pool_only_the_own_nic(scenario, overrides):
    w = World(load_scenario(scenario, overrides))
    assert w.pool is not None and w.pool_rails == []
    assert all(rail is None for ranks in w.rank_nics for _, rail in ranks)
