"""Handoff metrics: what each prefill stage and decode rank measured, and the per-request record.

Contract:
    * ``StageReport`` is what one prefill stage's ``send`` returns: bytes and writes it sent (exactly
      ``plan.total_bytes`` and ``plan.batched_writes``) and where its time went.
    * ``HandoffResult`` is what one decode rank's ``wait`` returns: bytes and writes that landed on
      it, ``handoff_s`` from ``expect`` to the last scatter of the last stage, and per stage the time
      from ``expect`` to that stage's last scatter (``stage_s``).
    * ``record_handoff(record, reports, results)`` fills the hand-off fields of the request's
      ``kvpool.workload.records.RequestRecord`` (``docs/metrics.md``) from every stage's report and
      every rank's result: ``handoff_bytes`` and ``handoff_writes`` summed over stages (every byte
      crosses once), ``handoff_s`` the slowest decode rank. Every report and result must be of the
      record's request (``request_id == record.key``), else ``ValueError`` and the record is untouched.
    * ``handoff_breakdown(reports, results)``: where the time went, beyond the record's fields
      (``HandoffBreakdown``: the slowest rank per stage, the slowest gather, the slowest scatter).
    Times are ``time.monotonic`` seconds. On a GPU, ``gather_s`` is host time (the transport's stream
    waits for the gather, so unfinished gather time shows up in ``transfer_s``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.workload.records import RequestRecord


@dataclass(frozen=True)
class StageReport:
    """One prefill stage's part of one request."""

    request_id: str
    stage: int
    handoff_bytes: int
    handoff_writes: int
    gather_s: float
    transfer_s: float
    credit_wait_s: float
    handoff_s: float
    peak_inflight: int


@dataclass(frozen=True)
class HandoffResult:
    """One decode rank's view of one finished request."""

    request_id: str
    rank: int
    handoff_bytes: int
    handoff_writes: int
    handoff_s: float
    scatter_s: float
    stage_s: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class HandoffBreakdown:
    """Where one request's hand-off time went (figures the per-request record has no field for).

    Attributes:
        stage_s: per stage, the slowest rank's time from ``expect`` to that stage's last scatter.
        gather_s: the slowest stage's gather.
        scatter_s: the slowest rank's scatter.
    """

    stage_s: dict[int, float]
    gather_s: float
    scatter_s: float


def record_handoff(
    record: RequestRecord, reports: Sequence[StageReport], results: Sequence[HandoffResult]
) -> RequestRecord:
    """Set ``record.handoff_bytes``, ``handoff_writes`` and ``handoff_s`` from one request's stage
    reports and rank results; return ``record``."""
    others = sorted({str(x.request_id) for x in (*reports, *results) if x.request_id != record.key})
    if others:
        raise ValueError(f"hand-off figures of request(s) {', '.join(others)} given for request {record.key!r}")
    record.handoff_bytes = sum(r.handoff_bytes for r in reports)
    record.handoff_writes = sum(r.handoff_writes for r in reports)
    record.handoff_s = max((r.handoff_s for r in results), default=0.0)
    return record


def handoff_breakdown(reports: Sequence[StageReport], results: Sequence[HandoffResult]) -> HandoffBreakdown:
    """The slowest rank per stage, the slowest gather and the slowest scatter of one request."""
    stage_s: dict[int, float] = {}
    for res in results:
        for s, t in res.stage_s.items():
            stage_s[s] = max(stage_s.get(s, 0.0), t)
    return HandoffBreakdown(
        stage_s=dict(sorted(stage_s.items())),
        gather_s=max((r.gather_s for r in reports), default=0.0),
        scatter_s=max((r.scatter_s for r in results), default=0.0),
    )
