"""MooncakePool: a pure Mooncake Store client (contributes no memory) behind the ``Pool`` interface.

Contract: the ``Pool`` contract of ``kvpool.backend.pool.api``, with Mooncake's behaviours mapped
explicitly (``reference/mooncake-store.md`` sections 5-7):
    * **Full pool.** A put that gets -200 (NO_AVAILABLE_HANDLE) is retried for those keys only,
      after 20 ms, 40 ms, ... (capped), until ``PutRetry.budget_s`` is spent; then ``FULL``. The
      master's eviction thread runs every 10 ms, so a retry usually finds room; when everything is
      leased or pinned it never does, and the budget bounds the wait.
    * **First writer wins.** Mooncake maps OBJECT_ALREADY_EXISTS to 0: a put of an existing key
      reports ``OK`` and keeps the old bytes (fine: keys are content-addressed).
    * **Groups.** Each put carries ``ReplicateConfig.group_ids`` (one per key), so the master
      evicts a chunk's stage objects together. Groups give no completeness guarantee: readers
      must still check every stage (``policy.hits``).
    * **Leases.** Reads and exist checks lease objects for the master's ``--default_kv_lease_ttl``
      (leased objects are not evicted); ``remove`` uses ``force=True`` so a lease cannot block it.
    * **Lease shorter than a read.** A read leases its objects for the lease TTL; a batch that
      takes longer gets -707 (LEASE_EXPIRED) for keys whose lease ran out, since they might have
      been evicted meanwhile. Those keys are read once more under a fresh lease (still expired:
      ``FAILED``). Keep the lease TTL well above the longest batch read.
    * **Dead store service.** Its keys still "exist" until the master's ``--client_ttl``; reads of
      them fail at once with -800 -> ``FAILED`` (a miss; the caller recomputes).
    * **Dead or hung master.** Calls fail with -900 (dead: the first call at once, later ones after
      ~4.3 s of reconnects) or -901 (hung: after ``MC_RPC_TIMEOUT_MS``) -> ``NO_ANSWER``; ``exists``
      returns ``None``. A restarted master has forgotten every key: reads are misses until the
      data is saved again.
    * **A lost master costs later calls nothing** (``reachability``, a ``Reachability``): the first
      call that gets no answer marks the pool down; from then on ``exists`` returns ``None``, ``get``,
      ``put`` and ``remove`` return ``NO_ANSWER`` for every key at once, without a Mooncake call,
      except that at most once per ``reprobe_every_s`` one call first probes the master's port (a
      TCP connect bounded by ``probe_timeout_s``); when it connects, that call goes to Mooncake
      again, and an answer marks the pool up. ``reachable()`` is that check.
    * **Wrong size.** ``get`` asks for exactly the range's size. An object that is larger makes
      Mooncake return -600; one ``get_size`` call then tells ``WRONG_SIZE`` from other errors. An
      object that is smaller returns its size -> ``WRONG_SIZE``.
    * **Absent master at construction.** The master's port is probed first (``connect_timeout_s``),
      so ``PoolUnavailable`` comes at once instead of after Mooncake's ~90 s of setup retries.
    * **Listeners.** The client's transfer engine listens on every interface (0.0.0.0 and [::]):
      outside a private network namespace the constructor raises ``PublicListenersRefused``
      (``netns.check_listeners``) before the engine starts, unless ``allow_public_listeners=True`` or
      the namespace holds only ``lo`` and the interfaces ``KVPOOL_LISTEN_INTERFACES`` names.
    * The process environment gets ``MC_TCP_BIND_ADDRESS=127.0.0.1`` and ``MC_RPC_TIMEOUT_MS`` (if not
      already set) before the client starts, since the C++ client reads them at setup.
    * **Same-host fast path** (``local_segment_bytes > 0``): the client mounts a segment of its own
      into the pool, every put prefers it (``ReplicateConfig.preferred_segment`` = this client's
      segment name) and ``MC_STORE_MEMCPY=1`` (if not set) makes the store move bytes between a
      registered buffer and a replica in its own segment with ``memcpy`` (its ``LOCAL_MEMCPY``
      transfer strategy) instead of the transfer engine. Objects placed elsewhere (the segment
      full, another client's put) are still read over the transport. The segment's keys go with
      the client (``close`` unmounts it).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.backend.pool.address import PoolAddress
from kvpool.backend.pool.api import BufferRef, PoolStats, Status
from kvpool.backend.pool.buffers import BufferRegistry, check_batch
from kvpool.backend.pool.metrics import MetricsUnavailable, read_master_metrics
from kvpool.backend.pool.netns import check_listeners
from kvpool.backend.pool.reachability import REPROBE_EVERY_S, Reachability

# Mooncake error codes (mooncake-store types.h) that kvpool distinguishes.
INVALID_PARAMS = -600
NO_AVAILABLE_HANDLE = -200
OBJECT_NOT_FOUND = -704
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
NO_ANSWER_CODES = frozenset({RPC_FAIL, RPC_TIMEOUT})


class PoolUnavailable(RuntimeError):
    """The Mooncake client could not be set up (master unreachable, bad address, ...)."""


@dataclass(frozen=True)
class PutRetry:
    """Bounded backoff for puts into a full pool.

    Attributes:
        first_delay_s: wait before the first retry.
        max_delay_s: cap of the doubling delay.
        budget_s: total time after which the remaining keys give up with ``Status.FULL``.
    """

    first_delay_s: float = 0.02
    max_delay_s: float = 0.2
    budget_s: float = 1.0

    def __post_init__(self) -> None:
        if self.first_delay_s <= 0 or self.max_delay_s < self.first_delay_s or self.budget_s < 0:
            raise ValueError(f"bad put retry policy {self}: need 0 < first <= max and budget >= 0")


def status_of(code: int) -> Status:
    """Map a Mooncake per-key return code (after size checks) to a ``Status``."""
    if code >= 0:
        return Status.OK
    if code == OBJECT_NOT_FOUND:
        return Status.MISSING
    if code == NO_AVAILABLE_HANDLE:
        return Status.FULL
    if code in NO_ANSWER_CODES:
        return Status.NO_ANSWER
    return Status.FAILED


class MooncakePool:
    """A Mooncake Store pool reached through its master.

    Args:
        address: the pool's address (``PoolAddress`` or text ``mooncake://HOST:RPC?metrics=M``).
        local_buffer_bytes: the client's own staging buffer (not pool capacity).
        put_retry: backoff for puts into a full pool.
        rpc_timeout_ms: ``MC_RPC_TIMEOUT_MS`` if the environment does not set it already.
        protocol: ``"tcp"``, or ``"rdma"`` where the hardware has it.
        rdma_devices: RDMA device names for the ``rdma`` protocol.
        metrics_timeout_s: bound on the ``stats`` HTTP call.
        connect_timeout_s: bound on the TCP probe of the master before ``setup`` (Mooncake's own
            setup would retry an absent master for about 90 s).
        allow_public_listeners: start the client's transfer engine even outside a private network
            namespace, where its listeners are reachable on every interface of this machine (needed
            to reach a pool on another host). False: ``PublicListenersRefused`` there.
        local_segment_bytes: memory this client mounts into the pool itself (0: a pure client);
            > 0 turns on the same-host fast path (module docstring).
        reprobe_every_s: while the master is lost, least time between two probes of its port.
        probe_timeout_s: bound on one probe (a TCP connect to the master's RPC port).
    """

    def __init__(
        self,
        address: PoolAddress | str,
        *,
        local_buffer_bytes: int = 16 << 20,
        put_retry: PutRetry = PutRetry(),
        rpc_timeout_ms: int = 2_000,
        protocol: str = "tcp",
        rdma_devices: str = "",
        metrics_timeout_s: float = 2.0,
        connect_timeout_s: float = 2.0,
        allow_public_listeners: bool = False,
        local_segment_bytes: int = 0,
        reprobe_every_s: float = REPROBE_EVERY_S,
        probe_timeout_s: float = 0.5,
    ) -> None:
        if local_segment_bytes < 0:
            raise ValueError(f"local_segment_bytes must be >= 0, got {local_segment_bytes}")
        check_listeners(allow_public_listeners, "pass allow_public_listeners=True")
        self.address = PoolAddress.parse(address) if isinstance(address, str) else address
        self.put_retry = put_retry
        self.metrics_timeout_s = metrics_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.reachability = Reachability(self._probe_master, reprobe_every_s)
        try:  # Mooncake's setup retries an absent master for ~90 s; answer at once instead
            socket.create_connection((self.address.host, self.address.rpc_port), timeout=connect_timeout_s).close()
        except OSError as e:
            raise PoolUnavailable(f"no Mooncake master answers at {self.address.master}: {e}") from None
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(rpc_timeout_ms))
        if local_segment_bytes:
            os.environ.setdefault("MC_STORE_MEMCPY", "1")
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self._ReplicateConfig = ReplicateConfig
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            "127.0.0.1", "P2PHANDSHAKE", local_segment_bytes, local_buffer_bytes, protocol, rdma_devices, self.address.master
        )
        if rc != 0:
            raise PoolUnavailable(f"Mooncake client setup against {self.address.master} returned {rc}")
        self.local_segment = self._store.get_hostname() if local_segment_bytes else ""
        self._buffers = BufferRegistry()
        self._close_lock = threading.Lock()
        self._closed = False

    # -- buffers ---------------------------------------------------------------------------
    def register_buffer(self, buffer: Any) -> BufferRef:
        self._check_open()
        ref = self._buffers.add(buffer)
        rc = self._store.register_buffer(ref.address, ref.size_bytes)
        if rc != 0:
            self._buffers.remove(ref)
            raise ValueError(f"Mooncake refused to register {ref.size_bytes} bytes at {ref.address:#x}: code {rc}")
        return ref

    def unregister_buffer(self, ref: BufferRef) -> None:
        self._buffers.remove(ref)
        self._store.unregister_buffer(ref.address)

    # -- data ------------------------------------------------------------------------------
    def put(
        self,
        keys: Sequence[str],
        groups: Sequence[str],
        buffer: BufferRef,
        offsets_bytes: Sequence[int],
        sizes_bytes: Sequence[int],
    ) -> list[Status]:
        self._check_open()
        self._buffers.check(buffer)
        check_batch(keys, offsets_bytes, sizes_bytes, buffer, groups)
        if keys and not self.reachability.usable():
            return [Status.NO_ANSWER] * len(keys)
        out = [Status.FULL] * len(keys)
        pending = list(range(len(keys)))
        deadline = time.monotonic() + self.put_retry.budget_s
        delay_s = self.put_retry.first_delay_s
        while pending:
            cfg = self._ReplicateConfig()
            cfg.group_ids = [groups[i] for i in pending]
            if self.local_segment:
                cfg.preferred_segment = self.local_segment
            codes = self._store.batch_put_from(
                [keys[i] for i in pending],
                [buffer.address + offsets_bytes[i] for i in pending],
                [sizes_bytes[i] for i in pending],
                cfg,
            )
            self._saw(codes)
            retry = []
            for i, code in zip(pending, codes):
                out[i] = status_of(code)
                if code == NO_AVAILABLE_HANDLE:
                    retry.append(i)
            pending = retry
            if not pending or time.monotonic() + delay_s > deadline:
                break
            time.sleep(delay_s)
            delay_s = min(2 * delay_s, self.put_retry.max_delay_s)
        return out

    def get(
        self,
        keys: Sequence[str],
        buffer: BufferRef,
        offsets_bytes: Sequence[int],
        sizes_bytes: Sequence[int],
    ) -> list[Status]:
        self._check_open()
        self._buffers.check(buffer)
        check_batch(keys, offsets_bytes, sizes_bytes, buffer)
        if not keys:
            return []
        if not self.reachability.usable():
            return [Status.NO_ANSWER] * len(keys)
        codes = self._store.batch_get_into(
            list(keys), [buffer.address + off for off in offsets_bytes], list(sizes_bytes)
        )
        self._saw(codes)
        expired = [i for i, c in enumerate(codes) if c == LEASE_EXPIRED]
        if expired:  # the batch outlasted the lease: read those keys once more under a fresh lease
            again = self._store.batch_get_into(
                [keys[i] for i in expired], [buffer.address + offsets_bytes[i] for i in expired], [sizes_bytes[i] for i in expired]
            )
            self._saw(again)
            codes = list(codes)
            for i, c in zip(expired, again):
                codes[i] = c
        out: list[Status] = []
        for key, size, code in zip(keys, sizes_bytes, codes):
            if code >= 0:
                out.append(Status.OK if code == size else Status.WRONG_SIZE)
            elif code == INVALID_PARAMS:
                actual = self._store.get_size(key)  # too small a range, or another invalid call?
                out.append(Status.WRONG_SIZE if actual >= 0 and actual != size else Status.FAILED)
            else:
                out.append(status_of(code))
        return out

    def exists(self, keys: Sequence[str]) -> list[bool] | None:
        self._check_open()
        if not keys:
            return []
        if not self.reachability.usable():
            return None
        codes = self._store.batch_is_exist(list(keys))
        self._saw(codes)
        if len(codes) != len(keys) or any(c < 0 for c in codes):
            return None
        return [c == 1 for c in codes]

    def remove(self, keys: Sequence[str]) -> list[Status]:
        self._check_open()
        if not keys:
            return []
        if not self.reachability.usable():
            return [Status.NO_ANSWER] * len(keys)
        codes = self._store.batch_remove(list(keys), force=True)
        self._saw(codes)
        return [status_of(c) for c in codes]

    def reachable(self) -> bool:
        """Whether calls go to the master now (``False``: it was lost and no probe found it since)."""
        return self.reachability.usable()

    def _saw(self, codes: Sequence[int]) -> None:
        """Mark the master lost when a call got no answer, found when it answered."""
        lost = [c for c in codes if c in NO_ANSWER_CODES]
        if lost:
            self.reachability.lost(f"the master at {self.address.master} gave no answer (code {lost[0]})")
        elif len(codes):
            self.reachability.answered()

    def _probe_master(self) -> bool:
        try:
            socket.create_connection((self.address.host, self.address.rpc_port), timeout=self.probe_timeout_s).close()
        except OSError:
            return False
        return True

    def stats(self) -> PoolStats | None:
        url = self.address.metrics_url
        if url is None:
            return None
        try:
            return read_master_metrics(url, self.metrics_timeout_s).to_pool_stats()
        except MetricsUnavailable:
            return None

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for ref in self._buffers.all():
            self._buffers.remove(ref)
            self._store.unregister_buffer(ref.address)
        self._store.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the pool client is closed")

    def __enter__(self) -> MooncakePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
