"""Builders of small hand-made Weka traces and the locations of the real traces.

Imported by the workload tests (this folder) and the simulator's (tests/sim/conftest.py puts this
folder on the import path).

* ``KV_TRACES``, ``MOONCAKE``: the subset of real traces kept in the repository (tests/data/traces,
  its README names the files, their sources and licence); every test that needs real traces uses it.
* ``CORPUS_KV_TRACES``, ``CORPUS_MOONCAKE``: the full corpora, for the few checks of statistics
  published for a whole corpus: ``$KVPOOL_TRACE_CORPUS``, default ``../shared/traces`` beside the
  checkout. ``needs_corpus(path)`` skips a test, saying so, when they are not there.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
TRACES = _ROOT / "tests" / "data" / "traces"
KV_TRACES = TRACES / "kv-cache-tester"
MOONCAKE = TRACES / "mooncake-fast25"
MOONCAKE_CONVERSATION_HEAD = MOONCAKE / "conversation_trace_head4000.jsonl"  # its first 4,000 rows

CORPUS = Path(os.environ.get("KVPOOL_TRACE_CORPUS", _ROOT.parent / "shared" / "traces"))
CORPUS_KV_TRACES = CORPUS / "kv-cache-tester"
CORPUS_MOONCAKE = CORPUS / "mooncake-fast25"


def needs_corpus(path: Path):
    """Skip unless ``path`` of the full trace corpus exists."""
    return pytest.mark.skipif(not path.exists(), reason=f"needs the full trace corpus at ../shared/traces "
                                                        f"(or $KVPOOL_TRACE_CORPUS); {path} is not there")


def req(t: float, n_in: int, ids: list[int] | None = None, *, out: int = 10, api: float = 1.0, block: int = 64) -> dict:
    """One Weka request; ``ids`` default to 0..ceil(in/block)-1 (a growing shared prefix)."""
    if ids is None:
        ids = list(range(-(-n_in // block)))
    return {"t": t, "type": "n", "in": n_in, "out": out, "hash_ids": ids, "api_time": api, "think_time": 0.0}


def sub(t: float, requests: list[dict], *, duration_ms: float | None = None, agent_id: str = "agent_001") -> dict:
    e = {"t": t, "type": "subagent", "agent_id": agent_id, "subagent_type": "Explore", "status": "completed", "requests": requests}
    if duration_ms is not None:
        e["duration_ms"] = duration_ms
    return e


def trace(tid: str, requests: list[dict], block: int = 64) -> dict:
    return {"id": tid, "models": ["m"], "block_size": block, "hash_id_scope": "local", "requests": requests}


def write(path: Path, doc, *, gz: bool = False) -> Path:
    data = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def spawn_join_trace() -> dict:
    """main r0 r1 [sub A spawned after r1, joined by r2] r2 [sub B, background] r3."""
    return trace(
        "tj",
        [
            req(0.0, 128, [1, 2], api=2.0),
            req(10.0, 192, [1, 2, 3], api=2.0),
            sub(12.5, [req(0.0, 64, [10], api=1.0), req(3.0, 128, [10, 11], api=1.0)], duration_ms=5000),
            req(20.0, 256, [1, 2, 3, 4], api=2.0),
            sub(23.0, [req(0.0, 64, [20], api=1.0)], duration_ms=100_000, agent_id="agent_002"),
            req(30.0, 320, [1, 2, 3, 4, 5], api=2.0),
        ],
    )
