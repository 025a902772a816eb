"""Decode-rank side of the handoff: a registered landing pool, credits, scatter into paged KV.

Primitives, in call order (one thread drives a ``DecodeRank``; nothing here starts threads):
    ``DecodeRank(rank, caches, transport, stages=..., slots=..., slot_bytes=...)``  allocates and
        exposes the landing pool (``slots`` slots of ``slot_bytes`` <= 8 MiB) and binds a ZMQ ROUTER
        on 127.0.0.1 (``endpoint``). The pool is split evenly between the prefill stages: stage
        ``s`` owns slots ``s*k .. s*k + k - 1`` (``k = slots // stages``) and holds them as credits.
    ``expect(request_id, block_ids, parts)``  pages are allocated: tell every stage to send (WANT).
    ``poll(timeout_s)``  handle side-channel messages: a READY (or a READIES batch) is scattered
        straight from its slots with ``kernels.ScatterDcp`` (one launch per message), then the slots
        are credited back to their stage (one CREDIT per message). A READIES with a ``fence`` (sent
        at submit time over a transport with device-side completion) is accepted at once and
        scattered when ``poll`` sees the fence complete (``transport.open_fence(...).query()``:
        a host check, so a writer that dies never blocks this rank's stream).
    ``wait(request_id, timeout_s) -> HandoffResult``  poll until every stage's part has been
        scattered (ready for decode); raises ``HandoffError`` on a failure or at the deadline.
    ``forget(request_id)``, ``close()`` (closes the socket and the transport).

Faults: a request that fails while fenced writes are pending quarantines their slots (their bytes
may still land). An ABORT names the slots whose writes failed; they are quarantined (never scattered, never
credited) for ``quarantine_s`` (longer than the engine's transfer timeouts, so no late byte can land
after the slot is reused), then credited back. A READY whose nonce is stale, or for a request that
failed or was forgotten, is dropped and its slot credited back. A request whose deadline passes in
``wait`` is failed and every stage is told (FAIL), so a stage still sending stops.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import zmq

from kvpool.backend.handoff import messages as m
from kvpool.backend.handoff.metrics import HandoffResult
from kvpool.backend.handoff.transport import Transport
from kvpool.kernels import ScatterDcp
from kvpool.policy.layout import DEFAULT_MAX_WRITE_BYTES, HandoffPlan

PENDING, READY, FAILED = "pending", "ready", "failed"
_POLLIN = int(zmq.POLLIN)


@dataclass(frozen=True)
class StagePart:
    """What one prefill stage sends this rank for one request.

    Attributes:
        plan: the stage's handoff plan (its layers, the request's tokens, the decode ranks).
        layer_start: index, in this rank's ``caches``, of the stage's first layer.
    """

    plan: HandoffPlan
    layer_start: int


@dataclass
class _Request:
    request_id: str
    nonce: int
    block_ids: torch.Tensor
    parts: dict[int, StagePart]
    expected: dict[int, dict[int, int]]          # stage -> {offset_bytes: nbytes}
    t_start: float
    landed: dict[int, set[int]] = field(default_factory=dict)
    unfinished: int = 0                          # scatters launched but not yet complete (GPU)
    stage_end_s: dict[int, float] = field(default_factory=dict)
    state: str = PENDING
    error: str = ""
    nbytes: int = 0
    writes: int = 0
    scatter_s: float = 0.0
    end_s: float = 0.0
    first_s: float = 0.0                         # first READY(IES) of the request handled (monotonic)
    launched_s: float = 0.0                      # last scatter launched (monotonic)
    wanted: set[int] = field(default_factory=set)  # stages the WANT reached (the others get it on ATTACH)


class DecodeRank:
    """One decode rank's landing pool and side channel.

    Args:
        rank: this rank's DCP index.
        caches: this rank's per-layer paged caches (all layers of the model, in layer order).
        transport: how prefill stages write into the landing pool.
        stages: prefill stages that send to this rank (the pool is split between them).
        slots, slot_bytes: landing pool geometry; ``slot_bytes`` must hold the largest write.
        endpoint: ZMQ endpoint to bind (``tcp://127.0.0.1:*`` picks a free port).
        quarantine_s: how long a slot of a failed write stays out of use.
        validate, backend: passed to ``kernels.ScatterDcp``.
    """

    def __init__(
        self,
        rank: int,
        caches: Sequence[torch.Tensor],
        transport: Transport,
        *,
        stages: int,
        slots: int = 32,
        slot_bytes: int = DEFAULT_MAX_WRITE_BYTES,
        endpoint: str = "tcp://127.0.0.1:*",
        quarantine_s: float = 60.0,
        validate: bool = True,
        backend: str = "auto",
    ) -> None:
        if stages <= 0 or slots < stages:
            raise ValueError(f"need slots >= stages > 0, got slots={slots} stages={stages}")
        if not 0 < slot_bytes <= DEFAULT_MAX_WRITE_BYTES:
            raise ValueError(f"slot_bytes must be in (0, 8 MiB], got {slot_bytes}")
        self.rank = rank
        self.caches = list(caches)
        self.transport = transport
        self.stages = stages
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.slots_per_stage = slots // stages
        self.quarantine_s = quarantine_s
        self.validate = validate
        self.backend = backend
        self.epoch = random.getrandbits(31)
        self.device = self.caches[0].device
        self.landing = transport.allocate(slots * slot_bytes, self.device)
        self.descriptor = transport.expose(self.landing)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stage_ident: dict[int, bytes] = {}
        self._reqs: dict[str, _Request] = {}
        self._quarantine: dict[int, float] = {}   # slot -> release time
        self._events: list[tuple[object, int, tuple[int, ...], _Request]] = []  # (event, stage, slots, request)
        self._fenced: list[tuple[object, int, list[tuple[int, int, int]], _Request]] = []  # (fence, stage, landed, request)
        self.fenced_readies = 0
        self._scatters: dict[tuple[int, int], ScatterDcp] = {}     # (layer_start, layers) -> bound scatter
        self.dropped_readies = 0
        self.landed_writes = 0

    # ---- public API -------------------------------------------------------------------------

    @property
    def quarantined_slots(self) -> list[int]:
        """Slots now out of use after a failed write."""
        return sorted(self._quarantine)

    def stage_slots(self, stage: int) -> range:
        """The landing slots owned by ``stage``."""
        k = self.slots_per_stage
        return range(stage * k, (stage + 1) * k)

    def expect(self, request_id: str, block_ids: torch.Tensor, parts: Mapping[int, StagePart]) -> int:
        """Register a request whose pages ``block_ids`` (this rank's local table) are allocated, and
        ask every stage in ``parts`` to send. Returns the nonce. Sizes are checked here."""
        if request_id in self._reqs:
            raise ValueError(f"request {request_id!r} is already expected on rank {self.rank}")
        expected: dict[int, dict[int, int]] = {}
        for stage, part in parts.items():
            if not 0 <= stage < self.stages:
                raise ValueError(f"stage {stage} out of range 0..{self.stages - 1}")
            plan = part.plan
            if part.layer_start < 0 or part.layer_start + plan.layers > len(self.caches):
                raise ValueError(f"stage {stage}'s layers {part.layer_start}+{plan.layers} exceed {len(self.caches)}")
            writes = plan.writes(self.rank)
            if writes and max(w.nbytes for w in writes) > self.slot_bytes:
                raise ValueError(f"plan writes up to {plan.max_write_bytes} B, slots hold {self.slot_bytes} B")
            expected[stage] = {w.offset_bytes: w.nbytes for w in writes}
        nonce = random.getrandbits(62)
        req = _Request(request_id, nonce, block_ids, dict(parts), expected, time.monotonic(),
                       landed={s: set() for s in parts})
        self._reqs[request_id] = req
        for stage in parts:
            if self._send(stage, m.Want(request_id, nonce, self.rank)):
                req.wanted.add(stage)
        self._check_complete(req)
        return nonce

    @property
    def scattering(self) -> bool:
        """Scatters launched, or fenced writes accepted, whose completion ``poll`` has not seen yet
        (the caller should keep polling rather than sleep)."""
        return bool(self._events or self._fenced)

    def times(self, request_id: str) -> tuple[float, float, float]:
        """``(first READY handled, last scatter launched, ready)`` of a request, monotonic seconds
        (0 where not reached yet): where its handoff time went on this rank."""
        req = self._reqs[request_id]
        return req.first_s, req.launched_s, req.end_s

    def status(self, request_id: str) -> str:
        """``"pending"``, ``"ready"`` or ``"failed"``."""
        return self._reqs[request_id].state

    def error(self, request_id: str) -> str:
        return self._reqs[request_id].error

    def poll(self, timeout_s: float = 0.0, max_messages: int = 256) -> int:
        """Handle what has arrived, at most ``max_messages`` (waiting up to ``timeout_s`` for the
        first); returns the number of messages handled."""
        handled = 0
        self._finish_events()
        self._release_quarantine()
        if timeout_s <= 0:
            arrived = int(self._sock.get(zmq.EVENTS)) & _POLLIN   # no Poller built per call, no enum ops
        else:
            arrived = self._sock.poll(int(timeout_s * 1000), zmq.POLLIN)
        if arrived:
            # EVENTS before each recv: a NOBLOCK recv on an empty socket raises (tens of microseconds)
            while handled < max_messages and (handled == 0 or int(self._sock.get(zmq.EVENTS)) & _POLLIN):
                try:
                    ident, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(ident, payload)
                handled += 1
        self._finish_events()
        return handled

    def wait(self, request_id: str, timeout_s: float) -> HandoffResult:
        """Poll until the request is ready (every stage's part scattered) and return its metrics.

        Raises:
            HandoffError: a stage aborted, or ``timeout_s`` passed (the request is then failed and
                every stage is told).
        """
        req = self._reqs[request_id]
        deadline = time.monotonic() + timeout_s
        while req.state == PENDING:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(req, f"not ready within {timeout_s:.3g} s on decode rank {self.rank}", tell=True)
                break
            self.poll(min(left, 0.0 if self._fenced else 0.01 if self._events else 0.05))
        if req.state == FAILED:
            raise m.HandoffError(f"request {request_id}: {req.error}", request_id)
        return HandoffResult(request_id, self.rank, req.nbytes, req.writes, req.end_s - req.t_start,
                             req.scatter_s, {s: t - req.t_start for s, t in sorted(req.stage_end_s.items())})

    def forget(self, request_id: str) -> None:
        """Drop a finished or failed request (a late READY for it is then credited back)."""
        req = self._reqs.pop(request_id, None)
        if req is not None and req.state == PENDING:
            self._fail(req, "forgotten", tell=True)

    def close(self) -> None:
        self._sock.close(0)
        self.transport.close()

    # ---- internals --------------------------------------------------------------------------

    def _send(self, stage: int, msg: object) -> bool:
        ident = self._stage_ident.get(stage)
        if ident is None:
            return False
        try:
            self._sock.send_multipart([ident, m.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False  # the stage is gone (ROUTER_MANDATORY) or its queue is full
        return True

    def _handle(self, ident: bytes, payload: bytes) -> None:
        try:
            msg = m.decode(payload)
        except ValueError:
            return
        if isinstance(msg, m.Attach):
            self._attach(ident, msg)
        elif isinstance(msg, m.Ready):
            self._ready(msg.request_id, msg.nonce, msg.stage, [(msg.slot, msg.offset_bytes, msg.nbytes)])
        elif isinstance(msg, m.Readies):
            if len(msg.slots) == len(msg.offsets) == len(msg.sizes):
                self._ready(msg.request_id, msg.nonce, msg.stage, list(zip(msg.slots, msg.offsets, msg.sizes)),
                            msg.fence)
            if msg.done_writes >= 0:
                self._done(msg.request_id, msg.nonce, msg.stage, msg.done_writes)
        elif isinstance(msg, m.Done):
            self._done(msg.request_id, msg.nonce, msg.stage, msg.writes)
        elif isinstance(msg, m.Abort):
            own = self.stage_slots(msg.stage)
            self._quarantine_slots(tuple(slot for slot in msg.quarantined if slot in own))
            req = self._reqs.get(msg.request_id)
            if req is not None and req.nonce == msg.nonce and req.state == PENDING:
                self._fail(req, f"stage {msg.stage} aborted: {msg.reason}", tell=False)

    def _done(self, request_id: str, nonce: int, stage: int, writes: int) -> None:
        """A stage says it sent ``writes`` writes: every one must have been READY-ed, as planned."""
        req = self._reqs.get(request_id)
        if req is not None and req.nonce == nonce and req.state == PENDING:
            exp = req.expected.get(stage, {})
            if writes != len(exp) or len(req.landed.get(stage, ())) != len(exp):
                self._fail(req, f"stage {stage} sent {writes} writes, {len(req.landed.get(stage, ()))} "
                                f"READY arrived, plan has {len(exp)}", tell=True)

    def _attach(self, ident: bytes, msg: m.Attach) -> None:
        if not 0 <= msg.stage < self.stages:
            return
        self._stage_ident[msg.stage] = ident
        granted = tuple(s for s in self.stage_slots(msg.stage) if s not in self._quarantine)
        self._send(msg.stage, m.Landing(self.rank, self.epoch, self.descriptor, self.slot_bytes, granted))
        for req in self._reqs.values():
            # a request complete on this rank (nothing of it lands here) still needs its WANT: the stage
            # waits for every rank's nonce before it sends anything
            if req.state != FAILED and msg.stage in req.parts and (req.state == PENDING or msg.stage not in req.wanted):
                if self._send(msg.stage, m.Want(req.request_id, req.nonce, self.rank)):
                    req.wanted.add(msg.stage)

    def _ready(self, request_id: str, nonce: int, stage: int, landed: list[tuple[int, int, int]],
               fence: str = "") -> None:
        """Writes ``(slot, offset_bytes, nbytes)`` of one request and stage have landed (or will,
        once ``fence`` completes): scatter them (one launch), credit their slots back once the
        scatter has finished."""
        own = self.stage_slots(stage) if 0 <= stage < self.stages else range(0)
        landed = [x for x in landed if x[0] in own and x[0] not in self._quarantine]
        if not landed:
            self.dropped_readies += 1
            return
        slots = tuple(slot for slot, _, _ in landed)
        req = self._reqs.get(request_id)
        if req is None or req.nonce != nonce or req.state != PENDING:
            self.dropped_readies += len(landed)
            self._send(stage, m.Credit(slots))
            return
        exp = req.expected.get(stage, {})
        offsets = [off for _, off, _ in landed]
        bad = [(off, n) for _, off, n in landed if exp.get(off) != n or off in req.landed[stage]]
        if bad or len(set(offsets)) != len(offsets):
            self._send(stage, m.Credit(slots))
            off, n = bad[0] if bad else (offsets[0], landed[0][2])
            self._fail(req, f"stage {stage} sent a write ({off}, {n}) not in the plan", tell=True)
            return
        if not req.first_s:
            req.first_s = time.monotonic()
        req.landed[stage].update(offsets)
        req.nbytes += sum(n for _, _, n in landed)
        req.writes += len(landed)
        self.landed_writes += len(landed)
        if fence:
            try:
                ev = self.transport.open_fence(fence, self.device)
            except (AttributeError, RuntimeError, ValueError) as exc:
                self._quarantine_slots(slots)
                self._fail(req, f"stage {stage}'s fence cannot be opened: {exc}", tell=True)
                return
            self.fenced_readies += 1
            req.unfinished += 1
            self._fenced.append((ev, stage, landed, req))
            return
        self._scatter(req, stage, landed)

    def _scatter(self, req: _Request, stage: int, landed: list[tuple[int, int, int]]) -> None:
        """Launch the scatter of landed writes (one kernel launch); credit the slots back when it
        has finished (CPU: now)."""
        slots = tuple(slot for slot, _, _ in landed)
        part = req.parts[stage]
        t0 = time.perf_counter()
        try:
            self._scatter_op(part)(self.landing, req.block_ids, part.plan, self.rank,
                                   [(slot * self.slot_bytes, off, n) for slot, off, n in landed], validate=self.validate)
        except (ValueError, TypeError, IndexError) as exc:
            self._send(stage, m.Credit(slots))
            self._fail(req, f"scatter of stage {stage}'s write failed: {exc}", tell=True)
            return
        req.scatter_s += time.perf_counter() - t0
        req.launched_s = time.monotonic()
        if self.device.type == "cpu":
            self._send(stage, m.Credit(slots))
            self._check_complete(req)
        else:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            req.unfinished += 1
            self._events.append((ev, stage, slots, req))

    def _scatter_op(self, part: StagePart) -> ScatterDcp:
        key = (part.layer_start, part.plan.layers)
        op = self._scatters.get(key)
        if op is None:
            op = self._scatters[key] = ScatterDcp(self.caches[part.layer_start:part.layer_start + part.plan.layers],
                                                  backend=self.backend)
        return op

    def _finish_fences(self) -> None:
        """Scatter the fenced writes that have landed; a failed request's slots are quarantined."""
        keep = []
        for item in self._fenced:
            ev, stage, landed, req = item
            if req.state != PENDING:   # failed meanwhile (_fail quarantined the slots)
                continue
            try:
                done = ev.query()
            except RuntimeError as exc:   # the writer's context is gone
                req.unfinished -= 1
                self._quarantine_slots(tuple(slot for slot, _, _ in landed))
                self._fail(req, f"stage {stage}'s fence failed: {exc}", tell=True)
                continue
            if not done:
                keep.append(item)
                continue
            req.unfinished -= 1
            self._scatter(req, stage, landed)
        self._fenced = keep

    def _quarantine_slots(self, slots: tuple[int, ...]) -> None:
        until = time.monotonic() + self.quarantine_s
        for slot in slots:
            self._quarantine[slot] = until

    def _finish_events(self) -> None:
        if self._fenced:
            self._finish_fences()
        if not self._events:
            return
        keep = []
        for ev, stage, slots, req in self._events:
            if ev.query():
                self._send(stage, m.Credit(slots))
                req.unfinished -= 1
                self._check_complete(req)
            else:
                keep.append((ev, stage, slots, req))
        self._events = keep

    def _check_complete(self, req: _Request) -> None:
        if req.state != PENDING or req.unfinished:
            return
        now = time.monotonic()
        for stage, exp in req.expected.items():
            if stage not in req.stage_end_s and len(req.landed[stage]) == len(exp):
                req.stage_end_s[stage] = now
        if len(req.stage_end_s) == len(req.expected):
            req.state = READY
            req.end_s = now

    def _fail(self, req: _Request, reason: str, tell: bool) -> None:
        if req.state != PENDING:
            return
        req.state = FAILED
        req.error = reason
        pending = [x for x in self._fenced if x[3] is req]
        if pending:   # accepted writes that may still land: never scattered, slots out of use
            self._fenced = [x for x in self._fenced if x[3] is not req]
            for _, _, landed, _ in pending:
                self._quarantine_slots(tuple(slot for slot, _, _ in landed))
        if tell:
            for stage in req.parts:
                self._send(stage, m.Fail(req.request_id, req.nonce, self.rank, reason))

    def _release_quarantine(self) -> None:
        if not self._quarantine:
            return
        now = time.monotonic()
        for slot in [s for s, t in self._quarantine.items() if t <= now]:
            del self._quarantine[slot]
            self._send(slot // self.slots_per_stage, m.Credit((slot,)))
