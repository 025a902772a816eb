"""The stage-aligned store connector: a facade that constructs and delegates by role.

Roles (as vLLM's ``KVConnectorRole``):
    ``"scheduler"``  one per prefill instance: ``ConnectorScheduler`` (lookup, hit decision,
                     load/save plans, all-stage aggregation). Imports no torch.
    ``"worker"``     one per pipeline stage (GPU): ``ConnectorWorker`` (registered buffers, pool
                     reads and writes, ``kernels.pack`` / ``kernels.unpack``).

``StageAlignedConnector`` wires one scheduler to every stage's worker in one process (the
reference engine of the connector tests, ``tests/backend/connector_testing.py``); in the prefill
engine (``backend.serve.prefill_scheduler``) the plans and reports cross process boundaries
instead, carrying the same ``connector_data`` messages. It drives the scheduler's per-request
``policy.prefill_request.PrefillRequest`` and keeps only the threads' waits: the compute ranges and
the record's token fields are the state machine's.

Per request (``StageAlignedConnector``):
    ``restore(request_id, token_ids, block_ids, gpu_hit_tokens) -> RequestRecord``
        lookup (one batched exists), plan (recheck if stale), every stage loads in parallel on
        its load thread, the scheduler aggregates (all-or-nothing).
    ``compute_ranges(request_id) -> [(start, end), ...]``  what prefill computes
        (``PrefillRequest.compute_ranges``: the tokens between the GPU hit and the loaded chunks'
        first boundary, then everything after the loaded tokens; all of ``[gpu_hit, prompt)`` when
        nothing was loaded or the load failed).
    ``save(request_id, block_ids, computed_tokens) -> SaveOutcome | None``
        after prefill: every stage packs and puts its new full chunks asynchronously (bounded);
        ``wait=True`` waits for all stages and tells the scheduler.
    ``finish(request_id) -> RequestRecord``  export the record (Prometheus) and forget the request.

The record is the simulator's ``kvpool.workload.records.RequestRecord`` (``docs/metrics.md``):
its ``key`` is the request id, ``in_tokens`` the prompt length; the connector fills the token
sources, ``restore_failed`` and ``lookup_answered`` (``PrefillRequest.account``), the restore's
times and bytes and the save's bytes, and leaves the replay's identity and timing fields at their
defaults for the engine serving the request to fill.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Literal

from kvpool.backend.connector_data import (
    LoadOutcome,
    LoadPlan,
    SaveOutcome,
    SavePlan,
    StageReport,
    StageSaveReport,
    aggregate_save,
)
from kvpool.backend.connector_scheduler import ConnectorScheduler, Lookup, SchedulerConfig
from kvpool.backend.pool.api import Pool
from kvpool.policy.chunks import ChunkNaming
from kvpool.policy.kvspec import KVSpec
from kvpool.workload.records import RequestRecord

if TYPE_CHECKING:
    import torch

    from kvpool.backend.connector_metrics import ConnectorMetrics
    from kvpool.backend.connector_worker import ConnectorWorker, WorkerConfig

Role = Literal["scheduler", "worker"]


class KVPoolConnector:
    """Construct the side of ``role`` and delegate to it (no logic of its own).

    Use ``KVPoolConnector.scheduler(...)`` or ``KVPoolConnector.worker(...)``; ``.impl`` is the
    ``ConnectorScheduler`` or ``ConnectorWorker``.
    """

    def __init__(self, role: Role, impl: object) -> None:
        if role not in ("scheduler", "worker"):
            raise ValueError(f"role must be 'scheduler' or 'worker', got {role!r}")
        self.role = role
        self.impl = impl

    @classmethod
    def scheduler(
        cls,
        pool: Pool,
        spec: KVSpec,
        namespace: str,
        config: SchedulerConfig = SchedulerConfig(),
        clock: Callable[[], float] = time.monotonic,
    ) -> KVPoolConnector:
        naming = ChunkNaming(namespace=namespace, stages=spec.stages)
        return cls("scheduler", ConnectorScheduler(pool, naming, spec, config, clock))

    @classmethod
    def worker(
        cls,
        pool: Pool,
        spec: KVSpec,
        stage: int,
        caches: list[torch.Tensor],
        config: WorkerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> KVPoolConnector:
        from kvpool.backend.connector_worker import ConnectorWorker, WorkerConfig

        return cls("worker", ConnectorWorker(pool, spec, stage, caches, config or WorkerConfig(), clock))

    def _side(self, role: Role):
        if self.role != role:
            raise RuntimeError(f"this is the {self.role} side of the connector; that call belongs to the {role} side")
        return self.impl

    # scheduler side
    def digests_for(self, token_ids: Sequence[int]) -> list[bytes]:
        return self._side("scheduler").digests_for(token_ids)

    def lookup(self, request_id: str, digests: Sequence[bytes], prompt_tokens: int, gpu_hit_tokens: int = 0) -> Lookup:
        return self._side("scheduler").lookup(request_id, digests, prompt_tokens, gpu_hit_tokens)

    def plan_load(self, lookup: Lookup) -> LoadPlan | None:
        return self._side("scheduler").plan_load(lookup)

    def report_stage(self, report: StageReport) -> LoadOutcome | None:
        return self._side("scheduler").report_stage(report)

    def plan_save(self, request_id: str, digests: Sequence[bytes], computed_tokens: int) -> SavePlan | None:
        return self._side("scheduler").plan_save(request_id, digests, computed_tokens)

    def complete_save(self, request_id: str, stored: bool) -> None:
        self._side("scheduler").complete_save(request_id, stored)

    def finish(self, request_id: str) -> None:
        self._side("scheduler").finish(request_id)

    # worker side
    def start(self) -> KVPoolConnector:
        self._side("worker").start()
        return self

    def close(self) -> None:
        if self.role == "worker":
            self.impl.close()

    def submit_load(self, plan: LoadPlan, block_ids: torch.Tensor) -> Future[StageReport]:
        return self._side("worker").submit_load(plan, block_ids)

    def submit_save(self, plan: SavePlan, block_ids: torch.Tensor) -> Future[StageSaveReport]:
        return self._side("worker").submit_save(plan, block_ids)


class StageAlignedConnector:
    """One scheduler plus every stage's worker, in one process. See the module docstring.

    Args:
        scheduler: the scheduler side.
        workers: ``workers[s]`` serves stage ``s`` (started).
        metrics: Prometheus export of finished requests (optional).
        load_wait_s: bound on waiting for a stage's load report beyond its own timeout.
    """

    def __init__(
        self,
        scheduler: ConnectorScheduler,
        workers: Sequence[ConnectorWorker],
        metrics: ConnectorMetrics | None = None,
        load_wait_s: float = 5.0,
    ) -> None:
        if [w.stage for w in workers] != list(range(scheduler.naming.stages)):
            raise ValueError(f"need one worker per stage 0..{scheduler.naming.stages - 1} in order")
        self.scheduler = scheduler
        self.workers = list(workers)
        self.metrics = metrics
        self.load_wait_s = load_wait_s
        self._records: dict[str, RequestRecord] = {}
        self._digests: dict[str, list[bytes]] = {}
        self.last_lookup: Lookup | None = None
        self.last_load: LoadOutcome | None = None
        self.last_reports: list[StageReport] = []

    def record(self, request_id: str) -> RequestRecord:
        """The request's record (a fresh one, keyed by ``request_id``, on first use)."""
        return self._records.setdefault(request_id, RequestRecord(request_id))

    def restore(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_ids: torch.Tensor,
        gpu_hit_tokens: int = 0,
        on_round: Callable[[int, int, int], None] | None = None,
    ) -> RequestRecord:
        """Look up and load the request's pool hit into its pages (all stages or none).

        ``on_round(stage, chunks_done, chunks_total)`` reports load progress (profiling, tests).
        """
        sched = self.scheduler
        digests = self._digests[request_id] = sched.digests_for(token_ids)
        n = len(token_ids)
        look = self.last_lookup = sched.lookup(request_id, digests, n, gpu_hit_tokens)
        rec = self.record(request_id)
        rec.in_tokens = n
        self.last_load, self.last_reports = None, []
        plan = sched.plan_load(look)
        life = sched.prefill_request(request_id)
        if plan is None:
            life.account.write(rec)
            return rec
        futures = [
            w.submit_load(plan, block_ids, None if on_round is None else (lambda d, t, s=w.stage: on_round(s, d, t)))
            for w in self.workers
        ]
        outcome = self.last_load = self._wait_loads(request_id, futures)
        rec.restore_stage_s = list(outcome.stage_load_s)
        rec.restore_spread_s = outcome.first_to_last_s
        rec.restore_bytes += outcome.bytes_loaded
        life.account.write(rec)
        return rec

    def _wait_loads(self, request_id: str, futures: Sequence[Future[StageReport]]) -> LoadOutcome:
        """Every stage's load report (each wait bounded), told to the scheduler in stage order."""
        sched = self.scheduler
        outcome = None
        for w, fut in zip(self.workers, futures):
            try:
                rep = fut.result(timeout=w.config.load_timeout_s + self.load_wait_s)
            except TimeoutError:  # the stage is stuck in one pool call: count it failed (bounded wait)
                now = sched.clock()
                rep = StageReport(request_id, w.stage, False, now, now, 0, "timeout")
            except Exception as e:  # a bug or a broken pool client: a failed stage, never a hang
                now = sched.clock()
                rep = StageReport(request_id, w.stage, False, now, now, 0, f"error: {e!r}")
            self.last_reports.append(rep)
            outcome = sched.report_stage(rep) or outcome
        assert outcome is not None
        return outcome

    def compute_ranges(self, request_id: str) -> list[tuple[int, int]]:
        """Token ranges ``[start, end)`` prefill must compute, in order, after ``restore``
        (``PrefillRequest.compute_ranges``: the last one ends at the prompt's end)."""
        return list(self.scheduler.prefill_request(request_id).compute_ranges)

    def submit_save(self, request_id: str, block_ids: torch.Tensor, computed_tokens: int) -> tuple[SavePlan, list[Future[StageSaveReport]]] | None:
        """Start saving the request's new full chunks on every stage; ``None`` if nothing to save now."""
        plan = self.scheduler.plan_save(request_id, self._digests[request_id], computed_tokens)
        if plan is None:
            return None
        return plan, [w.submit_save(plan, block_ids) for w in self.workers]

    def complete_save(self, plan: SavePlan, futures: Sequence[Future[StageSaveReport]]) -> SaveOutcome:
        """Wait for every stage's save (each bounded by its timeout) and tell the scheduler."""
        reports = []
        for w, fut in zip(self.workers, futures):
            try:
                reports.append(fut.result(timeout=w.config.save_timeout_s + self.load_wait_s))
            except TimeoutError:
                now = self.scheduler.clock()
                reports.append(StageSaveReport(plan.request_id, w.stage, 0, plan.chunks, now, now, 0, "timeout"))
            except Exception as e:
                now = self.scheduler.clock()
                reports.append(StageSaveReport(plan.request_id, w.stage, 0, plan.chunks, now, now, 0, f"error: {e!r}"))
        outcome = aggregate_save(plan, reports)
        self.scheduler.complete_save(plan.request_id, outcome.stored)
        self.record(plan.request_id).save_bytes += outcome.bytes_saved
        return outcome

    def save(self, request_id: str, block_ids: torch.Tensor, computed_tokens: int) -> SaveOutcome | None:
        """``submit_save`` then ``complete_save``."""
        started = self.submit_save(request_id, block_ids, computed_tokens)
        return None if started is None else self.complete_save(*started)

    def finish(self, request_id: str) -> RequestRecord:
        """Export the request's record and forget it (call after its last save completed)."""
        rec = self._records.pop(request_id, RequestRecord(request_id))
        self._digests.pop(request_id, None)
        self.scheduler.finish(request_id)
        if self.metrics is not None:
            self.metrics.observe(rec)
        return rec

    def close(self) -> None:
        for w in self.workers:
            w.close()
