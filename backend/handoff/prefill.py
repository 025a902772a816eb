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
        The number of writes is exactly ``plan.batched_writes``.

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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpool.backend.handoff import messages as m
from kvpool.backend.handoff.metrics import StageReport
from kvpool.backend.handoff.transport import DONE, FAILED, Peer, Transport, WriteHandle
from kvpool.kernels import gather_dcp, rank_buffer_offset_bytes
from kvpool.policy.layout import HandoffPlan

ENGINE_PEER_QUEUE = 1024  # MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER default


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
    ) -> None:
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
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device)
        transport.register_source(self.staging)
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
        """Hand this stage's KV of one request to every rank of ``target`` (see module docstring).

        Args:
            request_id: the request, as the decode ranks ``expect``-ed it.
            caches, block_ids, plan: as for ``kernels.gather_dcp`` (this stage's layers).
            timeout_s: bound on the whole call, WANTs included.
        Returns:
            the stage's ``StageReport``; ``handoff_writes == plan.batched_writes``.
        """
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        links = target.links
        if plan.ranks != target.ranks:
            raise ValueError(f"plan has {plan.ranks} ranks, target has {target.ranks}")
        if plan.total_bytes > self.staging.numel():
            raise ValueError(f"stage share {plan.total_bytes} B exceeds staging {self.staging.numel()} B")
        for link in links:
            too_big = [w for w in plan.writes(link.rank) if w.nbytes > link.slot_bytes]
            if too_big:
                raise ValueError(f"write of {too_big[0].nbytes} B exceeds rank {link.rank}'s {link.slot_bytes} B slots")
        # 1. every rank has allocated pages and sent its nonce
        while not all(request_id in link.wants for link in links):
            self._check(links, request_id, deadline, "waiting for WANT")
            self._wait(links, min(0.05, deadline - time.monotonic()))
        nonces = [link.wants.pop(request_id) for link in links]
        # 2. gather every rank's tokens into staging
        tg = time.monotonic()
        staging = self.staging.narrow(0, 0, plan.total_bytes)
        gather_dcp(caches, block_ids, plan, out=staging, validate=self.validate, backend=self.backend)
        gather_s = time.monotonic() - tg
        # 3. one write per planned write, each into a credited slot
        queues = [deque(plan.writes(link.rank)) for link in links]
        bases = [rank_buffer_offset_bytes(plan, link.rank) for link in links]
        inflight: list[list[tuple[WriteHandle, int, object]]] = [[] for _ in links]
        writes = nbytes = peak = 0
        credit_wait_s = 0.0
        tt = time.monotonic()
        last_progress = tt
        try:
            while any(queues) or any(inflight):
                progressed = False
                self._drain(links)
                for i, link in enumerate(links):
                    q, fl = queues[i], inflight[i]
                    while q and link.credits and len(fl) < self.max_inflight_per_peer:
                        slot = link.credits.popleft()
                        w = q.popleft()
                        h = self.transport.submit(link.peer, staging, bases[i] + w.offset_bytes,
                                                  slot * link.slot_bytes, w.nbytes)
                        self.submitted_writes += 1
                        fl.append((h, slot, w))
                        progressed = True
                    peak = max(peak, len(fl))
                    for item in list(fl):
                        h, slot, w = item
                        st = self.transport.poll(h)
                        if st == DONE:
                            fl.remove(item)
                            link.sock.send(m.encode(m.Ready(request_id, nonces[i], self.stage, slot,
                                                            w.offset_bytes, w.nbytes)))
                            writes += 1
                            nbytes += w.nbytes
                            progressed = True
                        elif st == FAILED:
                            raise m.TransferFailed(f"stage {self.stage}: write of {w.nbytes} B to rank {link.rank} "
                                                   f"slot {slot} failed", request_id)
                now = time.monotonic()
                if progressed:
                    last_progress = now
                    continue
                self._check(links, request_id, deadline, "sending")
                starving = any(q and not link.credits for q, link in zip(queues, links))
                if starving and now - last_progress > self.credit_timeout_s:
                    raise m.CreditTimeout(f"stage {self.stage}: no credit for {self.credit_timeout_s} s", request_id)
                t_w = time.monotonic()
                self._wait(links, 0.0005 if any(inflight) else 0.01)
                if starving:
                    credit_wait_s += time.monotonic() - t_w
            for i, link in enumerate(links):
                link.sock.send(m.encode(m.Done(request_id, nonces[i], self.stage, len(plan.writes(link.rank)),
                                               plan.buffer_bytes(link.rank))))
        except m.HandoffError as exc:
            self._abort(links, request_id, nonces, inflight, str(exc))
            raise
        end = time.monotonic()
        return StageReport(request_id, self.stage, nbytes, writes, gather_s, end - tt, credit_wait_s, end - t0, peak)

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
        poller = zmq.Poller()
        for link in links:
            poller.register(link.sock, zmq.POLLIN)
            poller.register(link.monitor, zmq.POLLIN)
        if poller.poll(int(max(0.0, timeout_s) * 1000) or 0):
            self._drain(links)

    def _drain(self, links: list[RankLink]) -> None:
        for link in links:
            while True:
                try:
                    ev = recv_monitor_message(link.monitor, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if ev["event"] == zmq.EVENT_DISCONNECTED:
                    link.lost = "side channel disconnected"
            while True:
                try:
                    payload = link.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
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

    def _drop(self, links: list[RankLink]) -> None:
        for link in links:
            link.sock.disable_monitor()
            link.monitor.close(0)
            link.sock.close(0)
            if link in self._links:
                self._links.remove(link)
