"""The store connector's scheduler side: lookup, hit decision, load/save plans, per-stage bookkeeping.

Imports no torch (nor mooncake); it asks any object with an ``exists(keys) -> list[bool] | None``
method (every ``kvpool.backend.pool.Pool`` has one). Each request's lifecycle -- the load to run,
the compute ranges, the save floor and the record's token fields -- is a
``policy.prefill_request.PrefillRequest`` (``prefill_request(request_id)``), the state machine the
simulator's lifecycle runs too; this module feeds it the lookups, the load's all-stage outcome and
the saves, and turns its ranges into keys and plans.

Contract:
    * **Lookup.** ``lookup`` builds the key of every stage x full chunk (``policy.chunks``) and asks
      the pool about all of them in **one** batched existence check (split only above
      ``lookup_batch_keys`` keys). ``policy.hits.compute_hits`` turns the answer into GPU / pool /
      computed tokens: a chunk counts only if every stage holds it.
    * **No answer.** If the pool cannot answer (``exists`` returns ``None``), the lookup is
      ``answered=False`` with no pool tokens (prefill computes), and nothing is remembered as a
      miss. Lookups then pause -- they answer ``False`` at once without asking the pool -- for
      ``max(no_answer_pause_s, no_answer_pause_factor x the seconds the failed call blocked)``,
      so a dead master (each call ~4.3 s) cannot stall the scheduler on every request.
    * **Recheck.** ``plan_load`` re-runs the lookup when it is older than ``recheck_after_s``
      (objects may have been evicted; the check also renews Mooncake's read leases) and plans the
      load from the fresh answer; if the recheck gets no answer there is no load (recompute).
    * **Load plans** name, per stage, the keys of chunks ``[first, end)`` and the exact object size
      the worker must find (``KVSpec.chunk_object_bytes``). ``LoadTracker`` makes a request ready
      only when **every** stage has reported; any stage failing fails the whole load
      (all-or-nothing; the request recomputes those tokens), and the outcome is emitted only after
      all stages are terminal, so no stage is still writing when the request wakes.
    * **Save plans** cover the chunks ``PrefillRequest.start_save`` names: new full chunks from the
      request's save floor (chunks the pool held at lookup are not saved again; after a failed load
      the recomputed ones are). At most one save per request and ``max_inflight_saves`` overall are
      in flight; beyond that ``plan_save`` returns ``None`` and the caller tries again next step. A
      save is planned only for a request looked up whose load (if any) has ended.
    * Time is passed in (``now`` seconds, monotonic); the defaults read ``clock``.

The plan and report types live in ``kvpool.backend.connector_data`` (re-exported here).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvpool.backend.connector_data import (
    LoadOutcome,
    LoadPlan,
    SavePlan,
    StageObjects,
    StageReport,
    aggregate_load,
)
from kvpool.policy.chunks import ChunkNaming, chain_seed, digests_from_tokens
from kvpool.policy.hits import HitResult, compute_hits
from kvpool.policy.kvspec import KVSpec
from kvpool.policy.prefill_request import PrefillRequest


class ExistenceOracle(Protocol):
    """What the scheduler needs of a pool: one batched existence check (``None`` = no answer)."""

    def exists(self, keys: Sequence[str]) -> list[bool] | None: ...


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler-side settings.

    Attributes:
        chunk_tokens: tokens per chunk object (a multiple of ``page_tokens``).
        page_tokens: tokens per GPU KV page.
        min_load_tokens: loads shorter than this are recomputed instead.
        recheck_after_s: a lookup older than this is re-checked before its load is planned.
        lookup_batch_keys: most keys per existence call (ATOM: 8192; normally one call).
        no_answer_pause_s: least time lookups pause after the pool gave no answer.
        no_answer_pause_factor: the pause is at least this many times the failed call's duration.
        max_inflight_saves: saves in flight over all requests.
    """

    chunk_tokens: int = 256
    page_tokens: int = 16
    min_load_tokens: int = 0
    recheck_after_s: float = 1.0
    lookup_batch_keys: int = 8192
    no_answer_pause_s: float = 10.0
    no_answer_pause_factor: float = 10.0
    max_inflight_saves: int = 64

    def __post_init__(self) -> None:
        if self.page_tokens <= 0 or self.chunk_tokens <= 0 or self.chunk_tokens % self.page_tokens:
            raise ValueError(
                f"chunk_tokens {self.chunk_tokens} must be a positive multiple of page_tokens {self.page_tokens}"
            )
        if self.min_load_tokens < 0:
            raise ValueError(f"min_load_tokens must be >= 0, got {self.min_load_tokens}")
        if self.recheck_after_s < 0:
            raise ValueError(f"recheck_after_s must be >= 0, got {self.recheck_after_s}")
        if self.lookup_batch_keys < 1:
            raise ValueError(f"lookup_batch_keys must be >= 1, got {self.lookup_batch_keys}")
        if self.no_answer_pause_s < 0 or self.no_answer_pause_factor < 0:
            raise ValueError("no_answer_pause_s and no_answer_pause_factor must be >= 0")
        if self.max_inflight_saves < 1:
            raise ValueError(f"max_inflight_saves must be >= 1, got {self.max_inflight_saves}")


@dataclass(frozen=True)
class Lookup:
    """The answer of one lookup.

    Attributes:
        request_id: the request looked up.
        digests: the prompt's full-chunk digests (chunk ``c`` is ``digests[c]``).
        prompt_tokens: prompt length.
        gpu_hit_tokens: the GPU prefix-cache hit the lookup used.
        hit: GPU / pool / computed tokens (``policy.hits``).
        answered: ``False`` when the pool gave no answer (or lookups were paused): no pool tokens.
        at_s: when the pool answered (monotonic seconds).
        keys_checked: stage x chunk keys asked about (0 when unanswered without a call).
        exist_calls: existence calls made (1 unless above ``lookup_batch_keys``).
    """

    request_id: str
    digests: tuple[bytes, ...]
    prompt_tokens: int
    gpu_hit_tokens: int
    hit: HitResult
    answered: bool
    at_s: float
    keys_checked: int = 0
    exist_calls: int = 0


@dataclass
class _Request:
    life: PrefillRequest
    save_in_flight: SavePlan | None = None
    load: LoadPlan | None = None
    reports: dict[int, StageReport] = field(default_factory=dict)


class ConnectorScheduler:
    """Lookup, hit decision and load/save bookkeeping of one prefill instance (all its stages).

    Args:
        pool: anything with ``exists(keys) -> list[bool] | None``.
        naming: object keys and group ids (namespace, stage count).
        spec: KV geometry (object sizes per stage; ``spec.stages`` must equal ``naming.stages``).
        config: scheduler settings.
        clock: monotonic seconds, used when ``now`` is not passed.
    """

    def __init__(
        self,
        pool: ExistenceOracle,
        naming: ChunkNaming,
        spec: KVSpec,
        config: SchedulerConfig = SchedulerConfig(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if spec.stages != naming.stages:
            raise ValueError(f"the KV spec has {spec.stages} stages but the key naming {naming.stages}")
        if spec.page_tokens != config.page_tokens:
            raise ValueError(f"page size differs: spec {spec.page_tokens}, config {config.page_tokens} tokens")
        self.pool = pool
        self.naming = naming
        self.spec = spec
        self.config = config
        self.clock = clock
        self._seed = chain_seed(naming.namespace)
        self._object_bytes = tuple(spec.chunk_object_bytes(s, config.chunk_tokens) for s in range(spec.stages))
        self._requests: dict[str, _Request] = {}
        self._paused_until_s = float("-inf")
        self.no_answer_count = 0

    # -- keys ------------------------------------------------------------------------------
    def digests_for(self, token_ids: Sequence[int]) -> list[bytes]:
        """Chained digests of a token-id prompt's full chunks under this deployment's namespace."""
        return list(digests_from_tokens(token_ids, self.config.chunk_tokens, self._seed))

    def object_bytes(self, stage: int) -> int:
        """Exact size of one chunk object of ``stage``."""
        return self._object_bytes[stage]

    # -- lookup ----------------------------------------------------------------------------
    def lookup(
        self,
        request_id: str,
        digests: Sequence[bytes],
        prompt_tokens: int,
        gpu_hit_tokens: int = 0,
        now: float | None = None,
    ) -> Lookup:
        """Ask the pool about every stage x chunk at once and split the prompt (see the contract)."""
        now = self.clock() if now is None else now
        n = min(len(digests), prompt_tokens // self.config.chunk_tokens)
        chunk_digests = tuple(digests[:n])
        if now < self._paused_until_s or n == 0:
            hit = self._hits(prompt_tokens, gpu_hit_tokens, None)
            self._looked_up(request_id, hit, n == 0)
            return Lookup(request_id, chunk_digests, prompt_tokens, gpu_hit_tokens, hit, n == 0, now)
        keys = [k for row in self.naming.stage_keys(chunk_digests) for k in row]
        present, calls, blocked_s = self._exists(keys)
        if present is None:
            self.no_answer_count += 1
            pause_s = max(self.config.no_answer_pause_s, self.config.no_answer_pause_factor * blocked_s)
            self._paused_until_s = self.clock() + pause_s
            hit = self._hits(prompt_tokens, gpu_hit_tokens, None)
            self._looked_up(request_id, hit, False)
            return Lookup(request_id, chunk_digests, prompt_tokens, gpu_hit_tokens, hit, False, now, len(keys), calls)
        stage_present = [present[s * n : (s + 1) * n] for s in range(self.naming.stages)]
        hit = self._hits(prompt_tokens, gpu_hit_tokens, stage_present)
        self._looked_up(request_id, hit, True)
        return Lookup(request_id, chunk_digests, prompt_tokens, gpu_hit_tokens, hit, True, now, len(keys), calls)

    def _looked_up(self, request_id: str, hit: HitResult, answered: bool) -> None:
        """Tell the request's ``PrefillRequest`` (made at its first lookup) the answer."""
        req = self._requests.get(request_id)
        if req is None:
            req = self._requests[request_id] = _Request(PrefillRequest(hit.prompt_tokens, self.config.chunk_tokens))
        req.life.looked_up(hit, answered)

    def prefill_request(self, request_id: str) -> PrefillRequest:
        """The request's lifecycle (compute ranges, record fields, save floor); from its first
        lookup until ``finish``."""
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"request {request_id!r} was not looked up")
        return req.life

    def _hits(self, prompt_tokens: int, gpu_hit_tokens: int, stage_present) -> HitResult:
        c = self.config
        return compute_hits(
            prompt_tokens, gpu_hit_tokens, stage_present,
            chunk_tokens=c.chunk_tokens, page_tokens=c.page_tokens, min_load_tokens=c.min_load_tokens,
        )  # fmt: skip

    def _exists(self, keys: list[str]) -> tuple[list[bool] | None, int, float]:
        out: list[bool] = []
        calls = 0
        step = self.config.lookup_batch_keys
        for i in range(0, len(keys), step):
            t0 = self.clock()
            got = self.pool.exists(keys[i : i + step])
            calls += 1
            if got is None or len(got) != len(keys[i : i + step]):
                return None, calls, self.clock() - t0
            out += got
        return out, calls, 0.0

    # -- load ------------------------------------------------------------------------------
    def plan_load(self, lookup: Lookup, now: float | None = None) -> LoadPlan | None:
        """A load plan for ``lookup``'s pool hit (re-checked if stale), or ``None`` if nothing to load."""
        now = self.clock() if now is None else now
        rechecked = False
        if lookup.answered and lookup.hit.pool_tokens and now - lookup.at_s > self.config.recheck_after_s:
            lookup = self.lookup(lookup.request_id, lookup.digests, lookup.prompt_tokens, lookup.gpu_hit_tokens, now)
            rechecked = True
        life = self.prefill_request(lookup.request_id)
        load = life.load  # the latest lookup's
        if load is None:
            return None
        first, end = load
        stages = tuple(
            StageObjects(s, tuple(self.naming.object_key(d, s) for d in lookup.digests[first:end]), self._object_bytes[s])
            for s in range(self.naming.stages)
        )
        plan = LoadPlan(lookup.request_id, first, end, stages, life.account.pool_tokens, rechecked)
        req = self._requests[lookup.request_id]
        req.load = plan
        req.reports = {}
        return plan

    def report_stage(self, report: StageReport) -> LoadOutcome | None:
        """Record one stage's result; returns the outcome once every stage has reported."""
        req = self._requests.get(report.request_id)
        if req is None or req.load is None:
            raise ValueError(f"no load in progress for request {report.request_id!r}")
        if not 0 <= report.stage < self.naming.stages:
            raise ValueError(f"stage {report.stage} out of range 0..{self.naming.stages - 1}")
        if report.stage in req.reports:
            raise ValueError(f"stage {report.stage} already reported for request {report.request_id!r}")
        req.reports[report.stage] = report
        if len(req.reports) < self.naming.stages:
            return None
        plan, reports = req.load, [req.reports[s] for s in range(self.naming.stages)]
        req.load, req.reports = None, {}
        outcome = aggregate_load(plan, reports)
        req.life.loaded(outcome.ok)
        return outcome

    # -- save ------------------------------------------------------------------------------
    def plan_save(self, request_id: str, digests: Sequence[bytes], computed_tokens: int) -> SavePlan | None:
        """A save of the new full chunks below ``computed_tokens`` (the prompt's KV computed so
        far; the request's ``PrefillRequest`` is told so), or ``None`` (nothing new / busy).
        ``ValueError`` for a request not looked up or whose load has not ended."""
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"request {request_id!r} was not looked up")
        req.life.computed(computed_tokens)
        if req.save_in_flight is None and self.inflight_saves >= self.config.max_inflight_saves:
            return None
        chunks = req.life.start_save(len(digests))
        if chunks is None:
            return None
        first, end = chunks
        chosen = digests[first:end]
        stages = tuple(
            StageObjects(s, tuple(self.naming.object_key(d, s) for d in chosen), self._object_bytes[s])
            for s in range(self.naming.stages)
        )
        plan = SavePlan(request_id, first, end, tuple(self.naming.group_id(d) for d in chosen), stages)
        req.save_in_flight = plan
        return plan

    def complete_save(self, request_id: str, stored: bool) -> None:
        """The save in flight finished; ``stored=False`` (dropped) leaves the floor for a later try."""
        req = self._requests.get(request_id)
        if req is None or req.save_in_flight is None:
            raise ValueError(f"no save in flight for request {request_id!r}")
        req.life.saved(stored)
        req.save_in_flight = None

    def finish(self, request_id: str) -> None:
        """Forget a request (after its last save completed)."""
        self._requests.pop(request_id, None)

    @property
    def inflight_saves(self) -> int:
        return sum(1 for r in self._requests.values() if r.save_in_flight)


__all__ = [
    "ConnectorScheduler",
    "ExistenceOracle",
    "LoadOutcome",
    "LoadPlan",
    "Lookup",
    "SavePlan",
    "SchedulerConfig",
    "StageObjects",
    "StageReport",
]
