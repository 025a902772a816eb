"""The simulation of one load: a scenario's cluster serving a replay schedule, in SimPy.

Each request (``Simulation._serve``) goes: admission gate (``policy.admission``, when enabled) ->
decode group (``policy.routing.choose_decode``) -> prefill instance (the group's router:
``policy.routing``) -> lookup: GPU prefix cache + one batched pool check of every rank x chunk
(``policy.chunks`` keys via ``sim.keys``) -> ``policy.hits`` -> restore per rank over its NIC
(load worker, bytes / fair share + per-write cost + unpack; the request waits for every rank
while others compute) -> chunked prefill -> GPU cache insert + asynchronous save of new chunks
(group ids, ``policy.grouptable`` eviction) -> handoff to decode per stage (``policy.layout``
write plan) -> decode (continuous batching) -> finish (the replay releases what depends on it).

The simulator owns time and resources; every decision is a policy-core call.
"""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass, field
from heapq import heappush

import numpy as np
import simpy
from simpy.events import URGENT

from kvpool.policy.admission import AdmissionGate, GateConfig, Verdict
from kvpool.policy.chunks import namespace_for
from kvpool.policy.hits import compute_hits
from kvpool.policy.layout import HandoffPlan, handoff_counts
from kvpool.policy.routing import choose_decode, make_router
from kvpool.scenario.derive import decode_kv_capacity_tokens, prefill_kv_capacity_tokens
from kvpool.scenario.model import Scenario
from kvpool.sim.cluster import Network, place
from kvpool.sim.cost import AnalyticalCost, CostModel
from kvpool.sim.events import Call, call_later, fire, run_all
from kvpool.sim.gpucache import GPUPrefixCache, LogEntry, same
from kvpool.sim.instances import DecodeInstance, PrefillInstance
from kvpool.sim.keys import SHARED_PREFIX_SCOPE, KeySpace
from kvpool.sim.links import FairLink, Join
from kvpool.sim.metrics import RequestRecord
from kvpool.sim.pool import SimPool


class _Ids:
    """A thread's block ids and their GPU cache ids, in buffers with room to grow: a request whose
    ids extend the list at a buffer's tip (its thread's last prompt, typically) writes only its
    new ids past it, and its lists are views of the same buffers. Ids are only ever written past
    the tip, so every earlier view (a log entry of the GPU cache, a key space's last list) keeps
    its ids."""

    __slots__ = ("blocks", "gblocks", "tip")

    def __init__(self, capacity: int, dtype) -> None:
        self.blocks = np.empty(capacity, dtype=dtype)
        self.gblocks = np.empty(capacity, dtype=np.int64)
        self.tip = 0  # ids written (every view handed out lies below)


@dataclass
class _PlayState:
    """What a play's next requests reuse, per thread: its last request's block ids (a later
    prompt's prefix references end there) and the GPU cache entry of its last insert on a prefill
    instance. Dropped when the play's last request is served."""

    blocks: dict[int, np.ndarray] = field(default_factory=dict)  # request index -> block ids
    gblocks: dict[int, np.ndarray] = field(default_factory=dict)  # request index -> GPU cache ids
    bufs: dict[int, _Ids] = field(default_factory=dict)  # request index -> the buffers of its lists
    last_request: dict[int, int] = field(default_factory=dict)  # thread -> request index
    gpu_entry: dict[int, tuple[int, LogEntry | None, int]] = field(default_factory=dict)  # thread -> (prefill, entry, request)

    def block_ids(self, d, off: int, lists=None) -> tuple[np.ndarray, np.ndarray, int, int, np.ndarray | None]:
        """Dispatch ``d``'s block ids and their ids in the GPU cache (``off`` + each: the play's
        offset from ``keys.block_offset``), kept as its thread's latest, and ``(r, n, ids_r)``: its
        first ``n`` ids are those of kept request ``r``'s list ``ids_r`` (-1, 0, None: none),
        whose cache ids they take too (same play, same offset). Both lists are views of
        ``_Ids`` buffers (read-only by contract). ``lists``: the store's ``lists()``, if kept."""
        req = d.request
        store = d.session.blocks
        pieces, r, n = store.pieces_from(req.index, self.blocks, lists)
        total = int(store.n_blocks[req.index]) if lists is None else lists[3][req.index]
        src = self.blocks.get(r) if n else None
        buf = self.bufs.get(r) if n else None
        if buf is None or n != src.size or buf.tip != n or buf.blocks.size < total:
            old = buf
            buf = _Ids(max(2 * total, 64), store.tail.dtype)  # room for the thread's next prompts
            if n:
                buf.blocks[:n] = src[:n]
                buf.gblocks[:n] = (old.gblocks if old is not None else self.gblocks[r])[:n]
        blocks, gblocks, tail = buf.blocks, buf.gblocks, store.tail
        for at, start, count in pieces:  # past the tip: no view handed out covers them
            blocks[at:at + count] = tail[start:start + count]
            gblocks[at:at + count] = tail[start:start + count]
        if n < total:  # the new ids' cache ids: one add over them all
            new = gblocks[n:total]
            np.add(new, off, out=new)
        buf.tip = total
        blocks, gblocks = blocks[:total], gblocks[:total]
        old = self.last_request.get(req.thread)
        if old is not None:
            self.blocks.pop(old, None)
            self.gblocks.pop(old, None)
            self.bufs.pop(old, None)
        self.blocks[req.index] = blocks
        self.gblocks[req.index] = gblocks
        self.bufs[req.index] = buf
        self.last_request[req.thread] = req.index
        return blocks, gblocks, r, n, src


@dataclass
class Timeline:
    """Time series sampled during the run (for plots)."""

    pool_t: list[float] = field(default_factory=list)
    pool_used: list[float] = field(default_factory=list)
    pool_evicted: list[int] = field(default_factory=list)
    decode_t: list[float] = field(default_factory=list)
    decode_occ: list[float] = field(default_factory=list)


class Simulation:
    """One scenario, one replay schedule; ``run()`` returns the per-request records."""

    def __init__(self, s: Scenario, replay, *, cost: CostModel | None = None, unbounded: bool = False) -> None:
        """``replay``: an AgentXReplay or ProductionReplay (sim.workload.replay's driver interface).
        ``unbounded``: infinite GPU caches and pool (the trace-ceiling check)."""
        self.s = s
        self.replay = replay
        self.env = env = simpy.Environment()
        self.cost = cost or AnalyticalCost.from_scenario(s)
        self.spec = spec = s.kvspec()
        self.chunk_tokens = s.pool.chunk_tokens
        self.keys = KeySpace(namespace_for(spec, s.pool.chunk_tokens), s.pool.chunk_tokens)
        self.rng = random.Random(s.seed)
        self.layout = place(s)
        self.net = Network(env, s)
        self.timeline = Timeline()
        tp = s.prefill.tp
        # rank r = stage * tp + t holds stage r // tp's layers (MLA latent replicated over TP)
        self.rank_stage = [r // tp for r in range(s.prefill.pp * tp)]
        rank_bytes = [spec.chunk_object_bytes(st, self.chunk_tokens) for st in self.rank_stage]
        self.rank_bytes = rank_bytes
        if unbounded:
            s = s.model_copy(update={"pool": s.pool.model_copy(update={"gib_per_service": 1 << 20, "services_per_server": 1})})
        self.pool = SimPool(s, rank_bytes) if s.pool.services_per_server and s.pool.gib_per_service else None
        cache_tokens = None if unbounded else prefill_kv_capacity_tokens(s)
        self.prefills = [
            PrefillInstance(env, i, pl.server, pl.gpus, pp=s.prefill.pp, tp=tp,
                            max_batched_tokens=s.prefill.max_batched_tokens, cost=self.cost,
                            cache=GPUPrefixCache(cache_tokens), load_workers=s.cost.load_workers_per_stage)
            for i, pl in enumerate(self.layout.prefill)
        ]
        self._rank_nics = [self._nics_of(p) for p in self.prefills]
        self.decodes = [
            DecodeInstance(env, i, pl.server, pl.gpus, capacity_tokens=decode_kv_capacity_tokens(s),
                           max_seqs=s.decode.max_seqs, tokens_per_step=s.decode.mtp_accept_tokens, cost=self.cost,
                           on_occupancy=self._decode_occupancy)
            for i, pl in enumerate(self.layout.decode)
        ]
        self._decode_capacity_tokens = sum(d.capacity_tokens for d in self.decodes)
        self.group_prefills = [[p.index for p, pl in zip(self.prefills, self.layout.prefill) if pl.group == g]
                               for g in range(len(self.decodes))]
        self.routers = [make_router(s.routing.prefill, random.Random(self.rng.random())) for _ in self.decodes]
        self.gate = (AdmissionGate(GateConfig(s.gate.tokens_per_decode, s.gate.budget_fraction, s.gate.max_input_tokens,
                                              s.gate.max_output_tokens, s.gate.max_wait_s), len(self.decodes))
                     if s.gate.enabled else None)
        self._gate_waiters: dict[object, simpy.Event] = {}  # request key -> its wait's end (the decode given)
        self.records: list[RequestRecord] = []
        self._session_max_block: dict[str, int] = {}
        self._store_lists: dict[str, tuple] = {}  # session id -> its BlockStore.lists()
        self._plays: dict[int, _PlayState] = {}
        self._pool_capacity = max(1, self.pool.capacity_bytes) if self.pool is not None else 1  # fixed
        ssd = s.pool.ssd
        self.ssd_links = [FairLink(env, ssd.read_gb_s_per_server * 1e9, name=f"ssd{i}") for i in range(s.cluster.servers)]
        self.gpus = s.prefill.instances * s.prefill.gpus + s.decode.instances * s.decode.gpus
        self._stage_layers = [len(spec.stage_layer_ids(st)) for st in range(spec.stages)]
        self._distinct_stage_layers = sorted(set(self._stage_layers))
        self._stage_bpt = list(spec.stage_bytes_per_token)
        self._page_tokens = s.model.page_tokens
        self._record_bytes = s.model.record_bytes
        self._max_write_bytes = s.handoff.max_write_bytes
        nic = self.net.nic
        # hand-off links: each stage's first rank's NIC per prefill, each decode rank's NIC per decode
        self._stage_nics = [[nic[p.rank_gpu(st * tp)] for st in range(spec.stages)] for p in self.prefills]
        self._decode_nics = [[nic[d.gpus[r % len(d.gpus)]] for r in range(s.decode.dcp)] for d in self.decodes]
        self._min_load_tokens = s.pool.min_load_tokens
        self._handoff_bpt = sum(self._stage_bpt)
        # one range of GPU cache ids for the prefix every session shares (taken first, so each
        # scope's own range lies above it); chunk keys then come from global ids under one chain
        self._shared_prefix_tokens = s.workload.shared_prefix_tokens
        self._frontend_s = s.cost.frontend_overhead_s
        shared_base = (self.keys.block_offset(SHARED_PREFIX_SCOPE, self._shared_prefix_tokens)
                       if self._shared_prefix_tokens else 0)
        self._shared_ids = np.arange(shared_base, shared_base + self._shared_prefix_tokens, dtype=np.int64)
        for layers in self._distinct_stage_layers:  # the plan's checks, once (per request: handoff_counts)
            HandoffPlan(tokens=0, layers=layers, record_bytes=s.model.record_bytes, ranks=s.decode.dcp,
                        max_write_bytes=s.handoff.max_write_bytes)
        self._dcp = s.decode.dcp
        self._stage_depths = [(layers, self._stage_layers.count(layers)) for layers in self._distinct_stage_layers]

    # -- time series -----------------------------------------------------------------------
    def _decode_occupancy(self, now: float, _frac: float) -> None:
        cap = self._decode_capacity_tokens
        self.timeline.decode_t.append(now)
        self.timeline.decode_occ.append(sum([d.reserved_tokens for d in self.decodes]) / cap if cap else 0.0)

    def _sample_pool(self) -> None:
        pool = self.pool
        if pool is None:
            return
        tl = self.timeline
        tl.pool_t.append(self.env.now)
        tl.pool_used.append(pool.used_bytes / self._pool_capacity)
        tl.pool_evicted.append(pool.evicted_groups)

    # -- the driver (sim.workload.replay's interface) ------------------------------------------
    def run(self) -> list[RequestRecord]:
        env = self.env
        # The cyclic collector is off while the model runs (unless the caller turned it off): a run
        # leaves no cyclic garbage to speak of (14 objects after the one-server hour, the four-server
        # and the replay points alike; peak RSS the same), and its collections cost 2-3 % of the
        # hour (young generations) plus a full scan of the workload (~0.2 s) when the replay's
        # first plays set one off.
        enabled = gc.isenabled()
        if enabled:
            gc.disable()
        try:
            self._start_driver()
            run_all(env)  # env.run(), its step written into the loop
        finally:
            if enabled:
                gc.enable()
        return self.records

    def _start_driver(self) -> None:
        """Drive the replay (sim.workload.replay's interface) with callbacks, no driver process:
        ``start`` now, ``finished`` as each request completes, ``poll`` when the newest
        ``Wake.next_due_s`` comes; every Wake's ready dispatches are issued at once. One timer is
        pending at a time; a Wake that moves the due time makes it stale (ignored by a version
        counter), one that keeps it adds no event.

        A request is a chain of callbacks (``_serve``) started where a SimPy process would have
        started (an urgent queue entry now: the process's ``Initialize`` slot); with the admission
        gate it is a process (``_serve_gated``: the gate's wait is a generator)."""
        env = self.env
        replay = self.replay
        timer = [0, None]  # version, due time of the pending timer (None: none)
        queue = env._queue
        eid = env._eid

        def finished(d) -> None:
            handle(replay.finished(d.key, env.now))

        def run_one(d):
            yield from self._serve_gated(d)
            finished(d)

        def begin(ev) -> None:
            self._serve(ev._value, finished)

        gated = self.gate is not None

        def handle(w) -> None:
            for d in w.ready:
                if gated:
                    env.process(run_one(d))
                else:  # a process's Initialize slot: now, urgent, the next sequence number
                    heappush(queue, (env._now, URGENT, next(eid), Call(begin, d)))
            due = None if w.done else w.next_due_s
            if due != timer[1]:
                timer[0] += 1
                timer[1] = due
                if due is not None:
                    call_later(env, max(0.0, due - env.now), on_timer, timer[0])

        def on_timer(ev) -> None:
            if ev._value == timer[0]:  # not superseded by a later Wake
                timer[1] = None
                handle(replay.poll(env.now))

        handle(replay.start(env.now))

    # -- one request -------------------------------------------------------------------------
    def _admit(self, rec: RequestRecord):
        """Wait at the gate (``policy.admission``: its waiting discipline); returns the decode
        instance index or None when rejected (``rec.rejected`` set).

        A waiting request's process waits on its event (a release admits it: ``_release_gate``)
        or its deadline, where the gate rejects it unless a release came first.
        """
        gate = self.gate
        key = rec.key
        env = self.env
        admission = gate.arrive(key, rec.in_tokens, rec.out_tokens, env.now)
        if admission.verdict is Verdict.ADMITTED:
            return admission.decode
        if admission.verdict is Verdict.WAIT:
            ev = env.event()
            self._gate_waiters[key] = ev
            # SimPy adds the delay to now as the gate does: the timeout is at admission.deadline_s, bit for bit
            yield ev | env.timeout(gate.config.max_wait_s)
            if not gate.expire(key):  # a release admitted it (at the deadline too, if it came first)
                return ev.value
            del self._gate_waiters[key]
            rec.rejected = Verdict.REJECT_TIMEOUT.value
            return None
        rec.rejected = admission.verdict.value
        return None

    def _release_gate(self, key) -> None:
        """Give back ``key``'s reservation; each waiter the gate admits resumes with its decode
        instance, in the gate's order."""
        waiters = self._gate_waiters
        for wkey, decode in self.gate.release(key):
            waiters.pop(wkey).succeed(decode)

    def _record(self, d) -> RequestRecord:
        req = d.request
        rec = RequestRecord(d.key, d.session.id, req.thread, d.measured, self.env.now, req.in_tokens,
                            max(1, d.out_tokens))
        self.records.append(rec)
        return rec

    def _serve(self, d, finished) -> None:
        """One request without the gate, as callbacks: front end -> decode group -> prefill ->
        hand-off -> decode; ``finished(d)`` once it is done. Each step runs where the request's
        process resumed (the same callback slot of the same event, or the same queue entry)."""
        env = self.env
        rec = self._record(d)
        if self._frontend_s:
            call_later(env, self._frontend_s, lambda _e: self._route(d, rec, None, finished))
        else:
            self._route(d, rec, None, finished)

    def _serve_gated(self, d):
        """One request through the admission gate (a SimPy process: the gate's wait is one)."""
        env = self.env
        rec = self._record(d)
        if self._frontend_s:
            yield env.timeout(self._frontend_s)
        decode = yield from self._admit(rec)
        if decode is None:
            rec.end_s = env.now
            return
        done = env.event()
        self._route(d, rec, decode, lambda _d: fire(done))
        try:
            yield done
        finally:
            if not rec.rejected:
                self._release_gate(rec.key)
        self._forget(d)

    def _route(self, d, rec: RequestRecord, decode: int | None, then) -> None:
        """Decode group (``decode``: given by the gate, else chosen), prefill instance, and the
        request's way through them; ``then(d)`` when its last token is out (``rec.end_s`` set)."""
        env = self.env
        req = d.request
        if decode is None:
            decode = choose_decode([dd.free_tokens for dd in self.decodes])
        rec.decode = decode
        group = self.group_prefills[decode] or list(range(len(self.prefills)))
        load = [self.prefills[i].outstanding_tokens for i in group]
        p = self.prefills[group[self.routers[decode].choose(d.scope or d.session.id, load)]]
        rec.prefill = p.index
        p.outstanding_tokens += req.in_tokens
        dec = self.decodes[decode]
        gated = self.gate is not None

        def decoded(_e) -> None:
            rec.end_s = env.now
            if not gated:
                self._forget(d)
            then(d)

        def handed_off() -> None:
            first, done = dec.generate(req.in_tokens, rec.out_tokens)
            # the first token is noted by a callback (where the process resumed to note it)
            first.callbacks.append(lambda _e: setattr(rec, "first_token_s", env.now))
            done.callbacks.append(decoded)

        self._prefill(d, rec, p, lambda: self._handoff(rec, p, dec, handed_off))

    def _forget(self, d) -> None:
        """After a play's last request: its key scope and play state go."""
        if d.request.index == len(d.session.requests) - 1:
            if d.scope:
                self.keys.forget_scope(d.scope)
            self._plays.pop(d.play, None)

    def _prefill(self, d, rec: RequestRecord, p: PrefillInstance, then) -> None:
        """Lookup (GPU cache, pool), restore, compute, GPU cache insert and the save of new
        chunks; ``then()`` once the prompt is computed (callbacks where the request's process
        resumed)."""
        env = self.env
        req = d.request
        session = d.session
        bt = session.block_tokens
        play = self._plays.get(d.play)
        if play is None:
            play = self._plays[d.play] = _PlayState()
        max_block = self._max_block_id(session)
        off = self.keys.block_offset(d.scope, max_block)
        lists = self._store_lists.get(session.id)
        if lists is None:
            lists = self._store_lists[session.id] = session.blocks.lists()
        blocks, gblocks, src, src_n, src_ids = play.block_ids(d, off, lists)  # gblocks: ids in the GPU cache
        if self._shared_prefix_tokens:
            if req.thread == 0:  # the main thread's prompts open with the shared prefix
                gblocks = gblocks.copy()  # (the kept ids stay the plain ones other threads copy)
                k = min(self._shared_prefix_tokens // bt, gblocks.size)
                gblocks[:k] = self._shared_ids[:k]
            gids = self.keys.chunk_gids(d.scope, req.thread, gblocks, bt, req.in_tokens, chain_scope="")
        else:
            gids = self.keys.chunk_gids(d.scope, req.thread, blocks, bt, req.in_tokens,
                                        prefix=(src_ids, src_n) if src_n else None)
        full_blocks = min(gblocks.size, req.in_tokens // bt)
        prompt = gblocks[:full_blocks]
        last = play.gpu_entry.get(req.thread)  # (prefill index, the thread's last insert, its request)
        lead = None  # that insert, on this prefill, when its blocks lead this prompt: known when
        # this prompt's ids were copied from that request's (far enough), else compared
        if last is not None and last[0] == p.index and last[1] is not None:
            e = last[1]
            k = e.ids.size
            if k <= prompt.size and ((last[2] == src and k <= src_n) or same(e.ids, prompt[:k])):
                lead = e
        run, hit_entry = p.cache.use(prompt, env.now, max_id=off + max_block, lead=lead)
        gpu_hit = run * bt
        top = self.keys.groups - 1  # a bound on every group id of this request
        present = runs = on_ssd = None
        if self.pool is not None and gids.size:
            if self.pool.ssd is None:  # each rank's leading run is all the hit needs
                runs = self.pool.lookup_runs(p.server, p.ranks, gids, env.now, top)
            else:  # a chunk on the SSD tier counts for every stage
                present = self.pool.lookup(p.server, p.ranks, gids, env.now)
                on_ssd = self.pool.ssd_lookup(p.server, gids, env.now)
                in_dram = np.logical_and.reduce(present)
                present = present | on_ssd  # [rank, chunk]
        hits = compute_hits(req.in_tokens, gpu_hit, present, chunk_tokens=self.chunk_tokens, page_tokens=self._page_tokens,
                            min_load_tokens=self._min_load_tokens, stage_runs=runs)
        rec.gpu_tokens = hits.gpu_tokens
        rec.pool_tokens = hits.pool_tokens
        rec.computed_tokens = hits.computed_tokens
        rec.prefill_start_s = env.now

        def compute() -> None:
            done = p.compute(rec.computed_tokens, req.in_tokens - rec.computed_tokens)  # context: every reused token
            done.callbacks.append(computed)

        def computed(_e) -> None:
            nonlocal last
            rec.prefill_end_s = env.now
            p.outstanding_tokens -= req.in_tokens
            now_last = play.gpu_entry.get(req.thread)
            if now_last is last and lead is not None:  # checked above: a prefix of the prompt
                entry = p.cache.insert(prompt, env.now, bt, max_id=off + max_block, prefixes=(hit_entry, lead))
            else:
                last = now_last
                entry = p.cache.insert(prompt, env.now, bt, max_id=off + max_block, prefixes=(hit_entry,),
                                       replaces=(last[1],) if last is not None and last[0] == p.index else ())
            play.gpu_entry[req.thread] = (p.index, entry, req.index)
            if self.pool is not None and gids.size:
                new = gids[hits.pool_prefix_chunks:] if hits.pool_prefix_chunks else gids
                if new.size:
                    self._save(rec, p, new)
            then()

        if not hits.pool_tokens:
            compute()
            return
        load_ids = gids[hits.load_first_chunk:hits.load_end_chunk]
        ssd_ids = load_ids[~in_dram[hits.load_first_chunk:hits.load_end_chunk]] if on_ssd is not None else load_ids[:0]

        def restore() -> None:
            self.pool.pin(p.server, p.ranks, load_ids, top)
            self._restore(rec, p, load_ids.size, restored)

        def restored() -> None:
            self.pool.unpin(p.server, p.ranks, load_ids, top)
            compute()

        if ssd_ids.size:  # read from SSD first, then the chunks travel like DRAM ones
            rec.ssd_tokens = min(hits.pool_tokens, ssd_ids.size * self.chunk_tokens)
            rec.pool_tokens -= rec.ssd_tokens

            def promote(_e) -> None:
                self.pool.save(p.server, p.ranks, ssd_ids, env.now)  # promoted back to DRAM
                restore()

            self.ssd_links[p.server].transfer(int(ssd_ids.size) * sum(self.rank_bytes), int(ssd_ids.size)).callbacks.append(promote)
        else:
            restore()

    def _max_block_id(self, session) -> int:
        """The largest block id a session uses (bounds its id range in the GPU cache), memoized."""
        got = self._session_max_block.get(session.id)
        if got is None:
            tail = session.blocks.tail
            got = self._session_max_block[session.id] = int(tail.max()) if tail.size else 0
        return got

    def _rank_links(self, p: PrefillInstance, rank: int, nbytes: int, writes: int, j: Join) -> None:
        """Transfers between the pool and prefill rank ``rank``, counted by ``j``: its own NIC
        carries every byte; in a shared multi-server pool, the remote servers' NICs on the same
        rail carry their share."""
        own, remotes = self._rank_nics[p.index][rank]
        own.transfer(nbytes, writes, j)
        if remotes:
            servers = self.s.cluster.servers
            share = nbytes // servers
            if share:
                for link in remotes:
                    link.transfer(share, max(1, writes // servers), j)

    def _nics_of(self, p: PrefillInstance) -> list[tuple[FairLink, list[FairLink]]]:
        """Per rank of ``p``: its own NIC and, in a shared multi-server pool, the NICs of the other
        servers on its rail (in server order), which carry their share of its pool traffic."""
        out = []
        shared = self.pool is not None and self.pool.mode == "shared" and self.s.cluster.servers > 1
        for rank in range(p.ranks):
            gpu = p.rank_gpu(rank)
            rail = gpu % self.s.cluster.gpus_per_server
            remotes = [self.net.rail_nic(srv, rail) for srv in range(self.s.cluster.servers) if srv != p.server] if shared else []
            out.append((self.net.nic[gpu], remotes))
        return out

    def _restore(self, rec: RequestRecord, p: PrefillInstance, chunks: int, then) -> None:
        """Every rank loads its objects of ``chunks`` chunks on its load worker, after the forwards
        queued ahead of its stage; ``then()`` is called when every rank is done (where an event
        that succeeds then would run its callbacks).

        Written as callbacks (no process per rank): one rank's load is delay -> worker -> links ->
        read + unpack -> worker free."""
        env = self.env
        ranks = p.ranks
        starts, ends = [0.0] * ranks, [0.0] * ranks
        left = [ranks]
        load_s = self.cost.pool_load_s

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
            self._rank_links(p, rank, nbytes, chunks, Join(env, lambda: call_later(env, load_s(nbytes), lambda _f: finish(rank))))

        for rank in range(ranks):
            delay = self.rank_stage[rank] * p.step_s  # the forwards queued ahead of this stage
            submit = p.loaders[rank].submit
            if delay:
                call_later(env, delay, lambda _e, r=rank, sub=submit: sub(lambda: start(r)))
            else:
                submit(lambda r=rank: start(r))

    def _save(self, rec: RequestRecord, p: PrefillInstance, gids: np.ndarray) -> None:
        """Every rank packs its objects of the new chunks (in parallel) and puts them with group
        ids; runs in the background (callbacks: pack -> links -> put)."""
        env = self.env
        nbytes = [gids.size * b for b in self.rank_bytes]

        def put() -> None:
            self.pool.save(p.server, p.ranks, gids, env.now, self.keys.groups - 1)
            rec.save_bytes += sum(nbytes)
            self._sample_pool()

        def send(_e) -> None:
            j = Join(env, put)
            for r in range(p.ranks):
                self._rank_links(p, r, nbytes[r], int(gids.size), j)

        call_later(env, self.cost.unpack_s(max(nbytes)), send)  # pack

    def _handoff(self, rec: RequestRecord, p: PrefillInstance, dec: DecodeInstance, then) -> None:
        """Every stage gathers its layers of every token per decode rank and sends them in large
        writes (``policy.layout``); each decode rank receives its tokens from every stage.
        ``then()`` is called when the last rank has its tokens (``rec.handoff_s`` set)."""
        env = self.env
        start = env.now
        tokens = rec.in_tokens
        # the main records' write plan per distinct stage depth (the seed's landing path); the
        # stages' extra records (DSA index cache) ride along in the byte count
        rank_tokens, plans = handoff_counts(tokens, self._distinct_stage_layers, self._record_bytes, self._dcp,
                                            self._max_write_bytes)
        sums = {layers: sum(w) for layers, w in plans.items()}
        j = Join(env, fn=lambda: None)  # its fn is set below, once the gather time is known
        stage_nics = self._stage_nics[p.index]
        stage_bpt = self._stage_bpt
        for stage, layers in enumerate(self._stage_layers):
            writes = sums[layers]
            rec.handoff_writes += writes
            stage_nics[stage].transfer(tokens * stage_bpt[stage], writes, j)
        bpt = self._handoff_bpt
        rec.handoff_bytes += tokens * bpt
        for r, link in enumerate(self._decode_nics[dec.index]):  # a rank's writes from every stage
            link.transfer(rank_tokens[r] * bpt, sum([n * plans[layers][r] for layers, n in self._stage_depths]), j)
        # once every write has landed: gather + scatter, then the request goes on (scheduled where
        # a process resumed by the join would have scheduled its timeout)
        gather_s = 2 * self.cost.unpack_s(rec.handoff_bytes // self.spec.stages)

        def done(_e) -> None:
            rec.handoff_s = env.now - start
            then()

        j.fn = lambda: call_later(env, gather_s, done)
        if not j.left:  # nothing to send: through SimPy's queue, as an empty join
            call_later(env, 0.0, lambda _e: j.fn())
