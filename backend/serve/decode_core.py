"""The decode engine's core: one thread owns the hand-off ranks, the paged KV, the model and the batch.

Contract:
    * ``DecodeCore(scenario, instance, devices, loop)``; ``start()`` starts the engine thread,
      ``stop(reason)`` ends every open stream with ``reason`` and closes the ranks (bounded join).
    * Threading: ``DecodeRank`` objects, the caches and the model are touched by the engine thread
      only. The HTTP handlers (asyncio, another thread) call ``submit(fn, *args)``, which queues
      ``fn`` for the engine thread and returns an ``asyncio.Future`` of its result; token events
      reach a handler through its request's ``asyncio.Queue`` (``loop.call_soon_threadsafe``).
    * Ranks: ``decode.dcp`` DCP ranks, rank ``r``'s KV on ``devices[r % len(devices)]``, each with
      ``serve.decode_kv_tokens / dcp`` tokens of pages. Per prefill instance ``i`` one
      ``DecodeRank`` per DCP rank (``stages = handoff_plan.senders``: ``prefill.pp``, twice that
      with the DSA indexer, whose records cross as parts of their own; ``serve.landing_slots``
      slots of ``handoff_plan.write_cap_bytes``), all scattering into the same caches
      (``DcpCaches.handoff_caches``: latents, then indexer caches); ``rank_endpoints[i]``
      lists instance ``i``'s in rank order. A request is expected on the ranks of the prefill
      instance its expect names (``ExpectRequest.prefill_instance``) only: those ranks alone set
      landing space aside for it, and its hand-off is complete when they are all ready.
    * ``expect``: pages for ``prompt_tokens + max_tokens`` tokens on every rank, or ``NoRoom``; a
      ``prefill_instance`` the deployment does not have is a ``ProtocolError``.
    * ``generate``: a request joins the waiting list; it runs once its hand-off is complete and the
      batch has fewer than ``decode.max_seqs`` sequences (first come, first served). The stream
      carries the tokens after ``first_token`` (at most ``max_tokens - 1``): one ``TokenEvent`` per
      step, the last one ``done`` with ``finish_reason`` ``length`` or ``stop`` (EOS, unless
      ``ignore_eos``) and the decode side's record fields.
    * Bounds: a hand-off not complete ``handoff_wait_s`` (``min(HANDOFF_WAIT_CAP_S,
      serve.request_timeout_s)``) after ``/generate`` fails: its stream ends with an error naming
      the ranks still pending, and every stage is told FAIL. A failed hand-off ends its stream with
      the rank's reason at once (or, before ``/generate``, the ``/generate`` that follows). An
      expected request without ``/generate`` for ``serve.request_timeout_s`` is dropped. Every end
      frees the request's pages at once.
    * Polling: the engine thread polls the side channels between the layers of a decode step and
      between steps; with no step to run, every ``POLL_S`` while requests are pending and every
      ``IDLE_POLL_S`` with none.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpool.backend.handoff import DecodeRank, HandoffError, StagePart, make_transport
from kvpool.backend.refmodel import RefModel
from kvpool.backend.serve import handoff_plan as hp
from kvpool.backend.serve.decode_metrics import DecodeMetrics
from kvpool.backend.serve.decode_model import DcpCaches, DecodeModel, DecodeSeq, rank_pages
from kvpool.backend.serve.model_config import EOS_TOKEN, ref_config
from kvpool.backend.serve.protocol import ExpectRequest, GenerateRequest, ProtocolError, TokenEvent
from kvpool.scenario.model import Scenario

HANDOFF_WAIT_CAP_S = 30.0
POLL_S = 0.002
IDLE_POLL_S = 0.02
STOP_JOIN_S = 10.0

EXPECTED, WAITING, RUNNING = "expected", "waiting", "running"


class NoRoom(RuntimeError):
    """No room for a request's pages on this decode instance."""


class RequestConflict(ValueError):
    """A request id that is already known (expect), unknown or in the wrong state (generate)."""


@dataclass
class _Req:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    pages: list[list[int]]                  # per rank, block ids
    tables: list[torch.Tensor]              # per rank, int64 on the rank's device
    t_expect: float
    state: str = EXPECTED
    handoff_done: bool = False
    handoff_error: str = ""
    handoff_s: float = 0.0
    out: asyncio.Queue | None = None
    gen: GenerateRequest | None = None
    t_generate: float = 0.0
    tokens: int = 0                          # generated so far, first_token included
    last: int = 0
    t_last: float = 0.0
    live_sets: list[int] = field(default_factory=list)   # its prefill instance, while that one's ranks have it


class DecodeCore:
    def __init__(self, scenario: Scenario, instance: int, devices: tuple[str, ...], loop: asyncio.AbstractEventLoop,
                 metrics: DecodeMetrics | None = None, log: Callable[[str], None] = print) -> None:
        self.scenario, self.instance, self.loop, self.log = scenario, instance, loop, log
        self.metrics = metrics or DecodeMetrics()
        s, d = scenario.serve, scenario.decode
        self.dcp, self.max_seqs, self.pp = d.dcp, d.max_seqs, scenario.prefill.pp
        self.config = ref_config(scenario)
        self.page = self.config.page_tokens
        self.devices = tuple(devices) or ("cpu",)
        self.blocks_per_rank = -(-s.decode_kv_tokens // (self.dcp * self.page))
        self.model = RefModel(self.config, device=self.devices[0])
        self.kv = DcpCaches(self.config, self.dcp, self.blocks_per_rank, self.devices)
        self.step_model = DecodeModel(self.model, self.kv, self.devices, tp=d.tp)
        self.free: list[list[int]] = [list(range(self.blocks_per_rank - 1, -1, -1)) for _ in range(self.dcp)]
        slot_bytes = hp.write_cap_bytes(scenario)
        self.ranks: list[list[DecodeRank]] = [
            [DecodeRank(r, self.kv.handoff_caches(r), make_transport(hp.TRANSPORT), stages=hp.senders(scenario),
                        slots=s.landing_slots, slot_bytes=slot_bytes) for r in range(self.dcp)]
            for _ in range(scenario.prefill.instances)
        ]
        self.rank_endpoints = [[dr.endpoint for dr in ranks] for ranks in self.ranks]
        self.request_timeout_s = s.request_timeout_s
        self.handoff_wait_s = min(HANDOFF_WAIT_CAP_S, s.request_timeout_s)
        self.reqs: dict[str, _Req] = {}
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._stop_reason = "decode engine stopping"
        self._thread = threading.Thread(target=self._main, name=f"decode{instance}-engine", daemon=True)
        self.metrics.kv_capacity.set(self.blocks_per_rank * self.page * self.dcp)
        self.alive = True

    # ---- called from the HTTP thread ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, reason: str = "decode engine stopping") -> None:
        self._stop_reason = reason
        self._stop.set()
        self._cmds.put(None)
        self._thread.join(STOP_JOIN_S)

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run ``fn(*args)`` on the engine thread; the future gets its result or exception."""
        fut = self.loop.create_future()
        self._cmds.put((fn, args, fut))
        return fut

    @property
    def kv_usage(self) -> float:
        return 1.0 - sum(len(f) for f in self.free) / (self.blocks_per_rank * self.dcp)

    def counts(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.reqs) - len(self.running),
                "kv_usage": round(self.kv_usage, 6), "free_pages": [len(f) for f in self.free]}

    # ---- commands (engine thread) -------------------------------------------------------------

    def expect(self, req: ExpectRequest) -> dict:
        if req.request_id in self.reqs:
            raise RequestConflict(f"request {req.request_id!r} is already expected on decode instance {self.instance}")
        source = req.prefill_instance
        if source >= len(self.ranks):
            raise ProtocolError(f"prefill_instance: expected an integer in [0, {len(self.ranks) - 1}] (the "
                                f"deployment's prefill instances), got {source}")
        total = req.prompt_tokens + req.max_tokens
        need = [rank_pages(total, r, self.dcp, self.page) for r in range(self.dcp)]
        short = [r for r in range(self.dcp) if need[r] > len(self.free[r])]
        if short:
            r = short[0]
            raise NoRoom(f"decode instance {self.instance}: no room for {total} tokens (rank {r} needs {need[r]} "
                         f"pages, {len(self.free[r])} free of {self.blocks_per_rank})")
        pages = [[self.free[r].pop() for _ in range(need[r])] for r in range(self.dcp)]
        tables = [torch.tensor(p, dtype=torch.long, device=self.kv.devices[r]) for r, p in enumerate(pages)]
        rq = _Req(req.request_id, req.prompt_tokens, req.max_tokens, pages, tables, time.monotonic())
        parts = {sender: StagePart(plan, start) for s in range(self.pp)
                 for sender, (plan, start) in hp.stage_parts(self.scenario, s, req.prompt_tokens).items()}
        try:
            for r, dr in enumerate(self.ranks[source]):
                dr.expect(req.request_id, tables[r], parts)
        except ValueError:
            self._forget_ranks(rq, [source])
            self._free(rq)
            raise
        rq.live_sets = [source]
        self.reqs[req.request_id] = rq
        self._gauges()
        return {"request_id": req.request_id, "pages": [len(p) for p in pages]}

    def generate(self, req: GenerateRequest, out: asyncio.Queue) -> None:
        rq = self.reqs.get(req.request_id)
        if rq is None:
            raise KeyError(f"request {req.request_id!r} is not expected on decode instance {self.instance} "
                           f"(POST /expect first; it may have been aborted or timed out)")
        if rq.state != EXPECTED:
            raise RequestConflict(f"request {req.request_id!r} is already generating")
        if req.max_tokens > rq.max_tokens:
            raise RequestConflict(f"max_tokens {req.max_tokens} exceeds the {rq.max_tokens} expected for "
                                  f"request {req.request_id!r}")
        if req.first_token >= self.config.vocab:
            raise RequestConflict(f"first_token: expected an id below the vocabulary ({self.config.vocab}), "
                                  f"got {req.first_token}")
        rq.gen, rq.out, rq.state = req, out, WAITING
        rq.t_generate = rq.t_last = time.monotonic()
        rq.tokens, rq.last = 1, req.first_token
        if req.max_tokens == 1 or (req.first_token == EOS_TOKEN and not req.ignore_eos):
            self._finish(rq, "length" if req.max_tokens == 1 else "stop")
            return
        if rq.handoff_error:
            self._end_error(rq, rq.handoff_error)
            return
        self.waiting.append(rq)
        self._gauges()

    def abort(self, request_id: str) -> bool:
        rq = self.reqs.get(request_id)
        if rq is None:
            return False
        self._end_error(rq, f"request {request_id!r} aborted")
        return True

    # ---- the engine thread ----------------------------------------------------------------------

    def _main(self) -> None:
        if self.devices[0].startswith("cuda"):
            torch.cuda.set_device(self.devices[0])
        try:
            while not self._stop.is_set():
                busy = bool(self.running)
                self._commands(0.0 if busy else POLL_S if self.reqs else IDLE_POLL_S)
                t_work = time.monotonic()   # an idle wait for commands is not part of a busy iteration
                self._poll_ranks()
                self._handoffs()
                self._admit()
                if self.running:
                    self._step()
                    self.metrics.busy_s.inc(time.monotonic() - t_work)
        except Exception as exc:  # noqa: BLE001  (the engine must end every stream, whatever broke)
            self.log(f"decode{self.instance}: engine thread failed: {exc}\n{traceback.format_exc()}")
            self._stop_reason = f"decode engine failed: {type(exc).__name__}: {exc}"
        finally:
            self.alive = False
            for rq in list(self.reqs.values()):
                self._end_error(rq, self._stop_reason)
            self._drain_refusing()
            for ranks in self.ranks:
                for dr in ranks:
                    dr.close()

    def _poll_ranks(self) -> None:
        for ranks in self.ranks:
            for dr in ranks:
                dr.poll(0.0)

    def _commands(self, timeout_s: float) -> None:
        try:
            item = self._cmds.get(timeout=timeout_s) if timeout_s > 0 else self._cmds.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, args, fut = item
            try:
                res, err = fn(*args), None
            except Exception as exc:  # noqa: BLE001  (returned to the handler)
                res, err = None, exc
            self.loop.call_soon_threadsafe(_resolve, fut, res, err)
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _drain_refusing(self) -> None:
        while True:
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self.loop.call_soon_threadsafe(_resolve, item[2], None, RuntimeError(self._stop_reason))

    def _handoffs(self) -> None:
        now = time.monotonic()
        for rq in list(self.reqs.values()):
            if rq.state == EXPECTED and now - rq.t_expect > self.request_timeout_s:
                self.log(f"decode{self.instance}: request {rq.request_id!r} dropped: no /generate within "
                         f"{self.request_timeout_s:g} s of /expect")
                self._end_error(rq, "no /generate in time")
                continue
            if rq.handoff_done or rq.handoff_error:
                continue
            for i in list(rq.live_sets):
                states = [dr.status(rq.request_id) for dr in self.ranks[i]]
                if "failed" in states:
                    r = states.index("failed")
                    err = self.ranks[i][r].error(rq.request_id)
                    self._forget_ranks(rq, [i])
                    if not rq.live_sets:
                        self._handoff_failed(rq, f"hand-off failed on decode rank {r}: {err}")
                elif all(st == "ready" for st in states):
                    results = [dr.wait(rq.request_id, 0.0) for dr in self.ranks[i]]
                    self._forget_ranks(rq, rq.live_sets)
                    rq.handoff_done = True
                    rq.handoff_s = max(res.handoff_s for res in results)
                    self.metrics.handoff_bytes.inc(sum(res.handoff_bytes for res in results))
                    self.metrics.handoff_writes.inc(sum(res.handoff_writes for res in results))
                    self.metrics.handoff_s.observe(rq.handoff_s)
                    break
            if rq.state == WAITING and not rq.handoff_done and not rq.handoff_error \
                    and now - rq.t_generate > self.handoff_wait_s:
                pending = [r for i in rq.live_sets for r, dr in enumerate(self.ranks[i])
                           if dr.status(rq.request_id) == "pending"]
                self._forget_ranks(rq, rq.live_sets)
                self._handoff_failed(rq, f"hand-off not complete within {self.handoff_wait_s:g} s of /generate "
                                         f"(decode rank(s) {sorted(set(pending))} still waiting for prefill)")

    def _handoff_failed(self, rq: _Req, reason: str) -> None:
        self.metrics.handoff_failures.inc()
        self.log(f"decode{self.instance}: request {rq.request_id!r}: {reason}")
        rq.handoff_error = reason
        if rq.state == WAITING:
            self._end_error(rq, reason)
        else:   # no stream yet: free the pages now, the /generate that follows gets the error
            self._free(rq)

    def _admit(self) -> None:
        keep = []
        for rq in self.waiting:
            if rq.state != WAITING:
                continue
            if rq.handoff_done and len(self.running) < self.max_seqs:
                rq.state = RUNNING
                rq.t_last = time.monotonic()
                self.running.append(rq)
            else:
                keep.append(rq)
        self.waiting = keep
        self._gauges()

    def _step(self) -> None:
        batch = self.running
        seqs = [DecodeSeq(rq.last, rq.prompt_tokens + rq.tokens - 1, rq.tables, rq.pages) for rq in batch]
        t0 = time.monotonic()
        try:
            nxt, _ = self.step_model.step(seqs, self._poll_ranks)
        except Exception as exc:  # noqa: BLE001  (every sequence of the step gets the cause)
            self.log(f"decode{self.instance}: decode step failed: {exc}\n{traceback.format_exc()}")
            for rq in list(batch):
                self._end_error(rq, f"decode step failed: {type(exc).__name__}: {exc}")
            return
        now = time.monotonic()
        self.metrics.steps.inc()
        self.metrics.step_s.observe(now - t0)
        self.metrics.generation_tokens.inc(len(batch))
        self.metrics.batch_seqs.observe(len(batch))
        for rq, tok in zip(list(batch), nxt):
            rq.tokens += 1
            rq.last = tok
            self.metrics.itl_s.observe(now - rq.t_last)
            rq.t_last = now
            gen = rq.gen
            if rq.tokens >= gen.max_tokens:
                self._finish(rq, "length", (tok,))
            elif tok == EOS_TOKEN and not gen.ignore_eos:
                self._finish(rq, "stop", (tok,))
            else:
                self._emit(rq, TokenEvent(tokens=(tok,)))

    # ---- ends -----------------------------------------------------------------------------------

    def _record(self, rq: _Req) -> dict:
        return {"decode": self.instance, "handoff_s": rq.handoff_s, "out_tokens": rq.tokens}

    def _finish(self, rq: _Req, reason: str, tokens: tuple[int, ...] = ()) -> None:
        self.metrics.finished.labels(reason).inc()
        self._emit(rq, TokenEvent(tokens=tokens, done=True, finish_reason=reason, record=self._record(rq)))
        self._drop(rq)

    def _end_error(self, rq: _Req, reason: str) -> None:
        self._emit(rq, TokenEvent(done=True, error=reason, record=self._record(rq)))
        if rq.state != EXPECTED:
            self.metrics.finished.labels("error").inc()
        self._drop(rq)

    def _emit(self, rq: _Req, ev: TokenEvent) -> None:
        if rq.out is not None:
            self.loop.call_soon_threadsafe(rq.out.put_nowait, ev)

    def _drop(self, rq: _Req) -> None:
        self._forget_ranks(rq, rq.live_sets)
        self._free(rq)
        self.reqs.pop(rq.request_id, None)
        if rq in self.running:
            self.running.remove(rq)
        rq.out = None
        rq.state = "done"
        self._gauges()

    def _forget_ranks(self, rq: _Req, sets) -> None:
        for i in list(sets):
            for dr in self.ranks[i]:
                try:
                    dr.forget(rq.request_id)
                except HandoffError:
                    pass
            if i in rq.live_sets:
                rq.live_sets.remove(i)

    def _free(self, rq: _Req) -> None:
        for r, p in enumerate(rq.pages):
            self.free[r].extend(reversed(p))
        rq.pages = [[] for _ in rq.pages]

    def _gauges(self) -> None:
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.reqs) - len(self.running))
        self.metrics.kv_usage.set(self.kv_usage)


def _resolve(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
