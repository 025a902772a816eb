"""One request's way through the simulated cluster, step by step, in order.

``Lifecycle.serve(d, finished)`` runs dispatch ``d`` (``workload.replay``'s ``Dispatch``):

    1. admit     the front end's overhead, then the admission gate when enabled
                 (``sim.steps.admit``; a rejected request finishes here)
    2. route     decode instance (given by the gate, else ``policy.routing.choose_decode``), then
                 a prefill instance of its group (the group's router, ``policy.routing``)
    3. lookup    the request's ``Prompt`` (``sim.prompt``), then GPU prefix cache, pool and
                 ``policy.hits`` (``sim.steps.lookup``)
    4. restore   pool -> every prefill rank, when the pool holds part of the prompt
                 (``sim.steps.restore``)
    5. compute   chunked prefill, then the GPU cache keeps the prompt (``sim.steps.compute``)
    6. save      the prompt's new chunks -> pool, in the background (``sim.steps.save``)
    7. hand-off  prefill stages -> decode ranks (``sim.steps.handoff``)
    8. decode    continuous batching on the decode instance (``DecodeInstance.generate``)
    9. finish    ``rec.end_s``; the gate's reservation goes back; after a play's last request
                 its kept prompts go; ``finished(d)`` (the replay releases what depends on it)

Each step is a callback that runs when the previous one is done (no SimPy process per request):
the simulator owns time and resources, and every decision is a policy-core call.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.policy.routing import choose_decode
from kvpool.sim.events import call_later
from kvpool.sim.prompt import Prompts
from kvpool.sim.request import Request
from kvpool.sim.steps.admit import Admit
from kvpool.sim.steps.compute import Compute
from kvpool.sim.steps.handoff import Handoff
from kvpool.sim.steps.lookup import Lookup
from kvpool.sim.steps.nics import PoolNics
from kvpool.sim.steps.restore import Restore
from kvpool.sim.steps.save import Save
from kvpool.sim.world import World
from kvpool.workload.records import RequestRecord


class Lifecycle:
    """The steps of every request of one world (see the module docstring); ``records``: one
    ``RequestRecord`` per request served, in arrival order."""

    def __init__(self, world: World) -> None:
        s = world.s
        self.world = world
        self.env = world.env
        self.records: list[RequestRecord] = []
        self.frontend_s = s.cost.frontend_overhead_s
        self.admit_step = Admit(world.env, world.gate) if world.gate is not None else None
        self.prompts = Prompts(world.keys, s.workload.shared_prefix_tokens)
        nics = PoolNics(world)
        self.lookup_step = Lookup(world)
        self.restore_step = Restore(world, nics)
        self.compute_step = Compute(world)
        self.save_step = Save(world, nics)
        self.handoff_step = Handoff(world)

    # 1. admit ---------------------------------------------------------------------------
    def serve(self, d, finished: Callable[[object], None]) -> None:
        req = d.request
        rec = RequestRecord(d.key, d.session.id, req.thread, d.measured, self.env.now, req.in_tokens,
                            max(1, d.out_tokens))
        self.records.append(rec)
        r = Request(d, rec, finished)
        if self.frontend_s:
            call_later(self.env, self.frontend_s, lambda _e: self.admit(r))
        else:
            self.admit(r)

    def admit(self, r: Request) -> None:
        if self.admit_step is None:
            self.route(r, None)
        else:
            self.admit_step.arrive(r.rec, lambda decode: self.route(r, decode), lambda: self.reject(r))

    def reject(self, r: Request) -> None:
        r.rec.end_s = self.env.now
        r.finished(r.d)

    # 2. route ---------------------------------------------------------------------------
    def route(self, r: Request, decode: int | None) -> None:
        w, d, rec = self.world, r.d, r.rec
        if decode is None:
            decode = choose_decode([dd.free_tokens for dd in w.decodes])
        rec.decode = decode
        group = w.group_prefills[decode]
        load = [w.prefills[i].outstanding_tokens for i in group]
        p = r.prefill = w.prefills[group[w.routers[decode].choose(d.scope or d.session.id, load)]]
        rec.prefill = p.index
        p.outstanding_tokens += rec.in_tokens
        r.decode = w.decodes[decode]
        self.lookup(r)

    # 3. lookup --------------------------------------------------------------------------
    def lookup(self, r: Request) -> None:
        r.prompt = self.prompts.build(r.d, r.prefill.index)
        self.lookup_step(r)
        if r.hits.pool_tokens:
            self.restore_step(r, lambda: self.compute(r))  # 4. restore
        else:
            self.compute(r)

    # 5. compute, 6. save ------------------------------------------------------------------
    def compute(self, r: Request) -> None:
        self.compute_step(r, lambda: self.computed(r))

    def computed(self, r: Request) -> None:
        groups = r.prompt.groups
        if self.world.pool is not None and groups.ids.size:
            skip = r.hits.pool_prefix_chunks  # held by every stage already
            new = groups.part(skip) if skip else groups
            if new.ids.size:
                self.save_step(r, new)
        self.handoff_step(r, lambda: self.decode(r))  # 7. hand-off

    # 8. decode --------------------------------------------------------------------------
    def decode(self, r: Request) -> None:
        env, rec = self.env, r.rec
        first, done = r.decode.generate(rec.in_tokens, rec.out_tokens)
        first.callbacks.append(lambda _e: setattr(rec, "first_token_s", env.now))
        done.callbacks.append(lambda _e: self.finish(r))

    # 9. finish --------------------------------------------------------------------------
    def finish(self, r: Request) -> None:
        r.rec.end_s = self.env.now
        if self.admit_step is not None:
            self.admit_step.release(r.rec.key)
        self.prompts.forget(r.d)
        r.finished(r.d)
