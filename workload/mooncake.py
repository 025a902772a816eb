"""Mooncake FAST'25 JSONL rows <-> sessions, and Weka sessions -> Mooncake rows.

Contract:
    * A Mooncake row is ``{"timestamp": ms, "input_length": int, "output_length": int,
      "hash_ids": [int, ...]}`` with one id per 512-token block (global prefix hashes). Rows have
      no sessions, so each row becomes a one-request :class:`Session` with ``hash_scope="global"``
      whose request starts at ``timestamp / 1000`` (absolute: every row shares one timeline).
    * ``weka_to_mooncake_rows`` flattens Weka sessions (all threads) in time order. Each session
      starts ``stagger_s * k`` seconds after the first; local ids are made global by interning
      the tuple (session, 64-token ids of the 512-token block) in first-seen order, so equal ids
      still mean equal prefixes and sessions never alias each other. The last block of a prompt
      that does not fill it is named by its ids and its token count: an id always stands for one
      block size (clients that rebuild prompts from ids, such as AIPerf, refuse an id seen at two).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from kvpool.workload.errors import TraceError
from kvpool.workload.model import BlockStoreBuilder, Request, Session, Thread
from kvpool.workload.weka import MAX_TIME_S, MAX_TOKENS

MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _bad(msg: str, line: int) -> TraceError:
    return TraceError(msg, request=f"line {line}")


def session_from_mooncake_row(row: Any, line: int, *, prev_ms: float | None = None, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Session:
    """Validate one Mooncake row (1-based ``line``) and build its one-request session."""
    if not isinstance(row, dict):
        raise _bad("a row must be a JSON object", line)
    for key in MOONCAKE_FIELDS:
        if key not in row:
            raise _bad(f"field '{key}' is missing", line)
    ts, n_in, n_out, ids = (row[k] for k in MOONCAKE_FIELDS)
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts) or not 0 <= ts <= MAX_TIME_S * 1000:
        raise _bad(f"field 'timestamp' must be a number >= 0 and <= {MAX_TIME_S * 1000:g} (ms), got {ts!r}", line)
    if prev_ms is not None and ts < prev_ms:
        raise _bad(f"timestamp decreases ({ts} ms after {prev_ms} ms)", line)
    for key, v in (("input_length", n_in), ("output_length", n_out)):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_TOKENS:
            raise _bad(f"field '{key}' must be an integer >= 0 and <= {MAX_TOKENS}, got {v!r}", line)
    if not isinstance(ids, list):
        raise _bad("field 'hash_ids' must be a list", line)
    if len(ids) not in (n_in // block_tokens, -(-n_in // block_tokens)):
        raise _bad(
            f"hash_ids has {len(ids)} blocks but input_length={n_in} needs {-(-n_in // block_tokens)} blocks of {block_tokens} tokens",
            line,
        )
    arr = np.asarray(ids) if ids else np.zeros(0, dtype=np.int64)
    if ids and (arr.dtype.kind not in "iu" or arr.ndim != 1 or (arr.dtype.kind == "i" and arr.min() < 0)
                or any(type(x) is bool for x in ids)):
        raise _bad("hash_ids must be a list of non-negative integers", line)
    b = BlockStoreBuilder()
    b.add(-1, 0, arr, len(ids))
    req = Request(
        index=0, thread=0, seq=0, t_s=ts / 1000.0, in_tokens=n_in, out_tokens=n_out,
        api_time_s=0.0, think_time_s=0.0, deps=(), source=f"line {line}",
    )
    main = Thread(index=0, parent=None, spawn_request=None, join_request=None, requests=(0,), agent_id="main", agent_type="main")
    return Session(
        id=f"row{line}", block_tokens=block_tokens, hash_scope="global", threads=(main,),
        requests=(req,), blocks=b.build(),
    )


def weka_to_mooncake_rows(
    sessions: Iterable[Session], *, stagger_s: float = 0.0, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[dict]:
    """Flatten sessions into Mooncake rows sorted by timestamp (see module contract)."""
    rows: list[tuple[float, int, dict]] = []
    intern: dict[tuple, int] = {}
    n = 0
    for k, s in enumerate(sessions):
        if block_tokens % s.block_tokens:
            raise ValueError(f"block size {block_tokens} is not a multiple of the trace's {s.block_tokens}")
        per = block_tokens // s.block_tokens
        offset_s = stagger_s * k - s.start_s
        scope = s.id if s.hash_scope == "local" else ""
        for r in s.requests:
            ids = s.block_ids(r.index).tolist()
            out_ids = []
            for c in range(0, len(ids), per):
                # ids are prefix-chained, so the block's last id names the whole prefix; a block the
                # prompt does not fill is named by its ids and its token count (one id, one size)
                width = r.in_tokens - c * s.block_tokens
                key = (scope, ids[c + per - 1]) if width >= block_tokens else (scope, "part", tuple(ids[c:c + per]), width)
                gid = intern.get(key)
                if gid is None:
                    gid = intern[key] = len(intern)
                out_ids.append(gid)
            need = -(-r.in_tokens // block_tokens)
            out_ids = out_ids[:need]
            rows.append(
                (
                    (r.t_s + offset_s) * 1000.0,
                    n,
                    {
                        "timestamp": int(round((r.t_s + offset_s) * 1000.0)),
                        "input_length": r.in_tokens,
                        "output_length": r.out_tokens,
                        "hash_ids": out_ids,
                    },
                )
            )
            n += 1
    rows.sort(key=lambda x: (x[0], x[1]))
    return [r for _, _, r in rows]


def sessions_to_mooncake_rows(sessions: Iterable[Session]) -> Iterator[dict]:
    """Rows of sessions that came from Mooncake (or any global-scope 512-token trace), as is."""
    for s in sessions:
        for r in s.requests:
            yield {
                "timestamp": int(round(r.t_s * 1000.0)),
                "input_length": r.in_tokens,
                "output_length": r.out_tokens,
                "hash_ids": s.block_ids(r.index).tolist(),
            }
