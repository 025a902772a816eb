"""The prefill -> decode KV handoff: gather on prefill, large writes, scatter on decode.

Prefill (PP: a stage holds every token of its layers) and decode (TP + DCP: a rank holds every
R-th token of all layers) keep KV in different layouts. Each stage gathers the tokens bound for
each decode rank into contiguous staging (``kernels.gather_dcp``), writes it in the writes of
``policy.layout.HandoffPlan`` (at most 8 MiB each, one transport write per write) into landing
slots the rank credited to it, and announces each landed slot over a pyzmq side channel on
127.0.0.1; the rank scatters each slot into its paged KV (``kernels.scatter_dcp``) and credits it
back. A request is ready for decode when every stage's part has been scattered.

Modules:
    ``prefill``    ``PrefillStage`` (connect, send) and ``DecodeTarget``
    ``decode``     ``DecodeRank`` (expect, poll, wait) and ``StagePart``
    ``transport``  ``MooncakeTransport`` (Transfer Engine, TCP/RDMA), ``IpcTransport`` (same-host
                   GPU IPC / shared memory), ``LocalTransport`` (same process), ``make_transport``
    ``messages``   side-channel messages and the errors (``HandoffError`` and subclasses)
    ``metrics``    ``StageReport``, ``HandoffResult``; ``record_handoff`` fills a request's
                   ``RequestRecord`` (``kvpool.workload.records``), ``handoff_breakdown``

See ``docs/handoff.md``.
"""

from kvpool.backend.handoff.decode import DecodeRank, StagePart
from kvpool.backend.handoff.messages import CreditTimeout, HandoffError, PeerLost, TransferFailed
from kvpool.backend.handoff.metrics import (
    HandoffBreakdown,
    HandoffResult,
    StageReport,
    handoff_breakdown,
    record_handoff,
)
from kvpool.backend.handoff.prefill import DecodeTarget, PrefillStage
from kvpool.backend.handoff.transport import IpcTransport, LocalTransport, MooncakeTransport, make_transport

__all__ = [
    "CreditTimeout",
    "DecodeRank",
    "DecodeTarget",
    "HandoffBreakdown",
    "HandoffError",
    "HandoffResult",
    "IpcTransport",
    "LocalTransport",
    "MooncakeTransport",
    "PeerLost",
    "PrefillStage",
    "StagePart",
    "StageReport",
    "TransferFailed",
    "handoff_breakdown",
    "make_transport",
    "record_handoff",
]
