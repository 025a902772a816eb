"""Messages between the store connector's scheduler side and its per-stage workers, and their aggregation.

Plain frozen dataclasses; imports neither torch nor mooncake (the simulator can use them).

Primitives, by direction:
    scheduler -> workers:
        ``LoadPlan``   load chunks ``[first_chunk, end_chunk)``; ``stages[s]`` names stage ``s``'s
                       keys and the exact object size it must find.
        ``SavePlan``   save chunks ``[first_chunk, end_chunk)`` with one group id per chunk.
    worker -> scheduler (one report per stage; the request is terminal only when every stage
    has reported, failure-dominant):
        ``StageReport``      one stage's load finished (``ok``) or failed.
        ``StageSaveReport``  one stage's save finished: chunks stored, bytes, failure reason.
    aggregation (pure; the scheduler and the facade call these):
        ``aggregate_load(plan, reports) -> LoadOutcome``
        ``aggregate_save(plan, reports) -> SaveOutcome``
The per-request record the connector fills is ``kvpool.workload.records.RequestRecord``, the
simulator's record type (``docs/metrics.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StageObjects:
    """One stage's objects of a plan: keys of consecutive chunks, each exactly ``object_bytes``."""

    stage: int
    keys: tuple[str, ...]
    object_bytes: int


@dataclass(frozen=True)
class LoadPlan:
    """Scheduler -> workers: load chunks ``[first_chunk, end_chunk)`` of every stage.

    Attributes:
        request_id: the request.
        first_chunk: first chunk to load (a chunk boundary at or after the GPU hit).
        end_chunk: one past the last chunk.
        stages: per stage, the keys to read and their exact size.
        pool_tokens: tokens the load provides.
        rechecked: whether the lookup was re-run before planning.
    """

    request_id: str
    first_chunk: int
    end_chunk: int
    stages: tuple[StageObjects, ...]
    pool_tokens: int
    rechecked: bool

    @property
    def chunks(self) -> int:
        return self.end_chunk - self.first_chunk

    @property
    def total_bytes(self) -> int:
        return sum(len(s.keys) * s.object_bytes for s in self.stages)


@dataclass(frozen=True)
class SavePlan:
    """Scheduler -> workers: save chunks ``[first_chunk, end_chunk)``; ``group_ids[i]`` is chunk ``first + i``'s group."""

    request_id: str
    first_chunk: int
    end_chunk: int
    group_ids: tuple[str, ...]
    stages: tuple[StageObjects, ...]

    @property
    def chunks(self) -> int:
        return self.end_chunk - self.first_chunk


@dataclass(frozen=True)
class StageReport:
    """Worker -> scheduler: one stage finished its part of a load.

    Attributes:
        request_id: the request.
        stage: the pipeline stage.
        ok: every object was read with its exact size and unpacked.
        started_s: when the stage started its load (monotonic seconds).
        finished_s: when it finished (or failed).
        bytes_loaded: bytes read from the pool.
        reason: why it failed (empty when ``ok``): ``"missing"``, ``"wrong_size"``, ``"failed"``,
            ``"no_answer"``, ``"timeout"``, ``"size_mismatch"`` (plan vs this stage's format), ...
        rounds: pool reads the stage needed (a request larger than the load buffer takes several).
        get_s, unpack_s: seconds in pool reads and in unpacking (ATOM's get_ms / unpack_ms).
    """

    request_id: str
    stage: int
    ok: bool
    started_s: float
    finished_s: float
    bytes_loaded: int = 0
    reason: str = ""
    rounds: int = 0
    get_s: float = 0.0
    unpack_s: float = 0.0


@dataclass(frozen=True)
class LoadOutcome:
    """A load once every stage reported: ready (``ok``) or failed (the request recomputes).

    Attributes:
        request_id: the request.
        ok: all stages loaded.
        pool_tokens: tokens loaded (0 when failed).
        stage_load_s: per stage, finish - start.
        first_to_last_s: last stage's finish - first stage's start (the seed's restore wait).
        bytes_loaded: over all stages.
        failed_stages: stages that reported failure.
    """

    request_id: str
    ok: bool
    pool_tokens: int
    stage_load_s: tuple[float, ...]
    first_to_last_s: float
    bytes_loaded: int
    failed_stages: tuple[int, ...]


def _check_stage_order(plan: LoadPlan | SavePlan, reports: Sequence[StageReport | StageSaveReport]) -> None:
    if len(reports) != len(plan.stages) or any(r.stage != s for s, r in enumerate(reports)):
        raise ValueError(f"need one report per stage in stage order, got stages {[r.stage for r in reports]}")


def aggregate_load(plan: LoadPlan, reports: Sequence[StageReport]) -> LoadOutcome:
    """All-stage, failure-dominant outcome of a load; ``reports[s]`` is stage ``s``'s report."""
    _check_stage_order(plan, reports)
    failed = tuple(r.stage for r in reports if not r.ok)
    return LoadOutcome(
        request_id=plan.request_id,
        ok=not failed,
        pool_tokens=0 if failed else plan.pool_tokens,
        stage_load_s=tuple(r.finished_s - r.started_s for r in reports),
        first_to_last_s=max(r.finished_s for r in reports) - min(r.started_s for r in reports),
        bytes_loaded=sum(r.bytes_loaded for r in reports),
        failed_stages=failed,
    )


@dataclass(frozen=True)
class StageSaveReport:
    """Worker -> scheduler: one stage's save finished.

    Attributes:
        request_id: the request.
        stage: the pipeline stage.
        stored_chunks: chunks of the plan this stage stored (``OK`` from the pool), in plan order.
        planned_chunks: chunks the plan asked for.
        started_s, finished_s: monotonic seconds.
        bytes_saved: bytes written to the pool (stored objects only).
        reason: why not everything was stored (empty when all were): ``"full"``, ``"no_answer"``,
            ``"failed"``, ``"dropped"`` (no room in flight), ``"timeout"``, ``"error"``.
        pack_s, put_s: seconds in packing and in pool writes (ATOM's pack_ms / put_ms).
    """

    request_id: str
    stage: int
    stored_chunks: int
    planned_chunks: int
    started_s: float
    finished_s: float
    bytes_saved: int = 0
    reason: str = ""
    pack_s: float = 0.0
    put_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.stored_chunks == self.planned_chunks


@dataclass(frozen=True)
class SaveOutcome:
    """A save once every stage reported: ``stored`` only if every stage stored every chunk.

    A partly stored save leaves partial groups in the pool; they never count as hits
    (``policy.hits``), and the scheduler plans the save again (puts of existing keys are no-ops).
    """

    request_id: str
    stored: bool
    bytes_saved: int
    save_s: float
    failed_stages: tuple[int, ...]


def aggregate_save(plan: SavePlan, reports: Sequence[StageSaveReport]) -> SaveOutcome:
    """All-stage outcome of a save; ``reports[s]`` is stage ``s``'s report."""
    _check_stage_order(plan, reports)
    failed = tuple(r.stage for r in reports if not r.ok)
    return SaveOutcome(
        request_id=plan.request_id,
        stored=not failed,
        bytes_saved=sum(r.bytes_saved for r in reports),
        save_s=max(r.finished_s for r in reports) - min(r.started_s for r in reports),
        failed_stages=failed,
    )

