"""The prefill engine's scheduler: block tables, GPU prefix cache, connector scheduler, chunked-prefill steps.

One thread runs ``PrefillScheduler.run`` and is the only user of the block manager, the
``ConnectorScheduler`` and the stage sockets; ``submit`` and ``cancel`` may be called from any
thread (the HTTP server's), and the answer comes back through the request's ``done`` callback
(called on the scheduler thread, exactly once per submitted request).

Per request (in this order):
    1. **Admit** (FIFO): ``BlockManager.allocate`` reuses the GPU prefix cache's leading full pages
       and takes fresh pages for the rest; a request waits while no pages are free.
    2. **Lookup**: ``ConnectorScheduler.lookup`` with an oracle whose ``exists`` sends every stage
       its own keys (the key names the stage) in parallel and waits ``EXISTS_WAIT_S``; a stage that
       does not answer makes the lookup unanswered (the request computes).
    3. **Load**: the load plan goes to every stage at once (block ids shared by all stages); the
       outcome is all-or-nothing (``report_stage``); a failed load recomputes those tokens.
       The request's ``policy.prefill_request.PrefillRequest`` (``ConnectorScheduler.prefill_request``)
       decides what it computes and saves and fills the record's token sources.
    4. **Compute**: its compute ranges (``PrefillRequest.compute_ranges``: ``[gpu, first loaded
       chunk)`` then ``[end of load, prompt)``), in chunks: a step packs chunks of the running requests in
       admission order up to ``prefill.max_batched_tokens`` tokens (``policy.prefill_steps``: a
       chunk that does not reach the end of its range is cut to whole pages; with
       ``prefill.spread_requests`` at most the running requests' share over the stages). A step goes through
       every stage in order; hidden states come back to the scheduler and go on to the next stage.
       Up to ``pp`` steps are in flight (stage ``s`` works on step ``k`` while stage ``s + 1``
       works on step ``k - 1``); each stage computes its steps in the order it receives them. The last stage answers the first
       token (greedy) with the request's last chunk.
    5. **After compute**: the pages enter the GPU prefix cache; the new full chunks are saved with
       group ids on every stage and the KV is handed to the decode instance on every stage, both at
       once. The answer (``PrefillResult`` or an error) goes out once the hand-off and the save
       have ended; then the pages are released. The record's ``handoff_s`` is the hand-off's own
       time (its send to the last stage's reply), ``save_s`` the save's (0 without one).

Time accounts (read by the engine's metrics, any thread): ``stage_forward_s[s]`` sums the
``forward_s`` stage ``s`` answers with each compute step (its layers' forward pass, to a device
synchronization), ``stage_queued_s[s]`` and ``stage_handled_s[s]`` its ``queued_s`` (waiting
behind the stage's earlier steps) and ``handled_s`` (the command's arrival to its answer being
ready), ``stage_round_trip_s[s]`` each call's send to its answer's arrival here (the round trip
less ``handled_s`` is the hop: the messages through the engine);
``pending_s`` is the wall time the engine held prompt tokens it had not yet computed (a request
queued for pages, loading or computing), and ``steps_in_flight_s`` the time integral of the steps
in the pipeline over the same time (over ``pending_s``: how many steps the pipeline held on
average; ``pp`` when every stage has one). ``pending_s`` splits by what the
engine could do: ``computable_s``, a step in flight or tokens a step could take;
``loading_only_s``, nothing computable but a request loading from the pool; the rest, requests
waiting for pages only (the prefill KV is full until a request's hand-off and save end). At
saturation the busiest stage's forward time over ``pending_s`` is the share of the engine's time
the model computes; the rest is what scheduling, the connector, the hand-off, the messages between
processes and the wait for pages cost.

Bounds: every stage call has a deadline (``exists`` ``EXISTS_WAIT_S``; ``load`` the worker's load
timeout + ``STAGE_SLACK_S``; ``compute`` ``COMPUTE_WAIT_S``; ``save`` the save timeout + slack;
``handoff`` ``handoff_timeout_s`` + slack). A stage whose process is gone (checked every
``LIVENESS_EVERY_S``) or that misses a deadline other than ``exists``'s breaks the engine: every
request in flight or waiting is answered 503 naming the stage, and so is every later one (a
stage that missed a deadline may still write pages that would be reused).
"""

from __future__ import annotations

import enum
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from kvpool.backend.connector_data import SaveOutcome, StageReport, StageSaveReport, aggregate_save
from kvpool.backend.connector_scheduler import ConnectorScheduler, SchedulerConfig
from kvpool.backend.serve import stage_link as link
from kvpool.backend.serve.blocks import Allocation, BlockManager
from kvpool.policy.chunks import ChunkNaming
from kvpool.policy.layout import HandoffPlan
from kvpool.policy.prefill_steps import pack_step, step_requests
from kvpool.workload.records import RequestRecord

EXISTS_WAIT_S = 5.0
STAGE_SLACK_S = 5.0
COMPUTE_WAIT_S = 120.0
LIVENESS_EVERY_S = 0.5
LOAD_TIMEOUT_S = 10.0   # the stage's ConnectorWorker load_timeout_s
SAVE_TIMEOUT_S = 30.0   # and save_timeout_s


class _Holds(enum.Enum):
    """What uncomputed work the engine holds (``PrefillScheduler._holds``)."""

    NOTHING = 0
    PAGES = 1        # only requests waiting for pages
    LOADING = 2      # requests loading from the pool, none computable
    COMPUTABLE = 3   # a step in flight or tokens a step could take


class StageBroken(RuntimeError):
    """A stage died or missed a deadline; the engine cannot serve."""


@dataclass
class Outcome:
    """What the HTTP side answers: ``status`` and a JSON body."""

    status: int
    body: dict


@dataclass
class _Req:
    rid: str
    tokens: tuple[int, ...]
    decode: int
    session: str
    t_recv: float
    done: Callable[[Outcome], None]
    record: RequestRecord
    state: str = "queued"          # queued, loading, running, finishing, finished
    alloc: Allocation | None = None
    digests: list[bytes] = field(default_factory=list)
    ranges: list[list[int]] = field(default_factory=list)   # compute ranges not yet scheduled
    load_reports: dict[int, StageReport] = field(default_factory=dict)
    inflight_chunks: int = 0
    first_token: int | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    t_handoff: float = 0.0
    t_handoff_end: float = 0.0
    t_save_end: float = 0.0
    handoff_left: set[int] = field(default_factory=set)
    handoff_error: str = ""
    handoff_reports: list[dict] = field(default_factory=list)
    save_plan: object = None
    save_reports: dict[int, StageSaveReport] = field(default_factory=dict)
    abandoned: bool = False

    @property
    def n(self) -> int:
        return len(self.tokens)


@dataclass
class _Step:
    sid: int
    items: list[tuple[_Req, int, int, bool]]   # (request, start, end, last)
    stage: int = 0
    t0: float = 0.0
    sent_s: float = 0.0   # when it was sent to its current stage


@dataclass
class _Call:
    kind: str                 # load, compute, save, handoff
    stage: int
    deadline: float
    bound_s: float
    req: _Req | None = None
    step: _Step | None = None


class _FanOutOracle:
    """``exists`` for the connector scheduler: each stage answers for its own keys, in parallel."""

    def __init__(self, client: link.StageClient, stages: int, dead: Callable[[], bool]) -> None:
        self.client = client
        self.stages = stages
        self.dead = dead

    def exists(self, keys: Sequence[str]) -> list[bool] | None:
        per: list[list[int]] = [[] for _ in range(self.stages)]
        for i, k in enumerate(keys):
            per[_stage_of_key(k, self.stages)].append(i)
        asked = [s for s in range(self.stages) if per[s]]
        replies = self.client.call_all(asked, "exists", [{"keys": [keys[i] for i in per[s]]} for s in asked],
                                       EXISTS_WAIT_S, self.dead)
        out = [False] * len(keys)
        for s, rep in zip(asked, replies):
            present = rep.get("present") if rep and rep.get("ok") else None
            if not isinstance(present, list) or len(present) != len(per[s]):
                return None
            for i, p in zip(per[s], present):
                out[i] = bool(p)
        return out


def _stage_of_key(key: str, stages: int) -> int:
    """The stage named in a ``policy.chunks`` object key (``{ns}/s{stage}of{stages}/{digest}``)."""
    part = key.split("/")[1]
    s = int(part[1:part.index("of")])
    if not 0 <= s < stages:
        raise ValueError(f"key {key!r} names stage {s} of {stages}")
    return s


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


@dataclass(frozen=True)
class SchedulerSettings:
    max_batched_tokens: int
    page_tokens: int
    stage_layers: tuple[int, ...]
    record_bytes: int
    max_write_bytes: int
    handoff_timeout_s: float = 30.0
    instance: int = 0
    spread_requests: bool = False


class PrefillScheduler:
    """See the module docstring.

    Args:
        settings: batching and geometry.
        blocks: the block manager (page ids of every stage).
        naming, spec, sched_config: the connector scheduler's key naming, KV geometry and settings.
        stage_endpoints: each stage's command endpoint, in stage order.
        stage_pids: each stage's pid (liveness), in stage order; stage names for messages.
        decode_ready: ``decode_ready(instance) -> Path`` of that decode engine's ready file.
        on_finish: ``on_finish(record, outcome)`` after each request (metrics).
    """

    def __init__(self, settings: SchedulerSettings, blocks: BlockManager, naming: ChunkNaming, spec,
                 sched_config: SchedulerConfig, stage_endpoints: Sequence[str], stage_pids: Sequence[int],
                 stage_names: Sequence[str], decode_ready: Callable[[int], Path],
                 on_finish: Callable[[RequestRecord, Outcome], None] = lambda r, o: None) -> None:
        self.s = settings
        self.pp = len(settings.stage_layers)
        self.blocks = blocks
        self.naming, self.spec, self.sched_config = naming, spec, sched_config
        self.endpoints = list(stage_endpoints)
        self.pids = list(stage_pids)
        self.names = list(stage_names)
        self.decode_ready = decode_ready
        self.on_finish = on_finish
        self.on_step: Callable[[int, int], None] = lambda requests, tokens: None
        self.ctx = zmq.Context.instance()
        self.inbox: queue.Queue = queue.Queue()
        self.waker = link.Waker(self.ctx)
        self.broken = ""
        self.stop = threading.Event()
        self.started = threading.Event()
        self.queued: deque[_Req] = deque()
        self.live: dict[str, _Req] = {}           # admitted, not finished
        self.calls: dict[int, _Call] = {}
        self.steps: list[_Step] = []
        self._sid = 0
        self._decode_ranks: dict[int, int] = {}
        self.steps_done = 0
        self.step_tokens_done = 0
        self.stage_forward_s = [0.0] * self.pp
        self.stage_queued_s = [0.0] * self.pp
        self.stage_handled_s = [0.0] * self.pp
        self.stage_round_trip_s = [0.0] * self.pp
        self.pending_s = 0.0
        self.computable_s = 0.0
        self.loading_only_s = 0.0
        self.steps_in_flight_s = 0.0

    # -- any thread ------------------------------------------------------------------------
    def submit(self, rid: str, tokens: tuple[int, ...], decode: int, session: str, done: Callable[[Outcome], None]) -> None:
        self.inbox.put(("submit", _Req(rid, tokens, decode, session, time.monotonic(), done, RequestRecord(rid))))
        self.waker.wake()

    def cancel(self, rid: str) -> None:
        self.inbox.put(("cancel", rid))
        self.waker.wake()

    def shutdown(self) -> None:
        self.stop.set()
        self.waker.wake()

    @property
    def waiting(self) -> int:
        return len(self.queued)

    @property
    def running(self) -> int:
        return len(self.live)

    # -- the scheduler thread ----------------------------------------------------------------
    def run(self) -> None:
        self.client = link.StageClient(self.ctx, self.endpoints)
        self.connector = ConnectorScheduler(_FanOutOracle(self.client, self.pp, self._check_liveness), self.naming, self.spec, self.sched_config)
        poller = zmq.Poller()
        self.client.register(poller)
        poller.register(self.waker.socket, zmq.POLLIN)
        pings = self.client.call_all(list(range(self.pp)), "ping", [None] * self.pp, 30.0)
        for s, rep in enumerate(pings):
            if not rep or not rep.get("ok"):
                self._break(f"prefill stage {self.names[s]} did not answer a ping within 30 s")
            elif rep.get("num_blocks") != self.blocks.num_blocks:
                self._break(f"prefill stage {self.names[s]} holds {rep.get('num_blocks')} pages, the engine {self.blocks.num_blocks}")
        self.started.set()
        next_liveness = 0.0
        t_mark, holds, in_flight = time.monotonic(), _Holds.NOTHING, 0
        try:
            while not self.stop.is_set():
                self._take_inbox()
                for stage, header, tensors in self.client.poll():
                    self._on_reply(stage, header, tensors)
                now = time.monotonic()
                if now >= next_liveness:
                    next_liveness = now + LIVENESS_EVERY_S
                    self._check_liveness()
                self._check_deadlines(now)
                if not self.broken:
                    self._admit()
                    self._schedule_step()
                now = time.monotonic()
                self._account(holds, in_flight, now - t_mark)
                # the state the poll waits in
                t_mark, holds, in_flight = now, self._holds(), len(self.steps)
                poller.poll(0 if self.client.has_kept else int(LIVENESS_EVERY_S * 1000))
                self.waker.drain()
        finally:
            self._fail_all("the prefill engine is stopping", 503)
            self.client.close()

    def _holds(self) -> _Holds:
        """What uncomputed work the engine holds now, the most advanced kind first: a step in flight
        or tokens a step could take; else a request loading from the pool; else one waiting for
        pages."""
        if self.steps or any(r.state == "running" and r.ranges for r in self.live.values()):
            return _Holds.COMPUTABLE
        if any(r.state == "loading" for r in self.live.values()):
            return _Holds.LOADING
        return _Holds.PAGES if self.queued else _Holds.NOTHING

    def _account(self, holds: _Holds, in_flight: int, dt_s: float) -> None:
        """Add ``dt_s`` seconds spent holding ``holds`` with ``in_flight`` steps to the time accounts."""
        if holds is _Holds.NOTHING:
            return
        self.pending_s += dt_s
        self.steps_in_flight_s += in_flight * dt_s
        if holds is _Holds.COMPUTABLE:
            self.computable_s += dt_s
        elif holds is _Holds.LOADING:
            self.loading_only_s += dt_s

    def _take_inbox(self) -> None:
        while True:
            try:
                kind, v = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                if self.broken:
                    self._answer(v, Outcome(503, {"error": self.broken}))
                elif v.rid in self.live or any(q.rid == v.rid for q in self.queued):
                    v.done(Outcome(409, {"error": f"request_id {v.rid!r} is already being prefilled"}))
                else:
                    self.queued.append(v)
            else:
                for q in list(self.queued):
                    if q.rid == v:
                        self.queued.remove(q)
                        q.abandoned = True
                if v in self.live:
                    self.live[v].abandoned = True   # its bounded work goes on; the answer is dropped

    # -- admission, lookup, load ---------------------------------------------------------------
    def _admit(self) -> None:
        if self.queued and self._check_liveness():
            return
        while self.queued and not self.broken:
            req = self.queued[0]
            try:
                alloc = self.blocks.allocate(req.tokens)
            except ValueError as e:
                self.queued.popleft()
                self._answer(req, Outcome(413, {"error": str(e)}))
                continue
            if alloc is None:
                return
            self.queued.popleft()
            self._start(req, alloc)

    def _start(self, req: _Req, alloc: Allocation) -> None:
        req.alloc = alloc
        req.t_start = time.monotonic()
        self.live[req.rid] = req
        gpu = alloc.hit_pages * self.s.page_tokens
        req.digests = self.connector.digests_for(req.tokens)
        look = self.connector.lookup(req.rid, req.digests, req.n, gpu)
        if self.broken:   # a stage died during the lookup: the request was answered
            return
        rec = req.record
        rec.in_tokens, rec.session = req.n, req.session
        rec.prefill, rec.decode = self.s.instance, req.decode
        plan = self.connector.plan_load(look)
        life = self.connector.prefill_request(req.rid)
        life.account.write(rec)
        if plan is None:
            req.ranges = [list(r) for r in life.compute_ranges]
            req.state = "running"
            return
        req.state = "loading"
        body = {"plan": link.load_plan_json(plan), "blocks": alloc.block_ids}
        bound = LOAD_TIMEOUT_S + STAGE_SLACK_S
        deadline = time.monotonic() + bound
        for s in range(self.pp):
            self.calls[self.client.send(s, "load", body)] = _Call("load", s, deadline, bound, req=req)

    def _on_load(self, req: _Req, stage: int, header: dict) -> None:
        if header.get("ok"):
            rep = link.stage_report_from_json(header.get("report"))
        else:
            now = time.monotonic()
            rep = StageReport(req.rid, stage, False, now, now, 0, f"error: {header.get('error')}")
        outcome = self.connector.report_stage(rep)
        if outcome is None:
            return
        rec = req.record
        rec.restore_stage_s = list(outcome.stage_load_s)
        rec.restore_spread_s = outcome.first_to_last_s
        rec.restore_bytes += outcome.bytes_loaded
        life = self.connector.prefill_request(req.rid)
        life.account.write(rec)
        req.ranges = [list(r) for r in life.compute_ranges]
        req.state = "running"

    # -- compute steps ---------------------------------------------------------------------
    def _schedule_step(self) -> None:
        if len(self.steps) >= self.pp or any(st.stage == 0 for st in self.steps):
            return
        runnable = [req for req in self.live.values() if req.state == "running" and req.ranges]
        runnable = runnable[:step_requests(len(runnable), self.pp, self.s.spread_requests)]
        takes = pack_step([req.ranges[0][1] - req.ranges[0][0] for req in runnable], self.s.max_batched_tokens,
                          self.s.page_tokens)
        items = []
        for req, take in zip(runnable, takes):
            start, end = req.ranges[0]
            stop = start + take
            if stop == end:
                req.ranges.pop(0)
            else:
                req.ranges[0][0] = stop
            items.append((req, start, stop, stop == req.n))
            req.inflight_chunks += 1
        if not items:
            return
        self._sid += 1
        step = _Step(self._sid, items, 0, time.monotonic())
        self.steps.append(step)
        self._send_step(step, ())

    def _send_step(self, step: _Step, tensors) -> None:
        s = step.stage
        body = {"items": [{"rid": r.rid, "start": a, "end": b, "blocks": r.alloc.block_ids, "last": last,
                           **({"tokens": list(r.tokens[a:b])} if s == 0 else {})}
                          for r, a, b, last in step.items]}
        step.sent_s = time.monotonic()   # the round trip counts this send's encoding
        cid = self.client.send(s, "compute", body, tensors)
        self.calls[cid] = _Call("compute", s, time.monotonic() + COMPUTE_WAIT_S, COMPUTE_WAIT_S, step=step)

    def _on_compute(self, step: _Step, stage: int, header: dict, tensors) -> None:
        if not header.get("ok"):
            raise StageBroken(f"prefill stage {self.names[stage]} failed a compute step: {header.get('error')}")
        self._account_stage_call(stage, header, time.monotonic() - step.sent_s)
        if stage < self.pp - 1:
            if len(tensors) != 1:
                raise StageBroken(f"prefill stage {self.names[stage]} answered a step without hidden states")
            step.stage = stage + 1
            self._send_step(step, tensors)
            return
        self.steps.remove(step)
        self.steps_done += 1
        self.on_step(len(step.items), sum(b - a for _, a, b, _ in step.items))
        first = header.get("first_tokens") or {}
        for req, a, b, last in step.items:
            self.step_tokens_done += b - a
            req.inflight_chunks -= 1
            if last:
                tok = first.get(req.rid)
                if not isinstance(tok, int):
                    raise StageBroken(f"prefill stage {self.names[stage]} answered no first token for {req.rid}")
                req.first_token = tok
                req.t_end = time.monotonic()
                self._after_compute(req)

    def _account_stage_call(self, stage: int, header: dict, round_trip_s: float) -> None:
        """Add one compute call's times to stage ``stage``'s accounts: its round trip from here and
        what the stage reported (``forward_s``, ``queued_s``, ``handled_s``; a missing or negative
        one counts 0)."""
        def reported(key: str) -> float:
            v = header.get(key)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else 0.0

        self.stage_forward_s[stage] += reported("forward_s")
        self.stage_queued_s[stage] += reported("queued_s")
        self.stage_handled_s[stage] += reported("handled_s")
        self.stage_round_trip_s[stage] += round_trip_s

    # -- save and hand-off -------------------------------------------------------------------
    def _after_compute(self, req: _Req) -> None:
        req.state = "finishing"
        self.blocks.commit(req.alloc, req.n)
        plan = self.connector.plan_save(req.rid, req.digests, req.n)
        blocks = req.alloc.block_ids
        req.t_handoff = time.monotonic()  # the save and the hand-off start together
        if plan is not None:
            req.save_plan = plan
            body = {"plan": link.save_plan_json(plan), "blocks": blocks}
            bound = SAVE_TIMEOUT_S + STAGE_SLACK_S
            deadline = time.monotonic() + bound
            for s in range(self.pp):
                self.calls[self.client.send(s, "save", body)] = _Call("save", s, deadline, bound, req=req)
        ranks = self._ranks_of(req.decode)
        if isinstance(ranks, str):
            req.handoff_error = ranks
            self.connector.prefill_request(req.rid).handed_off()
            self._maybe_finish(req)
            return
        bound = self.s.handoff_timeout_s + STAGE_SLACK_S
        deadline = time.monotonic() + bound
        for s, layers in enumerate(self.s.stage_layers):
            hplan = HandoffPlan(req.n, layers, self.s.record_bytes, ranks, self.s.max_write_bytes, 0)
            body = {"rid": req.rid, "decode": req.decode, "blocks": blocks, "plan": link.handoff_plan_json(hplan),
                    "timeout_s": self.s.handoff_timeout_s}
            self.calls[self.client.send(s, "handoff", body)] = _Call("handoff", s, deadline, bound, req=req)
            req.handoff_left.add(s)

    def _ranks_of(self, decode: int) -> int | str:
        """Ranks of a decode instance (its ready file's ``rank_endpoints``), or why not known."""
        if decode in self._decode_ranks:
            return self._decode_ranks[decode]
        path = self.decode_ready(decode)
        try:
            import json

            eps = json.loads(path.read_text()).get("rank_endpoints")
        except (OSError, ValueError) as e:
            return f"decode instance {decode} is not ready ({path.name}: {e})"
        if not isinstance(eps, list) or not eps:
            return f"decode instance {decode}'s ready file {path.name} has no rank_endpoints"
        self._decode_ranks[decode] = len(eps)
        return len(eps)

    def _on_handoff(self, req: _Req, stage: int, header: dict) -> None:
        req.handoff_left.discard(stage)
        req.t_handoff_end = time.monotonic()
        if header.get("ok"):
            req.handoff_reports.append(header.get("report") or {})
        elif not req.handoff_error:
            req.handoff_error = f"hand-off to decode instance {req.decode} failed on stage {stage}: {header.get('error')}"
            self._decode_ranks.pop(req.decode, None)
        if not req.handoff_left and req.state != "finished":
            self.connector.prefill_request(req.rid).handed_off()
        self._maybe_finish(req)

    def _on_save(self, req: _Req, stage: int, header: dict) -> None:
        if header.get("ok"):
            rep = link.save_report_from_json(header.get("report"))
        else:
            now = time.monotonic()
            plan = req.save_plan
            rep = StageSaveReport(req.rid, stage, 0, plan.chunks, now, now, 0, f"error: {header.get('error')}")
        req.save_reports[stage] = rep
        if len(req.save_reports) == self.pp:
            outcome: SaveOutcome = aggregate_save(req.save_plan, [req.save_reports[s] for s in range(self.pp)])
            self.connector.complete_save(req.rid, outcome.stored)
            req.record.save_bytes += outcome.bytes_saved
            req.save_plan = None
            req.t_save_end = time.monotonic()
        self._maybe_finish(req)

    def _maybe_finish(self, req: _Req) -> None:
        """Answer once the request's hand-off and save have both ended (``PrefillRequest.ended``)."""
        if req.state == "finished" or not self.connector.prefill_request(req.rid).ended:
            return
        rec = req.record
        now = time.monotonic()
        rec.prefill_start_s = req.t_start - req.t_recv
        rec.prefill_end_s = req.t_end - req.t_recv
        rec.handoff_s = max(0.0, (req.t_handoff_end or now) - req.t_handoff)
        rec.save_s = max(0.0, req.t_save_end - req.t_handoff) if req.t_save_end else 0.0
        rec.handoff_bytes = sum(int(r.get("handoff_bytes", 0)) for r in req.handoff_reports)
        rec.handoff_writes = sum(int(r.get("handoff_writes", 0)) for r in req.handoff_reports)
        if req.handoff_error:
            out = Outcome(502, {"error": req.handoff_error, "record": _record_json(rec)})
        else:
            out = Outcome(200, {"request_id": req.rid, "first_token": req.first_token, "record": _record_json(rec),
                                "descriptor": {"decode_instance": req.decode, "stages": self.pp}})
        self._release(req)
        self._answer(req, out)

    def _release(self, req: _Req) -> None:
        req.state = "finished"
        self.live.pop(req.rid, None)
        if req.alloc is not None:
            self.blocks.release(req.alloc)
        self.connector.finish(req.rid)

    def _answer(self, req: _Req, out: Outcome) -> None:
        try:
            self.on_finish(req.record, out)
        finally:
            if not req.abandoned:
                req.done(out)

    # -- replies, deadlines, faults ----------------------------------------------------------
    def _on_reply(self, stage: int, header: dict, tensors) -> None:
        call = self.calls.pop(header.get("id"), None)
        if call is None or self.broken:
            return
        try:
            if call.kind == "compute":
                self._on_compute(call.step, stage, header, tensors)
            elif call.kind == "load":
                self._on_load(call.req, stage, header)
            elif call.kind == "save":
                self._on_save(call.req, stage, header)
            elif call.kind == "handoff":
                self._on_handoff(call.req, stage, header)
        except StageBroken as e:
            self._break(str(e))
        except (link.LinkError, ValueError, TypeError, KeyError) as e:
            self._break(f"prefill stage {self.names[stage]} answered {call.kind} malformed: {e}")

    def _check_deadlines(self, now: float) -> None:
        for cid, call in list(self.calls.items()):
            if now > call.deadline:
                self._break(f"prefill stage {self.names[call.stage]} did not answer {call.kind} within {call.bound_s:g} s")
                return

    def _check_liveness(self) -> bool:
        """Break the engine if a stage's process is gone; returns whether it is broken."""
        for name, pid in zip(self.names, self.pids):
            if pid and not _alive(pid):
                self._break(f"prefill stage {name} (pid {pid}) exited")
                break
        return bool(self.broken)

    def _break(self, reason: str) -> None:
        if not self.broken:
            self.broken = reason
        self._fail_all(self.broken, 503)

    def _fail_all(self, reason: str, status: int) -> None:
        reqs = list(self.live.values()) + list(self.queued)
        self.live.clear()
        self.queued.clear()
        self.calls.clear()
        self.steps.clear()
        for req in reqs:
            req.state = "finished"
            self._answer(req, Outcome(status, {"error": reason}))


def _record_json(rec: RequestRecord) -> dict:
    keys = ("key", "session", "in_tokens", "prefill", "decode", "gpu_tokens", "pool_tokens", "computed_tokens",
            "restore_stage_s", "restore_spread_s", "restore_failed", "restore_bytes", "save_bytes", "handoff_bytes",
            "handoff_writes", "handoff_s", "save_s", "prefill_start_s", "prefill_end_s", "lookup_answered")
    return {k: getattr(rec, k) for k in keys}


__all__ = ["Outcome", "PrefillScheduler", "SchedulerSettings"]
