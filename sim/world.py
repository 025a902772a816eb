"""The simulated cluster of one scenario, wired once: instances, pool, links, routers and the gate.

Contract:
    * ``World(s, cost=, unbounded=)`` builds everything a request meets on its way
      (``sim.lifecycle``): the SimPy environment, the cost model, the key space, the prefill and
      decode instances (each prefill with its paged KV and GPU prefix cache, ``sim.steps.pages``,
      keeping the prefill engine's pipeline order, ``PrefillInstance``; with a calibration that
      measured ``sharing`` the workers placed on ``kvpool serve``'s devices, ``sim.devices``), the
      pool (``None`` without one),
      the network (``sim.cluster.Network``), the SSD links, in a shared multi-server pool one link
      per rail for the other servers' NICs (``pool_rails``, ``sim.steps.nics``), the routing
      (``policy.routing.routing_for``: one router per decode group) and the admission gate
      (``None`` when disabled; ``gate_config`` holds its caps either way). It holds no request state
      and decides nothing.
    * One set of mechanisms: what differs between a planning run and a serve-sized run is data,
      the capacities (``kvpool.scenario.derive``: from HBM, or ``serve.*`` with
      ``cost.kv_capacity = "serve"``) and the costs (analytic, or ``cost.calibration``).
    * ``unbounded``: GPU prefix caches of more pages than any run uses and a pool of 1 PiB (the
      trace-ceiling check).
    * Ranks: prefill rank ``r = stage * tp + t`` holds stage ``r // tp``'s layers (the MLA latent
      is replicated over TP); ``rank_bytes[r]`` is the size of one chunk object of rank ``r``.
    * The time series (``timeline``) are sampled by ``sample_pool`` (after every save) and by the
      decode instances' occupancy reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import simpy

from kvpool.policy.admission import AdmissionGate, GateConfig
from kvpool.policy.chunks import namespace_for
from kvpool.policy.routing import routing_for
from kvpool.scenario.derive import decode_kv_capacity_tokens, prefill_kv_capacity_tokens
from kvpool.scenario.model import Scenario
from kvpool.sim.cluster import Network, place
from kvpool.sim.cost import CostModel, cost_model
from kvpool.sim.devices import shared_devices
from kvpool.sim.instances import DecodeInstance, PrefillInstance
from kvpool.sim.keys import KeySpace
from kvpool.sim.links import FairLink
from kvpool.sim.pool import SimPool
from kvpool.sim.steps.pages import PrefillPages

#: pages of a prefill's GPU prefix cache in an unbounded world: more than any run uses (a page's
#: state is kept only once it is used, ``policy.pagecache``)
UNBOUNDED_PAGES = 1 << 40


@dataclass
class Timeline:
    """Time series sampled during the run (for plots)."""

    pool_t: list[float] = field(default_factory=list)
    pool_used: list[float] = field(default_factory=list)
    pool_evicted: list[int] = field(default_factory=list)
    decode_t: list[float] = field(default_factory=list)
    decode_occ: list[float] = field(default_factory=list)


class World:
    """One scenario's cluster (see the module docstring)."""

    def __init__(self, s: Scenario, *, cost: CostModel | None = None, unbounded: bool = False) -> None:
        self.s = s
        self.env = env = simpy.Environment()
        self.cost = cost or cost_model(s)
        #: fixed time per admitted request before its lookup: the calibration's, else cost.control_plane_s
        self.control_plane_s = getattr(self.cost, "control_plane_s", s.cost.control_plane_s)
        self.spec = spec = s.kvspec()
        self.chunk_tokens = s.pool.chunk_tokens
        self.keys = KeySpace(namespace_for(spec, s.pool.chunk_tokens), s.pool.chunk_tokens)
        #: the prefill pages' names (``sim.prompt``): chunks of one page
        self.page_keys = KeySpace(namespace_for(spec, s.model.page_tokens), s.model.page_tokens)
        self.layout = place(s)
        self.net = Network(env, s)
        self.timeline = Timeline()
        tp = s.prefill.tp
        self.rank_stage = [r // tp for r in range(s.prefill.pp * tp)]
        self.rank_bytes = [spec.chunk_object_bytes(st, self.chunk_tokens) for st in self.rank_stage]
        self.pool = _pool(s, self.rank_bytes, unbounded)
        self._pool_capacity = max(1, self.pool.capacity_bytes) if self.pool is not None else 1
        page = s.model.page_tokens
        num_pages = UNBOUNDED_PAGES if unbounded else max(1, prefill_kv_capacity_tokens(s) // page)
        self.prefills = [
            PrefillInstance(env, i, pl.server, pl.gpus, pp=s.prefill.pp, tp=tp,
                            max_batched_tokens=s.prefill.max_batched_tokens, cost=self.cost,
                            pages=PrefillPages(num_pages, page, self.page_keys), page_tokens=page,
                            spread_requests=s.prefill.spread_requests, load_workers=s.cost.load_workers_per_stage)
            for i, pl in enumerate(self.layout.prefill)
        ]
        self.decodes = [
            DecodeInstance(env, i, pl.server, pl.gpus, capacity_tokens=decode_kv_capacity_tokens(s),
                           max_seqs=s.decode.max_seqs, tokens_per_step=s.decode.mtp_accept_tokens, cost=self.cost,
                           on_occupancy=self._decode_occupancy)
            for i, pl in enumerate(self.layout.decode)
        ]
        self._share_devices()
        self._decode_capacity_tokens = sum(d.capacity_tokens for d in self.decodes)
        #: the decode groups' prefill instances and routers, built as production builds them
        self.routing = routing_for(s.routing.prefill, s.seed, len(self.prefills), len(self.decodes))
        #: the gate's caps, which hold without the gate too (``policy.admission.refusal``), as in production
        self.gate_config = GateConfig(s.gate.tokens_per_decode, s.gate.budget_fraction, s.gate.max_input_tokens,
                                      s.gate.max_output_tokens, s.gate.max_wait_s)
        self.gate = AdmissionGate(self.gate_config, len(self.decodes)) if s.gate.enabled else None
        ssd = s.pool.ssd
        self.ssd_links = [FairLink(env, ssd.read_gb_s_per_server * 1e9, name=f"ssd{i}") for i in range(s.cluster.servers)]
        self.gpus = s.prefill.instances * s.prefill.gpus + s.decode.instances * s.decode.gpus
        #: per rail, in a shared multi-server pool: one link standing for the other servers' NICs
        #: of that rail, which carry their part of every pool transfer (sim.steps.nics); else none
        self.pool_rails = self._pool_rails()
        #: per prefill, per rank: its own NIC and its rail's link for the other servers' part (or None)
        self.rank_nics = [[self._nics_of(p, rank) for rank in range(p.ranks)] for p in self.prefills]

    def _share_devices(self) -> None:
        """With a calibration that measured ``sharing``: the workers on ``kvpool serve``'s devices,
        each slowed by the others computing there (``sim.devices``)."""
        sharing = getattr(self.cost, "sharing", None)
        if sharing is None:
            return
        stages, decodes = shared_devices(self.s, sharing.decode_slowdown_per_worker, sharing.prefill_slowdown_per_worker)
        for p, placements in zip(self.prefills, stages, strict=True):
            p.placements = placements
        for d, placement in zip(self.decodes, decodes, strict=True):
            d.share_devices(placement)

    def _pool_rails(self) -> list[FairLink]:
        c, g = self.s.cluster, self.s.gpu
        if self.pool is None or self.pool.mode != "shared" or c.servers < 2:
            return []
        others = c.servers - 1  # a rail's NICs on the other servers, as one link of their rate
        return [FairLink(self.env, others * g.nic_gb_s * 1e9, latency_s=g.nic_latency_us * 1e-6,
                         writes_per_s=others * g.nic_writes_per_s, name=f"pool-rail{rail}")
                for rail in range(c.gpus_per_server)]

    def _nics_of(self, p: PrefillInstance, rank: int) -> tuple[FairLink, FairLink | None]:
        gpu = p.rank_gpu(rank)
        rail = self.pool_rails[gpu % self.s.cluster.gpus_per_server] if self.pool_rails else None
        return self.net.nic[gpu], rail

    def _decode_occupancy(self, now: float, _frac: float) -> None:
        cap = self._decode_capacity_tokens
        self.timeline.decode_t.append(now)
        self.timeline.decode_occ.append(sum([d.reserved_tokens for d in self.decodes]) / cap if cap else 0.0)

    def sample_pool(self) -> None:
        """Append the pool's used fraction and evicted groups now to the time series."""
        pool = self.pool
        if pool is None:
            return
        tl = self.timeline
        tl.pool_t.append(self.env.now)
        tl.pool_used.append(pool.used_bytes / self._pool_capacity)
        tl.pool_evicted.append(pool.evicted_groups)


def _pool(s: Scenario, rank_bytes: list[int], unbounded: bool) -> SimPool | None:
    """The scenario's pool (``None`` without one); ``unbounded``: one service of 1 PiB."""
    if unbounded:
        s = s.model_copy(update={"pool": s.pool.model_copy(update={"gib_per_service": 1 << 20, "services_per_server": 1})})
    return SimPool(s, rank_bytes) if s.pool.services_per_server and s.pool.gib_per_service else None
