"""Prefill-stage side of the handoff: gather into staging, one transport write per slot, notify.

Primitives, in call order (one thread drives a ``PrefillStage``; nothing here starts threads):
    ``PrefillStage(stage, transport, staging_bytes=...)``  allocates and registers the staging
        buffer (``gather_dcp`` writes the R rank buffers back to back into it).
    ``connect(endpoints) -> DecodeTarget``  attach to every rank of one decode instance (ZMQ DEALER
        per rank, 127.0.0.1) and learn each rank's landing pool and the slots granted to this stage.
    ``send(request_id, target, caches, block_ids, plan) -> StageReport``  wait for every rank's
        WANT, gather, then for each write of ``plan.writes(r)`` (in the plan's order, ranks
        interleaved): take a credit (a free slot of rank r), submit one write of exactly that
        write's bytes into the slot, and on completion send READY; finally DONE to every rank.
        The number of writes is exactly ``plan.batched_writes``. Over a transport with device-side
        completion (``fence``: CUDA/HIP IPC), READY goes out at submit time with the fence, and
        the rank scatters once the fence completes: the copy's completion does not wait for this
        stage's next poll and a side-channel hop.

Bounds and faults (every wait is bounded):
    * at most ``max_inflight_per_peer`` writes in flight to one rank (validated <= 1024, the engine's
      per-peer admission queue);
    * no credit for ``credit_timeout_s`` while writes wait for one -> ``CreditTimeout``;
    * a write that fails -> ``TransferFailed``; the side channel of a rank disconnects (ZMQ
      heartbeats: a dead or hung decode is seen within ``peer_timeout_s``) -> ``PeerLost``; a rank's
      FAIL -> ``HandoffError``; the whole send past ``timeout_s`` -> ``HandoffError``.
    On any of these, every slot with a write in flight (or failed) is quarantined: it is not used
    again until the decode rank credits it back after its quarantine; every rank gets an ABORT
    naming its quarantined slots; the error is raised. A target whose rank was lost stays unusable;
    the caller retries on another decode instance (``connect`` again).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpool.backend.handoff import messages as m
from kvpool.backend.handoff.metrics import StageReport
from kvpool.backend.handoff.transport import DONE, FAILED, Peer, Transport, WriteHandle
from kvpool.kernels import GatherDcp, rank_buffer_offset_bytes
from kvpool.policy.layout import HandoffPlan, Write

ENGINE_PEER_QUEUE = 1024  # MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER default
_POLLIN = int(zmq.POLLIN)


@dataclass
class RankLink:
    """This stage's view of one decode rank."""

    endpoint: str
    sock: zmq.Socket
    monitor: zmq.Socket
    rank: int = -1
    peer: Peer | None = None
    slot_bytes: int = 0
    credits: deque = field(default_factory=deque)
    wants: dict[str, int] = field(default_factory=dict)
    fails: dict[str, str] = field(default_factory=dict)
    quarantined: set[int] = field(default_factory=set)
    lost: str = ""
    inflight: int = 0                                  # writes in flight to this rank, all requests


@dataclass
class DecodeTarget:
    """One decode instance: its ranks in rank order."""

    links: list[RankLink]

    @property
    def ranks(self) -> int:
        return len(self.links)

    @property
    def alive(self) -> bool:
        return not any(link.lost for link in self.links)


@dataclass
class _Outgoing:
    """One request being sent by a stage."""

    request_id: str
    links: list[RankLink]
    plan: HandoffPlan
    nonces: list[int]
    staging: torch.Tensor
    after: object                                      # GPU event at the end of the gather, or None
    queues: list[deque]                                # per link: writes not yet submitted
    bases: list[int]                                   # per link: rank buffer offset in staging
    inflight: list[list[tuple[WriteHandle, int, Write]]]
    t0: float
    deadline: float
    gather_s: float
    tt: float = 0.0                                    # first submit
    writes: int = 0
    nbytes: int = 0
    peak: int = 0
    credit_wait_s: float = 0.0
    error: m.HandoffError | None = None
    report: StageReport | None = None
    done_sent: list[bool] = field(default_factory=list)
    announced: set[int] = field(default_factory=set)   # ids of handles whose READY went out with a fence

    def __post_init__(self) -> None:
        self.done_sent = [False] * len(self.links)

    @property
    def busy(self) -> bool:
        return any(self.queues) or any(self.inflight)


class PrefillStage:
    """One prefill pipeline stage's sender.

    Args:
        stage: this stage's index (decode ranks partition their landing pools by it).
        transport: the transport (same kind as the decode ranks').
        staging_bytes: staging capacity; a request's stage share (``plan.total_bytes``) must fit.
        device: where the staging buffer lives (the stage's GPU, or the CPU).
        max_inflight_per_peer: writes in flight to one decode rank, 1..1024.
        credit_timeout_s: longest wait for a credit while writes are waiting for one.
        connect_timeout_s: longest wait for a rank's LANDING after attaching.
        peer_timeout_s: ZMQ heartbeat timeout: a silent rank is declared lost after it.
        validate, backend: passed to ``gather_dcp``.
        staging_buffers: staging buffers of ``staging_bytes`` each. With 2 or more, the gather of
            the next started request runs while the previous one's writes are in flight.
        device_fences: send READY at submit time with the transport's fence where it has one
            (``False``: always after this stage has seen the write complete).
    """

    def __init__(
        self,
        stage: int,
        transport: Transport,
        *,
        staging_bytes: int,
        device: torch.device | str = "cpu",
        max_inflight_per_peer: int = 64,
        credit_timeout_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        peer_timeout_s: float = 2.0,
        validate: bool = True,
        backend: str = "auto",
        staging_buffers: int = 1,
        device_fences: bool = True,
    ) -> None:
        if staging_buffers < 1:
            raise ValueError(f"staging_buffers must be >= 1, got {staging_buffers}")
        if not 1 <= max_inflight_per_peer <= ENGINE_PEER_QUEUE:
            raise ValueError(f"max_inflight_per_peer must be in 1..{ENGINE_PEER_QUEUE}, got {max_inflight_per_peer}")
        for name, v in (("credit_timeout_s", credit_timeout_s), ("connect_timeout_s", connect_timeout_s),
                        ("peer_timeout_s", peer_timeout_s)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        self.stage = stage
        self.transport = transport
        self.max_inflight_per_peer = max_inflight_per_peer
        self.credit_timeout_s = credit_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.peer_timeout_s = peer_timeout_s
        self.validate = validate
        self.backend = backend
        self.staging_bytes = staging_bytes
        self.staging = torch.empty(staging_bytes * staging_buffers, dtype=torch.uint8, device=device)
        transport.register_source(self.staging)
        self._buffers = [self.staging.narrow(0, i * staging_bytes, staging_bytes) for i in range(staging_buffers)]
        self._owner: list[_Outgoing | None] = [None] * staging_buffers
        self._out: dict[str, _Outgoing] = {}
        self._gathers: OrderedDict[tuple, tuple] = OrderedDict()
        self._plans: dict[HandoffPlan, tuple] = {}
        group = getattr(transport, "submit_group", None)
        self._submit_group = group if group is not None else (
            lambda jobs, src, after=None: [transport.submit_writes(p, src, w, after) for p, w in jobs])
        self._fence = getattr(transport, "fence", None) if device_fences else None
        self._last_progress = time.monotonic()
        self._poller: tuple[tuple, zmq.Poller] | None = None
        self.name = f"stage{stage}-{uuid.uuid4().hex[:8]}"
        self._ctx = zmq.Context.instance()
        self._links: list[RankLink] = []
        self.submitted_writes = 0

    # ---- connection -------------------------------------------------------------------------

    def connect(self, endpoints: Sequence[str]) -> DecodeTarget:
        """Attach to every rank of a decode instance; ``HandoffError`` if one does not answer
        within ``connect_timeout_s`` or the ranks are not exactly 0..R-1."""
        links = []
        for ep in endpoints:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, f"{self.name}-{len(self._links) + len(links)}".encode())
            sock.setsockopt(zmq.HEARTBEAT_IVL, 200)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.peer_timeout_s * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TTL, int(self.peer_timeout_s * 1000))
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(ep)
            sock.send(m.encode(m.Attach(self.stage, self.name)))
            links.append(RankLink(ep, sock, mon))
        self._links.extend(links)
        deadline = time.monotonic() + self.connect_timeout_s
        while any(link.peer is None for link in links):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [link.endpoint for link in links if link.peer is None]
                self._drop(links)
                raise m.PeerLost(f"stage {self.stage}: no LANDING within {self.connect_timeout_s} s from {missing}")
            self._wait(links, left)
        links.sort(key=lambda link: link.rank)
        if [link.rank for link in links] != list(range(len(links))):
            self._drop(links)
            raise m.HandoffError(f"decode ranks must be 0..{len(links) - 1}, got {[lk.rank for lk in links]}")
        return DecodeTarget(links)

    def disconnect(self, target: DecodeTarget) -> None:
        self._drop(target.links)

    def close(self) -> None:
        """Close every side channel and the transport."""
        self._drop(list(self._links))
        self.transport.close()

    def credits(self, target: DecodeTarget) -> list[int]:
        """Free slots held per rank (after handling what has arrived)."""
        self._drain(target.links)
        return [len(link.credits) for link in target.links]

    # ---- sending ----------------------------------------------------------------------------

    def send(
        self,
        request_id: str,
        target: DecodeTarget,
        caches: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        plan: HandoffPlan,
        timeout_s: float = 60.0,
    ) -> StageReport:
        """Hand this stage's KV of one request to every rank of ``target`` (see module docstring):
        ``start`` then ``finish``.

        Args:
            request_id: the request, as the decode ranks ``expect``-ed it.
            caches, block_ids, plan: as for ``kernels.gather_dcp`` (this stage's layers).
            timeout_s: bound on the whole call, WANTs included.
        Returns:
            the stage's ``StageReport``; ``handoff_writes == plan.batched_writes``.
        """
        self.start(request_id, target, caches, block_ids, plan, timeout_s)
        return self.finish(request_id)

    def start(
        self,
        request_id: str,
        target: DecodeTarget,
        caches: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        plan: HandoffPlan,
        timeout_s: float = 60.0,
    ) -> None:
        """Begin a handoff and return once its writes are queued: wait for every rank's WANT and
        for a free staging buffer (driving the requests already started meanwhile), gather, submit
        the writes that credits allow. ``progress`` / ``finish`` drive it on; several requests may
        be in flight (their writes take credits in start order). ``timeout_s`` bounds the request
        from here to its last write; errors are raised by ``finish`` (or here, before the gather).
        """
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        links = target.links
        if request_id in self._out:
            raise ValueError(f"request {request_id!r} is already being sent by stage {self.stage}")
        if plan.ranks != target.ranks:
            raise ValueError(f"plan has {plan.ranks} ranks, target has {target.ranks}")
        if plan.total_bytes > self.staging_bytes:
            raise ValueError(f"stage share {plan.total_bytes} B exceeds staging {self.staging_bytes} B")
        writes, bases, biggest = self._plan_info(plan)
        for link in links:
            if biggest[link.rank] > link.slot_bytes:
                raise ValueError(f"write of {biggest[link.rank]} B exceeds rank {link.rank}'s {link.slot_bytes} B slots")
        # 1. every rank has allocated pages and sent its nonce
        while not all(request_id in link.wants for link in links):
            self._check(links, request_id, deadline, "waiting for WANT")
            self._step(min(0.05, deadline - time.monotonic()))
        nonces = [link.wants.pop(request_id) for link in links]
        # 2. a staging buffer whose previous writes have all completed
        buf = self._free_buffer()
        while buf is None:
            self._check(links, request_id, deadline, "waiting for a staging buffer")
            self._step(0.0005)
            buf = self._free_buffer()
        # 3. gather every rank's tokens into it
        tg = time.monotonic()
        staging = self._buffers[buf].narrow(0, 0, plan.total_bytes)
        self._gather_op(caches)(block_ids, plan, out=staging, validate=self.validate)
        after = None
        if staging.is_cuda:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(staging.device))
        gather_s = time.monotonic() - tg
        out = _Outgoing(request_id, links, plan, nonces, staging, after,
                        [deque(writes[link.rank]) for link in links],
                        [bases[link.rank] for link in links],
                        [[] for _ in links], t0, deadline, gather_s)
        self._owner[buf] = out
        self._out[request_id] = out
        self._last_progress = time.monotonic()
        self._pump()

    def progress(self, timeout_s: float = 0.0) -> None:
        """Drive every started request once: side-channel messages, writes that credits now allow,
        completed writes (READY), finished requests (DONE), faults; waits up to ``timeout_s`` for a
        message when nothing moved."""
        self._step(timeout_s)

    def finish(self, request_id: str) -> StageReport:
        """Drive the requests until ``request_id``'s writes have all completed (every READY and DONE
        sent) and return its report; raise its ``HandoffError`` if it failed. Bounded by the
        request's own ``timeout_s`` (from ``start``)."""
        out = self._out.get(request_id)
        if out is None:
            raise ValueError(f"request {request_id!r} was not started on stage {self.stage}")
        while out.report is None and out.error is None:
            # a write completing sends no message: poll the side channel without blocking while
            # any request's writes are in flight
            self._step(0.0005 if any(any(o.inflight) for o in self._out.values()) else 0.01)
        del self._out[request_id]
        if out.error is not None:
            raise out.error
        return out.report

    def pending(self) -> list[str]:
        """Requests started and not yet collected by ``finish``."""
        return list(self._out)

    # ---- pipeline internals -------------------------------------------------------------------

    def _gather_op(self, caches: Sequence[torch.Tensor]) -> GatherDcp:
        key = tuple(id(c) for c in caches)
        hit = self._gathers.get(key)
        if hit is not None and all(c.data_ptr() == p for c, p in zip(hit[0], hit[1])):
            self._gathers.move_to_end(key)
            return hit[2]
        op = GatherDcp(caches, backend=self.backend)
        self._gathers[key] = (list(caches), [c.data_ptr() for c in caches], op)
        if len(self._gathers) > 8:
            self._gathers.popitem(last=False)
        return op

    def _plan_info(self, plan: HandoffPlan) -> tuple[list[list[Write]], list[int], list[int]]:
        """Per rank: the plan's writes, the rank buffer's offset in staging, the largest write
        (built once per plan: a request's start and READIES read them)."""
        hit = self._plans.get(plan)
        if hit is None:
            writes = [plan.writes(r) for r in range(plan.ranks)]
            hit = (writes, [rank_buffer_offset_bytes(plan, r) for r in range(plan.ranks)],
                   [max((w.nbytes for w in ws), default=0) for ws in writes])
            self._plans[plan] = hit
            if len(self._plans) > 64:
                self._plans.pop(next(iter(self._plans)))
        return hit

    def _free_buffer(self) -> int | None:
        for i, owner in enumerate(self._owner):
            if owner is None or not owner.busy:
                return i
        return None

    def _active(self) -> list[_Outgoing]:
        return [o for o in self._out.values() if o.error is None and o.report is None]

    def _pump(self, active: list[_Outgoing] | None = None) -> bool:
        """Submit queued writes (start order) into the credits the ranks hold, one transport call
        per request for all its ranks (``submit_group``); True if any."""
        moved = False
        for out in self._active() if active is None else active:
            if out.error is not None:
                continue
            jobs, meta = [], []
            for i, link in enumerate(out.links):
                q = out.queues[i]
                n = min(len(q), len(link.credits), self.max_inflight_per_peer - link.inflight)
                if n <= 0:
                    continue
                batch = [(link.credits.popleft(), q.popleft()) for _ in range(n)]
                base, sb = out.bases[i], link.slot_bytes
                jobs.append((link.peer, [(base + w.offset_bytes, slot * sb, w.nbytes) for slot, w in batch]))
                meta.append((i, link, batch))
            if not jobs:
                continue
            if not out.tt:
                out.tt = time.monotonic()
            group = self._submit_group(jobs, out.staging, out.after)
            for (i, link, batch), handles in zip(meta, group):
                out.inflight[i].extend((h, slot, w) for h, (slot, w) in zip(handles, batch))
                link.inflight += len(batch)
                self.submitted_writes += len(batch)
                out.peak = max(out.peak, link.inflight)
                token = self._fence(handles[-1]) if self._fence is not None and handles else None
                if token:   # one stream: the last handle's fence covers the batch
                    out.announced.update(id(h) for h in handles)
                    self._send_readies(out, i, link, batch, not out.queues[i], token)
            moved = True
        return moved

    def _send_readies(self, out: _Outgoing, i: int, link: RankLink, landed: list[tuple[int, Write]],
                      last: bool, fence: str = "") -> None:
        """READIES of ``landed`` ``(slot, write)`` to rank ``i``; ``last``: it carries the DONE."""
        msg = m.Readies(out.request_id, out.nonces[i], self.stage, tuple(s for s, _ in landed),
                        tuple(w.offset_bytes for _, w in landed), tuple(w.nbytes for _, w in landed),
                        len(self._plan_info(out.plan)[0][link.rank]) if last else -1, fence)
        if last:
            out.done_sent[i] = True
        link.sock.send(m.encode(msg))

    def _harvest(self, active: list[_Outgoing] | None = None) -> bool:
        """Poll in-flight writes; READY the completed ones (one message per rank), DONE finished
        requests; a failed write fails its request. True if anything completed."""
        moved = False
        running: set[int] = set()   # tokens seen running this pass (writes batched under one completion)
        for out in self._active() if active is None else active:
            if out.error is not None:
                continue
            for i, link in enumerate(out.links):
                fl = out.inflight[i]
                if not fl:
                    continue
                done = []
                failed = None
                for item in fl:
                    tok = item[0].token
                    if tok is not None and id(tok) in running:
                        continue
                    st = self.transport.poll(item[0])
                    if st == DONE:
                        done.append(item)
                    elif st == FAILED:
                        failed = item
                        break
                    elif tok is not None:
                        running.add(id(tok))
                if failed is not None:
                    _, slot, w = failed
                    self._fail_out(out, m.TransferFailed(
                        f"stage {self.stage}: write of {w.nbytes} B to rank {link.rank} slot {slot} failed",
                        out.request_id))
                    moved = True
                    break
                if not done:
                    continue
                gone = {id(item) for item in done}
                out.inflight[i] = [item for item in fl if id(item) not in gone]
                link.inflight -= len(done)
                last = not out.inflight[i] and not out.queues[i]   # this rank's part is complete: DONE rides along
                unannounced = [(slot, w) for h, slot, w in done if id(h) not in out.announced]
                if unannounced or (last and not out.done_sent[i]):
                    self._send_readies(out, i, link, unannounced, last)
                out.writes += len(done)
                out.nbytes += sum(w.nbytes for _, _, w in done)
                moved = True
            if out.error is None and not out.busy:
                for i, link in enumerate(out.links):
                    if not out.done_sent[i]:   # a rank with no writes (or whose last READIES was not final)
                        link.sock.send(m.encode(m.Done(out.request_id, out.nonces[i], self.stage,
                                                       len(self._plan_info(out.plan)[0][link.rank]),
                                                       out.plan.buffer_bytes(link.rank))))
                end = time.monotonic()
                out.report = StageReport(out.request_id, self.stage, out.nbytes, out.writes, out.gather_s,
                                         end - (out.tt or end), out.credit_wait_s, end - out.t0, out.peak)
        return moved

    def _fail_out(self, out: _Outgoing, exc: m.HandoffError) -> None:
        self._abort(out.links, out.request_id, out.nonces, out.inflight, str(exc))
        for i, link in enumerate(out.links):
            link.inflight -= len(out.inflight[i])
            out.inflight[i] = []
            out.queues[i].clear()
        out.error = exc

    def _step(self, timeout_s: float) -> None:
        """One round over every started request (see ``progress``)."""
        drained = self._drain(self._links)
        active = self._active()
        moved = self._pump(active)
        moved = self._harvest(active) or moved
        for out in active:
            if out.error is not None or out.report is not None:
                continue
            try:
                self._check(out.links, out.request_id, out.deadline, "sending")
            except m.HandoffError as exc:
                self._fail_out(out, exc)
                moved = True
        now = time.monotonic()
        if moved:
            self._last_progress = now
            return
        if drained:
            return   # the caller re-checks what it waits for (a WANT, a credit) before any wait
        starving = [o for o in self._active()
                    if any(q and not link.credits for q, link in zip(o.queues, o.links))]
        if starving and now - self._last_progress > self.credit_timeout_s:
            for out in starving:
                self._fail_out(out, m.CreditTimeout(f"stage {self.stage}: no credit for {self.credit_timeout_s} s",
                                                    out.request_id))
            return
        t_w = time.monotonic()
        self._wait(self._links, timeout_s)
        if starving:
            dt = time.monotonic() - t_w
            for out in starving:
                out.credit_wait_s += dt

    # ---- internals --------------------------------------------------------------------------

    def _abort(self, links, request_id, nonces, inflight, reason) -> None:
        for i, link in enumerate(links):
            slots = tuple(slot for _, slot, _ in inflight[i])
            link.quarantined.update(slots)
            if not link.lost:
                try:
                    link.sock.send(m.encode(m.Abort(request_id, nonces[i], self.stage, reason, slots)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # best effort: the rank's deadline fails the request anyway

    def _check(self, links: list[RankLink], request_id: str, deadline: float, doing: str) -> None:
        for link in links:
            if link.lost:
                raise m.PeerLost(f"stage {self.stage}: decode rank {link.rank} lost ({link.lost}) while {doing}",
                                 request_id)
            if request_id in link.fails:
                raise m.HandoffError(f"decode rank {link.rank} failed the request: {link.fails.pop(request_id)}",
                                     request_id)
        if time.monotonic() > deadline:
            raise m.HandoffError(f"stage {self.stage}: timed out while {doing}", request_id)

    def _wait(self, links: list[RankLink], timeout_s: float) -> None:
        key = tuple(id(link) for link in links)
        if self._poller is None or self._poller[0] != key:
            poller = zmq.Poller()
            for link in links:
                poller.register(link.sock, zmq.POLLIN)
                poller.register(link.monitor, zmq.POLLIN)
            self._poller = (key, poller)
        poller = self._poller[1]
        if poller.poll(int(max(0.0, timeout_s) * 1000) or 0):
            self._drain(links)

    def _drain(self, links: list[RankLink]) -> int:
        """Handle every message that has arrived; returns how many (socket events are checked
        first: a NOBLOCK recv on an empty socket raises, which costs tens of microseconds)."""
        handled = 0
        for link in links:
            while int(link.monitor.get(zmq.EVENTS)) & _POLLIN:   # int: enum flag ops cost microseconds
                try:
                    ev = recv_monitor_message(link.monitor, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if ev["event"] == zmq.EVENT_DISCONNECTED:
                    link.lost = "side channel disconnected"
            while int(link.sock.get(zmq.EVENTS)) & _POLLIN:
                try:
                    payload = link.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                handled += 1
                try:
                    msg = m.decode(payload)
                except ValueError:
                    continue
                if isinstance(msg, m.Landing):
                    link.rank = msg.rank
                    link.slot_bytes = msg.slot_bytes
                    link.peer = self.transport.open(msg.descriptor)
                    link.credits = deque(s for s in msg.slots if s not in link.quarantined)
                elif isinstance(msg, m.Credit):
                    for s in msg.slots:
                        link.quarantined.discard(s)
                        if s not in link.credits:
                            link.credits.append(s)
                elif isinstance(msg, m.Want):
                    link.wants[msg.request_id] = msg.nonce
                elif isinstance(msg, m.Fail):
                    link.fails[msg.request_id] = msg.reason
        return handled

    def _drop(self, links: list[RankLink]) -> None:
        for link in links:
            link.sock.disable_monitor()
            link.monitor.close(0)
            link.sock.close(0)
            if link in self._links:
                self._links.remove(link)
