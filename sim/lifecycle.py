"""One request's way through the simulated cluster, step by step, in order.

``Lifecycle.serve(d, finished)`` runs dispatch ``d`` (``workload.replay``'s ``Dispatch``):

    1. admit     the front end's overhead (``cost.frontend_overhead_s``), then the admission
                 gate when enabled, else the gate's caps and the decode-aware choice as
                 production's router makes them without it (``sim.steps.admit``; a rejected
                 request finishes here); then the control plane's fixed time
                 (``cost.control_plane_s``)
    2. route     the decode instance its admission chose, then a prefill instance of its group
                 (``Routing.choose_prefill``, ``policy.routing``)
    3. lookup    the request's ``Prompt`` (``sim.prompt``); it waits, first come first served,
                 for pages for its whole prompt on its prefill (``sim.steps.pages``: its GPU
                 prefix cache hit is the pages it reuses), which it holds until its hand-off and
                 its save have both ended; then pool and ``policy.hits`` (``sim.steps.lookup``)
    4. restore   pool -> every prefill rank, when the pool holds part of the prompt
                 (``sim.steps.restore``)
    5. compute   chunked prefill in the engine's pipeline order, then its full pages are
                 committed to the GPU prefix cache (``sim.steps.compute``)
    6. save      the prompt's new chunks -> pool, beside the hand-off (``sim.steps.save``)
    7. hand-off  prefill stages -> decode ranks (``sim.steps.handoff``); once the hand-off and
                 the save have both ended its pages go back and the prefill answers with the
                 first token, as production's does
    8. decode    continuous batching on the decode instance (``DecodeInstance.generate``), which
                 generates the other ``out_tokens - 1`` tokens
    9. finish    ``rec.end_s``; the gate's reservation goes back; after a play's last request
                 its kept prompts go; ``finished(d)`` (the replay releases what depends on it)

Each step is a callback that runs when the previous one is done (no SimPy process per request):
the simulator owns time and resources, and every decision is a policy-core call. The record is
stamped as the request moves on (``gate_arrival_s``, ``admitted_s``, ``prefill_start_s``,
``compute_queued_s``, ``compute_start_s``, ``prefill_end_s``, ``decode_start_s``), which is what
the lane-time accounting reads (``workload.records.lane_time``).

Faults (``sim.faults``, the scenario's ``[faults]``; none by default, and then nothing here
schedules anything for them): after its lookup a request may hang (``rec.hung_from_s``), holding
what it reserved until it fails ``hang_s`` later; with ``request_timeout_s`` one that has no
first token that long after its admission fails then, unless it has joined a decode batch. A
failure (``fail``) sets ``rec.error`` and ``rec.end_s``, gives back the prefill's queue place and
the router's count of its tokens, its decode wait, and its gate reservation, and calls
``finished(d)`` so that its session goes on; a step still under way for it (a restore, a
hand-off) ends without going further. A restore may fail once its transfer is done
(``rec.restore_failed``: the request computes those tokens), and a save may be lost.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.sim.events import call_later
from kvpool.sim.faults import Faults
from kvpool.sim.prompt import Prompts
from kvpool.sim.request import COMPUTED, DECODING, QUEUED, Request
from kvpool.sim.steps.admit import Admit, Ungated
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
        self.control_s = world.control_plane_s
        self.faults = Faults(s) if s.faults.enabled else None
        self.min_load_tokens = s.pool.min_load_tokens
        self.admit_step = Admit(world.env, world.gate) if world.gate is not None else Ungated(world)
        self.prompts = Prompts(world.keys, world.page_keys, s.workload.shared_prefix_tokens)
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
        rec.lane = d.lane
        self.records.append(rec)
        r = Request(d, rec, finished)
        if self.frontend_s:
            call_later(self.env, self.frontend_s, lambda _e: self.admit(r))
        else:
            self.admit(r)

    def admit(self, r: Request) -> None:
        r.rec.gate_arrival_s = self.env.now
        self.admit_step.arrive(r.rec, lambda decode: self.admitted(r, decode), lambda: self.reject(r))

    def reject(self, r: Request) -> None:
        r.rec.end_s = self.env.now
        r.finished(r.d)

    def admitted(self, r: Request, decode: int) -> None:
        env = self.env
        r.rec.admitted_s = env.now
        f = self.faults
        if f is not None and f.timeout_s is not None:
            call_later(env, f.timeout_s, self._deadline, r)
        if self.control_s:
            call_later(env, self.control_s, lambda _e: self.route(r, decode))
        else:
            self.route(r, decode)

    # 2. route ---------------------------------------------------------------------------
    def route(self, r: Request, decode: int) -> None:
        w, d, rec = self.world, r.d, r.rec
        if rec.error:
            return
        rec.decode = decode
        load = [pp.outstanding_tokens for pp in w.prefills]
        p = r.prefill = w.prefills[w.routing.choose_prefill(decode, d.scope or d.session.id, load)]
        rec.prefill = p.index
        p.outstanding_tokens += rec.in_tokens
        r.decode = w.decodes[decode]
        self.lookup(r)

    # 3. lookup --------------------------------------------------------------------------
    def lookup(self, r: Request) -> None:
        """``r`` waits for its pages, then looks up."""
        r.prompt = self.prompts.build(r.d)
        r.prefill.pages.admit(r, lambda: self.looked_up(r), lambda _r: self.fail(r, "prefill_kv"))

    def looked_up(self, r: Request) -> None:
        self.lookup_step(r)
        f = self.faults
        if f is not None and f.hangs(r.rec.key, r.rec.computed_tokens >= self.min_load_tokens):
            self.hang(r)
        elif r.hits.pool_tokens:
            self.restore_step(r, lambda: self.restored(r))  # 4. restore
        else:
            self.compute(r)

    def restored(self, r: Request) -> None:
        rec = r.rec
        if rec.error:
            return
        f = self.faults
        failed = f is not None and f.restore_fails(rec.key)  # the transfer went, the hit did not
        r.prefill_request.loaded(not failed).write(rec, ssd_tokens=rec.ssd_tokens)
        self.compute(r)

    # 5. compute, 6. save ------------------------------------------------------------------
    def compute(self, r: Request) -> None:
        self.compute_step(r, lambda: self.computed(r))

    def computed(self, r: Request) -> None:
        r.stage = COMPUTED
        life = r.prefill_request
        life.computed()
        new = None
        if self.world.pool is not None:  # the chunks to save: policy.prefill_request's rule
            save = life.start_save(r.prompt.groups.ids.size)
            if save is not None:
                new = r.prompt.groups.part(save.first_chunk, save.end_chunk)
        if new is not None:
            f = self.faults
            self.save_step(r, new, f is not None and f.save_fails(r.rec.key), lambda: self.answer(r))
        self.handoff_step(r, lambda: self.handed_off(r))  # 7. hand-off

    def handed_off(self, r: Request) -> None:
        r.prefill_request.handed_off()
        self.answer(r)

    def answer(self, r: Request) -> None:
        """Once its hand-off and its save have both ended (``PrefillRequest.ended``, as the engine
        waits for them), its pages go back and the prefill answers with the first token
        (production's router streams it to the client then); the decode instance generates the
        other ``out_tokens - 1``."""
        if not r.prefill_request.ended:
            return
        r.prefill.pages.release(r)
        rec = r.rec
        if rec.error:
            return
        rec.first_token_s = self.env.now
        if rec.out_tokens <= 1:
            rec.decode_start_s = self.env.now
            self.finish(r)
            return
        self.decode(r)

    # 8. decode --------------------------------------------------------------------------
    def decode(self, r: Request) -> None:
        """``r`` joins its decode instance's batch, which generates every output token but the
        first, which the prefill gave: its KV holds the prompt and that token."""
        env, rec = self.env, r.rec
        if rec.error:
            return
        rec.decode_start_s = env.now
        r.stage = DECODING
        first, done = r.decode.generate(rec.in_tokens + 1, rec.out_tokens - 1)
        r.first_ev = first
        done.callbacks.append(lambda _e: self.finish(r))

    # 9. finish --------------------------------------------------------------------------
    def finish(self, r: Request) -> None:
        r.rec.end_s = self.env.now
        self.admit_step.release(r.rec.key)
        self.prompts.forget(r.d)
        r.finished(r.d)

    # faults -----------------------------------------------------------------------------
    def hang(self, r: Request) -> None:
        """``r`` hangs after its lookup, holding what it reserved, and fails ``hang_s`` later."""
        r.rec.hung_from_s = self.env.now
        call_later(self.env, self.faults.hang_s, lambda _e: self.fail(r, "hang") if not r.rec.error else None)

    def _deadline(self, call) -> None:
        """``request_timeout_s`` after admission: no first token yet (and not in a decode batch) fails it."""
        r = call.value
        rec = r.rec
        if rec.error or rec.end_s or rec.first_token_s:
            return
        if r.stage == DECODING and not r.decode.cancel(r.first_ev):
            return  # joined a batch: its first token comes within a step
        self.fail(r, "timeout")

    def fail(self, r: Request, why: str) -> None:
        """``r`` errors now (see the module docstring): what it holds goes back, its session goes on.
        A request at decode comes here only once its decode wait is dropped (``_deadline``)."""
        rec = r.rec
        rec.error = why
        rec.end_s = self.env.now
        p = r.prefill
        if p is not None and r.stage <= QUEUED:  # the router still counts its tokens
            p.outstanding_tokens -= rec.in_tokens
            if r.stage == QUEUED:
                p.cancel(r.compute_ev)
            if not p.pages.cancel(r):  # waiting for pages, or holding them
                p.pages.release(r)  # (its hand-off and save, once under way, give them back)
        self.admit_step.release(rec.key)
        self.prompts.forget(r.d)
        r.finished(r.d)
