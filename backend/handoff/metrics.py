"""Handoff metrics under the simulator's names (``docs/metrics.md``: ``handoff_s``,
``handoff_bytes``, ``handoff_writes``), per prefill stage and per decode rank.

Contract:
    * ``StageReport`` is what one prefill stage's ``send`` returns: bytes and writes it sent (exactly
      ``plan.total_bytes`` and ``plan.batched_writes``) and where its time went.
    * ``HandoffResult`` is what one decode rank's ``wait`` returns: bytes and writes that landed on
      it, ``handoff_s`` from ``expect`` to the last scatter of the last stage, and per stage the time
      from ``expect`` to that stage's last scatter (``stage_s``).
    * ``request_metrics`` folds one request's reports and results into the simulator's per-request
      fields: ``handoff_bytes`` and ``handoff_writes`` summed over stages (every byte crosses once),
      ``handoff_s`` the slowest decode rank, ``handoff_stage_s`` the slowest rank per stage.
    Times are ``time.monotonic`` seconds. On a GPU, ``gather_s`` is host time (the transport's stream
    waits for the gather, so unfinished gather time shows up in ``transfer_s``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


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


def request_metrics(reports: Sequence[StageReport], results: Sequence[HandoffResult]) -> dict:
    """The simulator's per-request handoff fields from every stage's report and every rank's result."""
    stage_s: dict[int, float] = {}
    for res in results:
        for s, t in res.stage_s.items():
            stage_s[s] = max(stage_s.get(s, 0.0), t)
    return {
        "handoff_bytes": sum(r.handoff_bytes for r in reports),
        "handoff_writes": sum(r.handoff_writes for r in reports),
        "handoff_s": max((r.handoff_s for r in results), default=0.0),
        "handoff_stage_s": dict(sorted(stage_s.items())),
        "gather_s": max((r.gather_s for r in reports), default=0.0),
        "scatter_s": max((r.scatter_s for r in results), default=0.0),
    }
