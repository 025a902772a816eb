"""The store connector's worker side: one per pipeline stage (one GPU), owning registered buffers.

Primitives, by caller:
    The engine, once per stage:
        ``ConnectorWorker(pool, spec, stage, caches, WorkerConfig(...))`` then ``start()``:
        allocates ONE host arena (pinned when the caches are on a GPU), cut into a load region and a
        save region of chunk-sized slots (``KVSpec.chunk_object_bytes`` rounded up to 4 KiB), and
        registers it with the pool once. ``close()`` waits for saves, unregisters, frees.
    The engine, per request (from the scheduler's plans):
        ``load(plan, block_ids) -> StageReport``           synchronous, on the caller's thread
        ``submit_load(plan, block_ids) -> Future[StageReport]``  on this stage's load thread
        ``submit_save(plan, block_ids) -> Future[StageSaveReport]`` asynchronous, bounded in flight

Contract:
    * **Load** reads this stage's objects of ``plan`` into the load region and unpacks them with
      ``kernels.unpack`` into the pages of ``block_ids`` (the request's block table; chunk ``c``
      covers entries ``c*P .. c*P+P-1``, ``P = chunk_tokens / page_tokens``). A plan with more
      chunks than the region has slots is loaded in rounds of at most that many chunks; the
      region never grows. Every object must have exactly this stage's object size: the plan's
      size is checked against this stage's format, and the pool checks each object (``WRONG_SIZE``).
      With two or more slots the region works as two halves: round r+1 is read into one half while
      round r is unpacked from the other (one unpack thread per stage), so reads and unpacks overlap;
      a round is at most half the slots and about a quarter of the plan.
      Any non-``OK`` read fails the stage at once (no unpack of that round); the report says why.
      All-or-nothing across stages is the scheduler's job (``report_stage``): a failed stage may
      have written some pages, which the request recomputes anyway.
    * **Wrong-size objects** (another layout under this key) are removed from the pool when
      ``remove_wrong_size`` is set, so the recomputed chunk can be saved again (first writer wins
      would otherwise keep the bad object forever).
    * **Bounded time.** Every pool call is bounded by the pool (its RPC timeout); a load or save
      checks its deadline (``load_timeout_s`` / ``save_timeout_s`` from its start) before every
      round, so it ends within the timeout plus one pool call.
    * **Save** packs the plan's chunks (``kernels.pack``) into save slots and writes them with
      their chunk's group id (``pool.put``), in windows of at most the save region's slots, on one
      save thread. At most ``max_inflight_saves`` saves are queued or running per stage; a save
      beyond that is not started and reports ``"dropped"`` (the scheduler plans it again). The
      caller must keep the pages of a save unchanged until its future resolves. A put the pool
      refuses (``FULL`` after its bounded retries, ``NO_ANSWER``, ...) ends the save with the
      chunks stored so far; nothing is retried here beyond the pool's own retries.
    * **A lost master** (a ``Reachable`` pool whose ``reachable()`` is false): a load or save ends
      ``"no_answer"`` before its next round or window, without packing or reading anything.
    * On a GPU, objects go host -> device through a device window of ``device_window_bytes``
      (pinned host arena, one stream, synchronized before the host slots are reused); on the
      CPU, unpack and pack work on the registered slots directly.
    * **In place** (``use_pool_arena``, a pool with the ``ArenaPool`` capability: the embedded
      pool). A load leases its objects' arena ranges (one read call) and, on a GPU, copies them
      host -> device straight from the (pinned) pool arena into a device window of two halves on a
      copy stream, while a second stream unpacks the other half: one large copy per contiguous
      run of objects (a save's window is one run), events between the streams, one host wait at
      the end; the lease ends after it. On the CPU it unpacks straight from the arena. A save
      reserves its window's ranges (one put), packs the whole window in one launch and copies it
      device -> host straight into the arena, then commits. The rounds, their sizes and the
      report are those of the registered-slot path; block ids are checked once per load or save
      (``validate``). Both streams first wait for the work the caller had queued on its current
      stream when it called (``load`` / ``submit_load`` / ``save`` / ``submit_save``).

Only this module (of the connector) imports torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from kvpool import kernels
from kvpool.backend.connector_data import LoadPlan, SavePlan, StageReport, StageSaveReport
from kvpool.backend.pool.api import ArenaPiece, ArenaPool, BufferRef, Pool, Reachable, Status
from kvpool.kernels import _checks as kernel_checks
from kvpool.kernels.format import ChunkFormat
from kvpool.policy.kvspec import KVSpec

MIB = 1 << 20
SLOT_ALIGN_BYTES = 4096

_REASON = {
    Status.MISSING: "missing",
    Status.WRONG_SIZE: "wrong_size",
    Status.FULL: "full",
    Status.NO_ANSWER: "no_answer",
    Status.FAILED: "failed",
}


@dataclass(frozen=True)
class WorkerConfig:
    """Per-stage worker settings (defaults like the seed's engine).

    Attributes:
        load_buffer_bytes: registered load region (ATOM ``load_pool_mib``: 1 GiB), cut into slots.
        save_buffer_bytes: registered save region (ATOM ``save_pool_mib``: 256 MiB).
        chunk_tokens: tokens per chunk object (a multiple of the page size).
        max_inflight_saves: saves queued or running on this stage; more are dropped.
        load_timeout_s: a load gives up (``"timeout"``) once this has passed, checked per round.
        save_timeout_s: the same for a save, checked per window.
        device_window_bytes: device staging for host -> device copies (GPU caches only).
        remove_wrong_size: remove an object whose size is wrong, so it can be saved again.
        validate: let the kernels check block ids against the caches (one host sync per call).
        kernel_backend: ``"auto"`` (Triton on a GPU, torch on the CPU), ``"torch"`` or ``"triton"``.
        use_pool_arena: read and write the pool's arena in place when the pool offers one
            (``ArenaPool``); False: always through the registered slots.
    """

    load_buffer_bytes: int = 1024 * MIB
    save_buffer_bytes: int = 256 * MIB
    chunk_tokens: int = 256
    max_inflight_saves: int = 8
    load_timeout_s: float = 30.0
    save_timeout_s: float = 60.0
    device_window_bytes: int = 256 * MIB
    remove_wrong_size: bool = True
    validate: bool = True
    kernel_backend: Literal["auto", "torch", "triton"] = "auto"
    use_pool_arena: bool = True

    def __post_init__(self) -> None:
        if self.load_buffer_bytes <= 0 or self.save_buffer_bytes <= 0:
            raise ValueError("load_buffer_bytes and save_buffer_bytes must be > 0")
        if self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be > 0, got {self.chunk_tokens}")
        if self.max_inflight_saves < 1:
            raise ValueError(f"max_inflight_saves must be >= 1, got {self.max_inflight_saves}")
        if self.load_timeout_s <= 0 or self.save_timeout_s <= 0:
            raise ValueError("load_timeout_s and save_timeout_s must be > 0")
        if self.device_window_bytes <= 0:
            raise ValueError("device_window_bytes must be > 0")
        if self.kernel_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel_backend must be 'auto', 'torch' or 'triton', got {self.kernel_backend!r}")


def clip_pieces(pieces: list[ArenaPiece], lo_bytes: int, hi_bytes: int) -> list[tuple[int, int, int]]:
    """``(arena_offset, offset from lo, nbytes)`` of the pieces' bytes in dense range ``[lo, hi)``."""
    out = []
    for p in pieces:
        a, b = max(lo_bytes, p.dense_offset_bytes), min(hi_bytes, p.dense_offset_bytes + p.nbytes)
        if a < b:
            out.append((p.arena_offset_bytes + a - p.dense_offset_bytes, a - lo_bytes, b - a))
    return out


def slot_bytes_for(object_bytes: int) -> int:
    """A slot's stride: the object size rounded up to 4 KiB."""
    return -(-object_bytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES


class ConnectorWorker:
    """One pipeline stage's side of the store connector. See the module docstring.

    Args:
        pool: the KV pool (``EmbeddedPool``, ``MooncakePool``, ...).
        spec: KV geometry; this stage's object size is ``spec.chunk_object_bytes(stage, chunk_tokens)``.
        stage: the pipeline stage this worker serves.
        caches: the stage's paged caches in format order (``ChunkFormat.from_spec``), one tensor
            ``[num_blocks, page_tokens, record]`` each, all on one device.
        config: buffer sizes, bounds, timeouts.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        pool: Pool,
        spec: KVSpec,
        stage: int,
        caches: list[torch.Tensor],
        config: WorkerConfig = WorkerConfig(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fmt = ChunkFormat.from_spec(spec, stage, config.chunk_tokens)
        if len(caches) != len(self.fmt.segments):
            raise ValueError(f"stage {stage} has {len(self.fmt.segments)} caches in its format, got {len(caches)}")
        for i, (c, seg) in enumerate(zip(caches, self.fmt.segments)):
            rb = c.shape[-1] * c.element_size() if c.dim() == 3 else -1
            if rb != seg.record_bytes or c.shape[1] != spec.page_tokens:
                raise ValueError(
                    f"cache {i} of stage {stage} must be [blocks, {spec.page_tokens}, {seg.record_bytes} B], "
                    f"got shape {tuple(c.shape)} of {c.dtype}"
                )
        if len({c.device for c in caches}) != 1:
            raise ValueError("all caches of a stage must be on one device")
        self.pool = pool
        self.spec = spec
        self.stage = stage
        self.caches = list(caches)
        self.config = config
        self.clock = clock
        self.device = caches[0].device
        self.object_bytes = self.fmt.object_bytes
        self.slot_bytes = slot_bytes_for(self.object_bytes)
        self.load_slots = config.load_buffer_bytes // self.slot_bytes
        self.save_slots = config.save_buffer_bytes // self.slot_bytes
        if self.load_slots < 1 or self.save_slots < 1:
            raise ValueError(
                f"a {self.slot_bytes}-byte slot does not fit the load ({config.load_buffer_bytes} B) "
                f"or save ({config.save_buffer_bytes} B) buffer"
            )
        self.pages_per_chunk = config.chunk_tokens // spec.page_tokens
        self._arena: torch.Tensor | None = None
        self._ref: BufferRef | None = None
        self._staging: torch.Tensor | None = None  # device window of loads (GPU caches only)
        self._save_staging: torch.Tensor | None = None  # and of saves (their own: they run concurrently)
        self._arena_pool: ArenaPool | None = pool if config.use_pool_arena and isinstance(pool, ArenaPool) else None
        self._reachable: Callable[[], bool] = pool.reachable if isinstance(pool, Reachable) else (lambda: True)
        self._pool_view: torch.Tensor | None = None  # the pool's arena as a CPU uint8 tensor (no copy)
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._dev_load: torch.Tensor | None = None  # in-place path: two halves of objects, dense
        self._dev_save: torch.Tensor | None = None
        self.half_objects = 0  # in-place GPU loads: objects per device half window
        self.save_window_objects = 0
        self._load_exec: ThreadPoolExecutor | None = None
        self._unpack_exec: ThreadPoolExecutor | None = None
        self._save_exec: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._inflight_saves = 0
        self.counters = {"loads": 0, "loads_failed": 0, "saves": 0, "saves_dropped": 0, "wrong_size_removed": 0}

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def save_offset_bytes(self) -> int:
        return self.load_slots * self.slot_bytes

    def start(self) -> ConnectorWorker:
        """Allocate the arena (load region, then save region) and register it with the pool once."""
        if self._arena is not None:
            return self
        total = (self.load_slots + self.save_slots) * self.slot_bytes
        pin = self.device.type == "cuda"
        self._arena = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        self._ref = self.pool.register_buffer(self._arena)
        if self._arena_pool is not None:
            self._pool_view = torch.frombuffer(self._arena_pool.arena_buffer, dtype=torch.uint8)
            if self.device.type == "cuda":
                ob = self.object_bytes
                self.half_objects = max(1, self.config.device_window_bytes // 2 // ob)
                self.save_window_objects = max(1, min(self.save_slots, self.config.device_window_bytes // ob))
                self._dev_load = torch.empty(2 * self.half_objects * ob, dtype=torch.uint8, device=self.device)
                self._dev_save = torch.empty(self.save_window_objects * ob, dtype=torch.uint8, device=self.device)
                self._streams = {name: torch.cuda.Stream(self.device) for name in ("copy", "unpack", "save")}
        elif self.device.type != "cpu":
            window = max(1, self.config.device_window_bytes // self.slot_bytes)
            self._staging = torch.empty((min(self.load_slots, window), self.slot_bytes), dtype=torch.uint8, device=self.device)
            self._save_staging = torch.empty((min(self.save_slots, window), self.slot_bytes), dtype=torch.uint8, device=self.device)
        self._load_exec = ThreadPoolExecutor(1, thread_name_prefix=f"kvpool-load-s{self.stage}")
        self._unpack_exec = ThreadPoolExecutor(1, thread_name_prefix=f"kvpool-unpack-s{self.stage}")
        self._save_exec = ThreadPoolExecutor(1, thread_name_prefix=f"kvpool-save-s{self.stage}")
        return self

    def close(self) -> None:
        """Wait for queued loads and saves, unregister the arena and free it. Idempotent."""
        for ex in (self._load_exec, self._unpack_exec, self._save_exec):
            if ex is not None:
                ex.shutdown(wait=True)
        self._load_exec = self._unpack_exec = self._save_exec = None
        if self._ref is not None:
            try:
                self.pool.unregister_buffer(self._ref)
            except ValueError:
                pass  # the pool was closed first
            self._ref = None
        self._arena = self._staging = self._save_staging = None
        self._pool_view = self._dev_load = self._dev_save = None
        self._streams = {}

    def __enter__(self) -> ConnectorWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_started(self) -> tuple[torch.Tensor, BufferRef]:
        if self._arena is None or self._ref is None:
            raise RuntimeError("the worker is not started (call start())")
        return self._arena, self._ref

    def _slots(self, first_offset: int, n: int) -> torch.Tensor:
        """``[n, object_bytes]`` view of ``n`` slots from ``first_offset`` (row stride = slot)."""
        arena, _ = self._require_started()
        return arena.as_strided((n, self.object_bytes), (self.slot_bytes, 1), first_offset)

    def _table(self, block_ids: torch.Tensor, first_chunk: int, n: int) -> torch.Tensor:
        flat = block_ids.reshape(-1)
        p = self.pages_per_chunk
        return flat[first_chunk * p : (first_chunk + n) * p]

    # -- load --------------------------------------------------------------------------------
    def submit_load(
        self, plan: LoadPlan, block_ids: torch.Tensor, on_round: Callable[[int, int], None] | None = None
    ) -> Future[StageReport]:
        """``load`` on this stage's load thread (one load at a time per stage, as ATOM's default)."""
        self._require_started()
        assert self._load_exec is not None
        return self._load_exec.submit(self._load, plan, block_ids, on_round, self._caller_ready())

    def load(
        self, plan: LoadPlan, block_ids: torch.Tensor, on_round: Callable[[int, int], None] | None = None
    ) -> StageReport:
        """Read this stage's objects of ``plan`` and unpack them into ``block_ids``' pages.

        ``on_round(chunks_done, chunks_total)`` is called after each round (progress, profiling).
        """
        return self._load(plan, block_ids, on_round, self._caller_ready())

    def _caller_ready(self) -> torch.cuda.Event | None:
        """An event after the work queued on the caller's current stream (GPU in-place path only)."""
        if self.device.type != "cuda" or self._arena_pool is None:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _load(
        self,
        plan: LoadPlan,
        block_ids: torch.Tensor,
        on_round: Callable[[int, int], None] | None,
        ready: torch.cuda.Event | None,
    ) -> StageReport:
        _, ref = self._require_started()
        t0 = self.clock()
        deadline = t0 + self.config.load_timeout_s
        objs = plan.stages[self.stage]
        n = len(objs.keys)
        done = rounds = 0
        get_s = unpack_s = 0.0

        def report(ok: bool, reason: str = "") -> StageReport:
            with self._lock:
                self.counters["loads"] += 1
                self.counters["loads_failed"] += not ok
            return StageReport(
                plan.request_id, self.stage, ok, t0, self.clock(), done * self.object_bytes, reason, rounds, get_s, unpack_s
            )

        if objs.stage != self.stage:
            raise ValueError(f"plan entry {self.stage} is for stage {objs.stage}")
        if objs.object_bytes != self.object_bytes:
            return report(False, "size_mismatch")
        if n != plan.chunks:
            raise ValueError(f"stage {self.stage} has {n} keys for a {plan.chunks}-chunk plan")
        # Two halves of the load region when it has >= 2 slots: round r+1 is read into one half
        # while round r is unpacked from the other (on the unpack thread).
        # A load that fits one half is still cut into ~4 rounds, so that there is something to overlap.
        overlap = self.load_slots >= 2 and n > 1
        per_round = min(self.load_slots // 2, -(-n // 4)) if overlap else self.load_slots
        if self._arena_pool is not None:
            try:
                ok, reason, done, rounds, get_s, unpack_s = self._load_in_place(
                    plan, objs.keys, block_ids, per_round, deadline, on_round, ready
                )
            except (ValueError, IndexError, TypeError, RuntimeError) as e:  # bad table, kernel refusal
                return report(False, f"error: {e}")
            return report(ok, reason)
        pending: list[Future[float] | None] = [None, None]

        def drain(raise_errors: bool) -> None:
            nonlocal unpack_s
            for i, fut in enumerate(pending):
                if fut is None:
                    continue
                pending[i] = None
                try:
                    unpack_s += fut.result()
                except Exception:
                    if raise_errors:
                        raise

        try:
            while done < n:
                if self.clock() > deadline:
                    drain(False)
                    return report(False, "timeout")
                if not self._reachable():
                    drain(False)
                    return report(False, "no_answer")
                m = min(per_round, n - done)
                half = rounds % 2 if overlap else 0
                base = half * (self.load_slots // 2) * self.slot_bytes
                fut = pending[half]
                if fut is not None:  # that half's previous round must be unpacked before reuse
                    pending[half] = None
                    unpack_s += fut.result()
                keys = objs.keys[done : done + m]
                offsets = [base + k * self.slot_bytes for k in range(m)]
                t1 = self.clock()
                statuses = self.pool.get(keys, ref, offsets, [self.object_bytes] * m)
                get_s += self.clock() - t1
                rounds += 1
                bad = [(k, st) for k, st in zip(keys, statuses) if st != Status.OK]
                if bad:
                    drain(False)
                    self._remove_wrong_size([k for k, st in bad if st == Status.WRONG_SIZE])
                    return report(False, _REASON.get(bad[0][1], "failed"))
                table = self._table(block_ids, plan.first_chunk + done, m)
                if overlap:
                    assert self._unpack_exec is not None
                    pending[half] = self._unpack_exec.submit(self._timed_unpack, base, m, table)
                else:
                    unpack_s += self._timed_unpack(base, m, table)
                done += m
                if on_round is not None:
                    on_round(done, n)
            drain(True)
        except (ValueError, IndexError, TypeError, RuntimeError) as e:  # bad table, kernel refusal
            drain(False)
            return report(False, f"error: {e}")
        return report(True)

    # -- in place (ArenaPool) ----------------------------------------------------------------
    def _check_table(self, block_ids: torch.Tensor, first_chunk: int, n: int, unique: bool) -> torch.Tensor:
        """The plan's part of the block table, checked once (``validate``) for all its rounds."""
        table = self._table(block_ids, first_chunk, n)
        pages = n * self.pages_per_chunk
        kernel_checks.check_block_ids(table, pages, self.device)
        if self.config.validate:
            kernel_checks.check_block_bounds(table, pages, self.caches[0].shape[0], unique)
        return table

    def _arena_rows(self, arena_offset: int, k: int) -> torch.Tensor:
        """``[k, object_bytes]`` view of ``k`` objects back to back in the pool's arena."""
        assert self._pool_view is not None
        return self._pool_view.as_strided((k, self.object_bytes), (self.object_bytes, 1), arena_offset)

    def _whole_objects(self, clipped: list[tuple[int, int, int]]) -> bool:
        ob = self.object_bytes
        return all(d % ob == 0 and n % ob == 0 for _, d, n in clipped)

    def _load_in_place(
        self,
        plan: LoadPlan,
        keys: tuple[str, ...],
        block_ids: torch.Tensor,
        per_round: int,
        deadline: float,
        on_round: Callable[[int, int], None] | None,
        ready: torch.cuda.Event | None,
    ) -> tuple[bool, str, int, int, float, float]:
        """Lease the objects and unpack them from the pool's arena: ``(ok, reason, done, rounds, get_s, unpack_s)``."""
        assert self._arena_pool is not None
        n, ob = len(keys), self.object_bytes
        table = self._check_table(block_ids, plan.first_chunk, n, unique=True)
        t0 = self.clock()
        lease = self._arena_pool.lease_read(keys, [ob] * n)
        get_s = self.clock() - t0
        try:
            bad = [(k, st) for k, st in zip(keys, lease.statuses) if st != Status.OK]
            if bad:
                lease.release()
                self._remove_wrong_size([k for k, st in bad if st == Status.WRONG_SIZE])
                return False, _REASON.get(bad[0][1], "failed"), 0, 1, get_s, 0.0
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):  # this thread's kernels launch on the caches' GPU
                    return self._load_in_place_gpu(lease.pieces, table, n, deadline, on_round, ready, get_s)
            return self._load_in_place_cpu(lease.pieces, table, n, per_round, deadline, on_round, get_s)
        finally:
            lease.release()

    def _load_in_place_cpu(self, pieces, table, n, per_round, deadline, on_round, get_s):
        cfg, ct, ob, p = self.config, self.config.chunk_tokens, self.object_bytes, self.pages_per_chunk
        done = rounds = 0
        unpack_s = 0.0
        while done < n:
            if self.clock() > deadline:
                return False, "timeout", done, rounds, get_s, unpack_s
            m = min(per_round, n - done)
            clipped = clip_pieces(pieces, done * ob, (done + m) * ob)
            t1 = self.clock()
            if self._whole_objects(clipped):
                for a, d, nb in clipped:  # straight from the arena: one unpack per contiguous run
                    i, k = d // ob, nb // ob
                    rows = self._arena_rows(a, k)
                    kernels.unpack(rows, self.caches, table[(done + i) * p : (done + i + k) * p], k, ct, self.fmt, False, cfg.kernel_backend)
            else:  # an object split over several extents: gather it into the load slots first
                t2 = self.clock()
                slots = self._slots(0, m)
                flat = slots.as_strided((m * self.slot_bytes,), (1,), slots.storage_offset())
                assert self._pool_view is not None
                for a, d, nb in clipped:
                    while nb:
                        i, w = divmod(d, ob)
                        take = min(nb, ob - w)
                        flat[i * self.slot_bytes + w : i * self.slot_bytes + w + take].copy_(self._pool_view[a : a + take])
                        a, d, nb = a + take, d + take, nb - take
                get_s += self.clock() - t2
                kernels.unpack(slots, self.caches, table[done * p : (done + m) * p], m, ct, self.fmt, False, cfg.kernel_backend)
            unpack_s += self.clock() - t1
            done += m
            rounds += 1
            if on_round is not None:
                on_round(done, n)
        return True, "", done, rounds, get_s, unpack_s

    def _load_in_place_gpu(self, pieces, table, n, deadline, on_round, ready, get_s):
        """Copy stream: arena -> device half (one copy per run); unpack stream: the other half."""
        cfg, ct, ob, p = self.config, self.config.chunk_tokens, self.object_bytes, self.pages_per_chunk
        cs, us = self._streams["copy"], self._streams["unpack"]
        stage, view = self._dev_load, self._pool_view
        assert stage is not None and view is not None
        half = self.half_objects
        if ready is not None:
            cs.wait_event(ready)
            us.wait_event(ready)
        freed: list[torch.cuda.Event | None] = [None, None]  # the half's last unpack is done
        timing: list[tuple[torch.cuda.Event, ...]] = []
        done = rounds = 0
        try:
            while done < n:
                if self.clock() > deadline:
                    return False, "timeout", done, rounds, get_s, 0.0
                m = min(half, n - done)
                h = rounds % 2
                base = h * half * ob
                c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                u0, u1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(cs):
                    if freed[h] is not None:
                        cs.wait_event(freed[h])
                    c0.record(cs)
                    for a, d, nb in clip_pieces(pieces, done * ob, (done + m) * ob):
                        stage[base + d : base + d + nb].copy_(view[a : a + nb], non_blocking=True)
                    c1.record(cs)
                with torch.cuda.stream(us):
                    us.wait_event(c1)
                    u0.record(us)
                    rows = stage[base : base + m * ob].view(m, ob)
                    kernels.unpack(rows, self.caches, table[done * p : (done + m) * p], m, ct, self.fmt, False, cfg.kernel_backend)
                    u1.record(us)
                freed[h] = u1
                timing.append((c0, c1, u0, u1))
                done += m
                rounds += 1
                if on_round is not None:
                    on_round(done, n)
        finally:
            cs.synchronize()  # no copy may still read the leased ranges once the lease ends
            us.synchronize()
        get_s += sum(c0.elapsed_time(c1) for c0, c1, _, _ in timing) / 1e3
        unpack_s = sum(u0.elapsed_time(u1) for _, _, u0, u1 in timing) / 1e3
        return True, "", done, rounds, get_s, unpack_s

    def _save_in_place(self, keys, groups, table_all, done, m, ready) -> tuple[list[Status], float, float]:
        """Reserve, pack and fill one window in the pool's arena, then commit: ``(statuses, pack_s, put_s)``."""
        assert self._arena_pool is not None
        cfg, ct, ob, p = self.config, self.config.chunk_tokens, self.object_bytes, self.pages_per_chunk
        t0 = self.clock()
        w = self._arena_pool.reserve_write(keys, groups, [ob] * m)
        t1 = self.clock()
        put_s, pack_s = t1 - t0, 0.0
        table = table_all[done * p : (done + m) * p]
        try:
            clipped = clip_pieces(w.pieces, 0, m * ob)
            if not clipped:
                pass
            elif self.device.type == "cuda":
                ss, stage, view = self._streams["save"], self._dev_save, self._pool_view
                assert stage is not None and view is not None
                with torch.cuda.device(self.device), torch.cuda.stream(ss):
                    if ready is not None:
                        ss.wait_event(ready)
                    kernels.pack(self.caches, table, m, ct, stage[: m * ob].view(m, ob), self.fmt, False, cfg.kernel_backend)
                    for a, d, nb in clipped:
                        view[a : a + nb].copy_(stage[d : d + nb], non_blocking=True)
                ss.synchronize()
            elif self._whole_objects(clipped):
                for a, d, nb in clipped:  # straight into the arena: one pack per contiguous run
                    i, k = d // ob, nb // ob
                    kernels.pack(self.caches, table[i * p : (i + k) * p], k, ct, self._arena_rows(a, k), self.fmt, False, cfg.kernel_backend)
            else:  # an object split over several extents: pack into the save slots, then copy
                slots = self._slots(self.save_offset_bytes, m)
                kernels.pack(self.caches, table, m, ct, slots, self.fmt, False, cfg.kernel_backend)
                assert self._pool_view is not None
                for a, d, nb in clipped:
                    while nb:
                        i, wo = divmod(d, ob)
                        take = min(nb, ob - wo)
                        self._pool_view[a : a + take].copy_(slots[i, wo : wo + take])
                        a, d, nb = a + take, d + take, nb - take
        except BaseException:
            if self.device.type == "cuda":
                self._streams["save"].synchronize()
            w.abort()
            raise
        t2 = self.clock()
        w.commit()
        pack_s = t2 - t1
        put_s += self.clock() - t2
        return w.statuses, pack_s, put_s

    def _timed_unpack(self, base: int, m: int, table: torch.Tensor) -> float:
        t0 = self.clock()
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):  # the unpack thread's current device
                self._unpack(base, m, table)
        else:
            self._unpack(base, m, table)
        return self.clock() - t0

    def _remove_wrong_size(self, keys: list[str]) -> None:
        if keys and self.config.remove_wrong_size:
            self.pool.remove(keys)
            with self._lock:
                self.counters["wrong_size_removed"] += len(keys)

    def _unpack(self, base: int, m: int, table: torch.Tensor) -> None:
        cfg, ct = self.config, self.config.chunk_tokens
        if self.device.type == "cpu":
            kernels.unpack(self._slots(base, m), self.caches, table, m, ct, self.fmt, cfg.validate, cfg.kernel_backend)
            return
        arena, _ = self._require_started()
        staging = self._staging
        assert staging is not None
        w, p = staging.shape[0], self.pages_per_chunk
        for j in range(0, m, w):
            k = min(w, m - j)
            lo = base + j * self.slot_bytes
            staging[:k].copy_(arena[lo : lo + k * self.slot_bytes].view(k, self.slot_bytes), non_blocking=True)
            objects = staging[:k, : self.object_bytes]
            kernels.unpack(objects, self.caches, table[j * p : (j + k) * p], k, ct, self.fmt, cfg.validate, cfg.kernel_backend)
        torch.cuda.current_stream(self.device).synchronize()  # the host slots are reused next round

    # -- save --------------------------------------------------------------------------------
    @property
    def inflight_saves(self) -> int:
        with self._lock:
            return self._inflight_saves

    def submit_save(self, plan: SavePlan, block_ids: torch.Tensor) -> Future[StageSaveReport]:
        """Pack and put ``plan``'s chunks asynchronously; beyond the in-flight bound: ``"dropped"``."""
        self._require_started()
        assert self._save_exec is not None
        with self._lock:
            if self._inflight_saves >= self.config.max_inflight_saves:
                self.counters["saves_dropped"] += 1
                now = self.clock()
                done: Future[StageSaveReport] = Future()
                done.set_result(StageSaveReport(plan.request_id, self.stage, 0, plan.chunks, now, now, 0, "dropped"))
                return done
            self._inflight_saves += 1

        ready = self._caller_ready()

        def run() -> StageSaveReport:
            try:
                return self._save(plan, block_ids, ready)
            finally:
                with self._lock:
                    self._inflight_saves -= 1

        return self._save_exec.submit(run)

    def save(self, plan: SavePlan, block_ids: torch.Tensor) -> StageSaveReport:
        """Pack and put ``plan``'s chunks now, on the caller's thread (``submit_save`` runs this)."""
        return self._save(plan, block_ids, self._caller_ready())

    def _save(self, plan: SavePlan, block_ids: torch.Tensor, ready: torch.cuda.Event | None) -> StageSaveReport:
        _, ref = self._require_started()
        t0 = self.clock()
        deadline = t0 + self.config.save_timeout_s
        objs = plan.stages[self.stage]
        n = len(objs.keys)
        stored = 0
        pack_s = put_s = 0.0

        def report(reason: str = "") -> StageSaveReport:
            with self._lock:
                self.counters["saves"] += 1
            return StageSaveReport(
                plan.request_id, self.stage, stored, n, t0, self.clock(), stored * self.object_bytes, reason, pack_s, put_s
            )

        if objs.object_bytes != self.object_bytes:
            return report("size_mismatch")
        if len(plan.group_ids) != n or n != plan.chunks:
            raise ValueError(f"save plan of {plan.chunks} chunks has {n} keys and {len(plan.group_ids)} groups")
        in_place = self._arena_pool is not None
        window = self.save_window_objects if in_place and self.device.type == "cuda" else self.save_slots
        done = 0
        try:
            table_all = self._check_table(block_ids, plan.first_chunk, n, unique=False) if in_place else None
            while done < n:
                if self.clock() > deadline:
                    return report("timeout")
                if not self._reachable():
                    return report("no_answer")
                m = min(window, n - done)
                keys, groups = objs.keys[done : done + m], plan.group_ids[done : done + m]
                if in_place:
                    statuses, dp, du = self._save_in_place(keys, groups, table_all, done, m, ready)
                else:
                    statuses, dp, du = self._save_through_slots(keys, groups, ref, block_ids, plan.first_chunk + done, m)
                pack_s += dp
                put_s += du
                stored += sum(st == Status.OK for st in statuses)
                done += m
                bad = [st for st in statuses if st != Status.OK]
                if bad:
                    return report(_REASON.get(bad[0], "failed"))
        except (ValueError, IndexError, TypeError, RuntimeError) as e:
            return report(f"error: {e}")
        return report()

    def _save_through_slots(self, keys, groups, ref, block_ids: torch.Tensor, first_chunk: int,
                            m: int) -> tuple[list[Status], float, float]:
        """Pack one window into the registered save slots, then put it: ``(statuses, pack_s, put_s)``."""
        base = self.save_offset_bytes
        t1 = self.clock()
        self._pack(base, m, self._table(block_ids, first_chunk, m))
        t2 = self.clock()
        statuses = self.pool.put(keys, groups, ref, [base + k * self.slot_bytes for k in range(m)],
                                 [self.object_bytes] * m)
        return statuses, t2 - t1, self.clock() - t2

    def _pack(self, base: int, m: int, table: torch.Tensor) -> None:
        cfg, ct = self.config, self.config.chunk_tokens
        if self.device.type == "cpu":
            kernels.pack(self.caches, table, m, ct, self._slots(base, m), self.fmt, cfg.validate, cfg.kernel_backend)
            return
        staging = self._save_staging
        assert staging is not None
        w, p = staging.shape[0], self.pages_per_chunk
        arena, _ = self._require_started()
        for j in range(0, m, w):
            k = min(w, m - j)
            kernels.pack(self.caches, table[j * p : (j + k) * p], k, ct, staging[:k, : self.object_bytes], self.fmt, cfg.validate, cfg.kernel_backend)
            lo = base + j * self.slot_bytes
            arena[lo : lo + k * self.slot_bytes].view(k, self.slot_bytes).copy_(staging[:k], non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()  # staging reused; host bytes complete
