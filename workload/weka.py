"""Weka / AgentX trace documents <-> :class:`~kvpool.workload.model.Session`.

Contract (the format is described in docs/traces.md and ../shared/reference/agentx-traces.md):
    * ``session_from_weka(doc)`` validates one trace object and returns a Session. Required trace
      fields: ``id``, ``block_size`` (> 0), ``requests``; ``hash_id_scope`` defaults to ``"local"``.
      Required request fields: ``t`` (>= 0, non-decreasing within a thread), ``in``, ``out``
      (integers >= 0) and ``hash_ids`` (non-negative integers, ``ceil`` or ``floor`` of
      ``in / block_size`` of them). ``api_time`` and ``think_time`` default to 0 when absent.
    * Entries with ``type: "subagent"`` open a new thread. Its spawn is anchored on the preceding
      turn of the parent list (an entry with none is dropped and counted); it joins the first
      later parent turn whose ``t`` is at or after the subagent's recorded end
      (``t + duration_ms / 1000``, or its last inner end when ``duration_ms`` is absent) and runs
      in the background when there is no such turn. Inner ``t`` is spawn-relative when the first
      inner ``t`` is below the entry's ``t`` (kv-cache-tester), else absolute (SemiAnalysis).
    * Dependency gaps are end-to-start: ``max(0, t - recorded end of the dependency)``.
    * ``session_to_weka(session)`` writes the format back (absolute inner times).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpool.workload.errors import TraceError
from kvpool.workload.model import (
    KEYFRAME_EVERY,
    BlockStoreBuilder,
    Dep,
    Request,
    Session,
    Thread,
)

#: Tolerance when comparing recorded times (the traces round to milliseconds).
TIME_EPS_S = 1e-6


@dataclass
class _Raw:
    thread: int
    path: str
    t_s: float
    in_tokens: int
    out_tokens: int
    api_time_s: float
    think_time_s: float
    lcp: int
    ref: int  # raw index
    tail: np.ndarray
    n_blocks: int
    prev_lcp: int


@dataclass
class _RawThread:
    parent: int | None
    anchor: int | None  # raw index of the spawning parent turn
    end_s: float | None  # recorded end (subagents)
    after_pos: int  # parent's raw request count at the entry (join candidates come after)
    agent_id: str
    agent_type: str
    requests: list[int] = field(default_factory=list)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


MAX_TOKENS = 1 << 24          # tokens of one request's input or output: longer than any model's context
MAX_API_TIME_S = 86_400.0     # one model call (api_time) or one pause (think_time): at most a day
MAX_TIME_S = 1e10             # a time in a trace (t, duration_ms / 1000): past any session; epoch seconds fit


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two id arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    eq = a[:n] == b[:n]
    return n if eq.all() else int(eq.argmin())


def _ids_array(ids: Any, path: str) -> np.ndarray:
    """Validate a JSON ``hash_ids`` list as non-negative integers (int64 array)."""
    if isinstance(ids, np.ndarray):
        return ids
    if not isinstance(ids, list):
        raise TraceError("field 'hash_ids' must be a list", request=path)
    if not ids:
        return np.zeros(0, dtype=np.int64)
    try:
        arr = np.asarray(ids)
    except (ValueError, OverflowError, TypeError):
        raise TraceError("hash_ids must be a list of non-negative integers", request=path) from None
    if arr.dtype.kind not in "iu" or arr.ndim != 1 or bool in map(type, ids):
        raise TraceError("hash_ids must be a list of non-negative integers", request=path)
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise TraceError(f"hash_ids must be non-negative (found {int(arr.min())})", request=path)
    return arr.astype(np.int64, copy=False)


class _Parser:
    def __init__(self, block_tokens: int, id_table: list[np.ndarray] | None = None):
        self.block_tokens = block_tokens
        self.id_table = id_table
        self.raws: list[_Raw] = []
        self.threads: list[_RawThread] = []
        self.dropped = 0
        self._last_ids: dict[int, np.ndarray] = {}

    def request(self, r: dict, thread: int, path: str, base_s: float) -> int:
        for key in ("t", "in", "out", "hash_ids"):
            if key not in r:
                raise TraceError(f"field '{key}' is missing", request=path)
        t, n_in, n_out, ids = r["t"], r["in"], r["out"], r["hash_ids"]
        if not _num(t) or not 0 <= t <= MAX_TIME_S:
            raise TraceError(f"field 't' must be a number >= 0 and <= {MAX_TIME_S:g} s, got {t!r}", request=path)
        for key, v in (("in", n_in), ("out", n_out)):
            if not _int(v) or not 0 <= v <= MAX_TOKENS:
                raise TraceError(f"field '{key}' must be an integer >= 0 and <= {MAX_TOKENS}, got {v!r}", request=path)
        api, think = r.get("api_time", 0.0), r.get("think_time", 0.0)
        for key, v in (("api_time", api), ("think_time", think)):
            if v is not None and (not _num(v) or not 0 <= v <= MAX_API_TIME_S):
                raise TraceError(f"field '{key}' must be a number >= 0 and <= {MAX_API_TIME_S:g} s, got {v!r}",
                                 request=path)
        if self.id_table is not None and isinstance(ids, dict) and "@" in ids:
            ids = self.id_table[ids["@"]]
        ids = _ids_array(ids, path)
        b = self.block_tokens
        if len(ids) not in (n_in // b, -(-n_in // b)):
            raise TraceError(
                f"hash_ids has {len(ids)} blocks but in={n_in} needs {-(-n_in // b)} blocks of {b} tokens",
                request=path,
            )
        t_abs = float(t) + base_s
        th = self.threads[thread]
        raw_index = len(self.raws)
        prev_ids = self._last_ids.get(thread)
        if th.requests:
            prev = self.raws[th.requests[-1]]
            if t_abs < prev.t_s - TIME_EPS_S:
                raise TraceError(f"t decreases within its thread ({t_abs:g} s after {prev.t_s:g} s)", request=path)
        prev_lcp = 0 if prev_ids is None else _lcp(prev_ids, ids)
        if prev_ids is not None and len(th.requests) % KEYFRAME_EVERY:
            lcp, ref = prev_lcp, th.requests[-1]
        else:
            lcp, ref = 0, -1
        tail = ids[lcp:] if lcp else ids
        self._last_ids[thread] = ids
        self.raws.append(
            _Raw(thread, path, t_abs, n_in, n_out, float(api or 0.0), float(think or 0.0), lcp, ref, tail, len(ids), prev_lcp)
        )
        th.requests.append(raw_index)
        return raw_index

    def entries(self, entries: Any, thread: int, path: str, base_s: float) -> None:
        if not isinstance(entries, list):
            raise TraceError("field 'requests' must be a list", request=path or None)
        for k, e in enumerate(entries):
            p = f"{path}requests[{k}]"
            if not isinstance(e, dict):
                raise TraceError("entry must be an object", request=p)
            if e.get("type") == "subagent":
                self.subagent(e, thread, p, base_s)
            else:
                self.request(e, thread, p, base_s)

    def subagent(self, e: dict, parent: int, path: str, base_s: float) -> None:
        t = e.get("t")
        if not _num(t) or not 0 <= t <= MAX_TIME_S:
            raise TraceError(f"field 't' must be a number >= 0 and <= {MAX_TIME_S:g} s, got {t!r}", request=path)
        inner = e.get("requests")
        if not isinstance(inner, list):
            raise TraceError("subagent field 'requests' must be a list", request=path)
        pth = self.threads[parent]
        if not pth.requests or not inner:
            self.dropped += 1
            return
        t_abs = float(t) + base_s
        first_t = next((q.get("t") for q in inner if isinstance(q, dict) and q.get("type") != "subagent"), None)
        relative = _num(first_t) and first_t < float(t) - TIME_EPS_S
        inner_base = t_abs if relative else base_s
        dur_ms = e.get("duration_ms")
        if dur_ms is not None and (not _num(dur_ms) or not 0 <= dur_ms <= MAX_TIME_S * 1000):
            raise TraceError(f"field 'duration_ms' must be a number >= 0 and <= {MAX_TIME_S * 1000:g}, got {dur_ms!r}",
                             request=path)
        index = len(self.threads)
        self.threads.append(
            _RawThread(
                parent=parent,
                anchor=pth.requests[-1],
                end_s=None if dur_ms is None else t_abs + dur_ms / 1000.0,
                after_pos=len(pth.requests),
                agent_id=str(e.get("agent_id", f"agent_{index:03d}")),
                agent_type=str(e.get("subagent_type", "subagent")),
            )
        )
        self.entries(inner, index, path + ".", inner_base)
        th = self.threads[index]
        if not th.requests:
            self.dropped += 1
            th.anchor = None
        elif th.end_s is None:
            th.end_s = max(self.raws[i].t_s + self.raws[i].api_time_s for i in th.requests)


def session_from_weka(doc: Any, *, source: str = "", id_table: list[np.ndarray] | None = None) -> Session:
    """Validate one Weka trace object and build its :class:`Session` (raises :class:`TraceError`).

    ``id_table``: pre-parsed ``hash_ids`` arrays; a request whose ``hash_ids`` is ``{"@": k}``
    takes ``id_table[k]`` (the loader's fast path, see :mod:`kvpool.workload.load`).
    """
    if not isinstance(doc, dict):
        raise TraceError("a trace must be a JSON object", file=source)
    trace_id = doc.get("id")
    tid = trace_id if isinstance(trace_id, str) else str(trace_id) if _int(trace_id) else None
    try:
        if trace_id is None:
            raise TraceError("field 'id' is missing")
        if tid is None:
            raise TraceError(f"field 'id' must be a string (or an integer), got {type(trace_id).__name__}")
        if not tid.strip():
            raise TraceError(f"field 'id' is {'empty' if not tid else 'blank'}; a trace needs a name")
        if len(tid) > 1024:
            raise TraceError(f"field 'id' is {len(tid)} characters long; at most 1024")
        block = doc.get("block_size")
        if block is None:
            raise TraceError("field 'block_size' is missing")
        if not _int(block) or block <= 0:
            raise TraceError(f"field 'block_size' must be an integer > 0, got {block!r}")
        scope = doc.get("hash_id_scope", "local")
        if scope not in ("local", "global"):
            raise TraceError(f"field 'hash_id_scope' must be 'local' or 'global', got {scope!r}")
        if "requests" not in doc:
            raise TraceError("field 'requests' is missing")
        p = _Parser(block, id_table)
        p.threads.append(_RawThread(None, None, None, 0, "main", "main"))
        p.entries(doc["requests"], 0, "", 0.0)
        if not p.raws:
            raise TraceError("trace has no requests")
        return _build(p, tid, block, scope, doc.get("models") or (), source)
    except TraceError as e:
        raise e.located(file=source, trace_id=tid) from None
    except RecursionError:
        raise TraceError("subagents nested too deeply", file=source, trace_id=tid) from None


def _build(p: _Parser, tid: str, block: int, scope: str, models: Any, source: str) -> Session:
    order = sorted(range(len(p.raws)), key=lambda i: p.raws[i].t_s)
    pos = [0] * len(order)
    for k, i in enumerate(order):
        pos[i] = k
    deps: list[list[Dep]] = [[] for _ in order]
    threads: list[Thread] = []
    keep = [th for th in p.threads if th.requests and (th.parent is None or th.anchor is not None)]
    renum = {id(th): k for k, th in enumerate(keep)}
    for th in keep:
        for prev, cur in zip(th.requests, th.requests[1:]):
            a, b = p.raws[prev], p.raws[cur]
            deps[pos[cur]].append(Dep("prev", pos[prev], max(0.0, b.t_s - a.t_s - a.api_time_s)))
        join = None
        if th.parent is not None:
            anchor = p.raws[th.anchor]
            first = p.raws[th.requests[0]]
            deps[pos[th.requests[0]]].append(Dep("spawn", pos[th.anchor], max(0.0, first.t_s - anchor.t_s - anchor.api_time_s)))
            parent_reqs = p.threads[th.parent].requests
            for j in parent_reqs[th.after_pos :]:
                if p.raws[j].t_s >= th.end_s - TIME_EPS_S:
                    join = j
                    break
            if join is not None:
                last = p.raws[th.requests[-1]]
                deps[pos[join]].append(Dep("join", pos[th.requests[-1]], max(0.0, p.raws[join].t_s - last.t_s - last.api_time_s)))
        parent = None if th.parent is None else renum[id(p.threads[th.parent])]
        threads.append(
            Thread(
                index=renum[id(th)],
                parent=parent,
                spawn_request=None if th.anchor is None else pos[th.anchor],
                join_request=None if join is None else pos[join],
                requests=tuple(pos[i] for i in th.requests),
                agent_id=th.agent_id,
                agent_type=th.agent_type,
            )
        )
    thread_of = {}
    seq_of = {}
    for th in threads:
        for s, i in enumerate(th.requests):
            thread_of[i] = th.index
            seq_of[i] = s
    blocks = BlockStoreBuilder()
    requests = []
    for k, i in enumerate(order):
        r = p.raws[i]
        blocks.add(-1 if r.ref < 0 else pos[r.ref], r.lcp, r.tail, r.n_blocks, r.prev_lcp)
        requests.append(
            Request(
                index=k,
                thread=thread_of[k],
                seq=seq_of[k],
                t_s=r.t_s,
                in_tokens=r.in_tokens,
                out_tokens=r.out_tokens,
                api_time_s=r.api_time_s,
                think_time_s=r.think_time_s,
                deps=tuple(deps[k]),
                source=r.path,
            )
        )
    return Session(
        id=tid,
        block_tokens=block,
        hash_scope=scope,  # type: ignore[arg-type]
        threads=tuple(threads),
        requests=tuple(requests),
        blocks=blocks.build(),
        models=tuple(str(m) for m in models) if isinstance(models, (list, tuple)) else (),
        source=source,
        dropped_subagents=p.dropped,
    )


def _request_doc(s: Session, i: int) -> dict:
    r = s.requests[i]
    return {
        "t": round(r.t_s, 6),
        "type": "n",
        "in": r.in_tokens,
        "out": r.out_tokens,
        "hash_ids": s.block_ids(i).tolist(),
        "api_time": round(r.api_time_s, 6),
        "think_time": round(r.think_time_s, 6),
    }


def session_to_weka(s: Session) -> dict:
    """The Weka document of a session (inner times absolute; subagents nested at their spawn)."""
    children: dict[int, list[Thread]] = {}
    for th in s.threads[1:]:
        children.setdefault(th.spawn_request, []).append(th)

    def thread_doc(th: Thread) -> list[dict]:
        out = []
        for i in th.requests:
            out.append(_request_doc(s, i))
            for child in children.get(i, []):
                reqs = [s.requests[j] for j in child.requests]
                if child.join_request is not None:
                    end_s = s.requests[child.join_request].t_s  # the join turn is the first at/after it
                else:  # background: ends after every later parent turn starts
                    later = [s.requests[j].t_s for j in th.requests if j > i]
                    end_s = max([q.end_s for q in reqs] + [t + 0.001 for t in later])
                out.append(
                    {
                        "t": round(reqs[0].t_s, 6),
                        "type": "subagent",
                        "agent_id": child.agent_id,
                        "subagent_type": child.agent_type,
                        "status": "completed",
                        "duration_ms": round((end_s - reqs[0].t_s) * 1000.0, 3),
                        "total_tokens": sum(q.in_tokens + q.out_tokens for q in reqs),
                        "requests": thread_doc(child),
                    }
                )
        return out

    return {
        "id": s.id,
        "models": list(s.models),
        "block_size": s.block_tokens,
        "hash_id_scope": s.hash_scope,
        "requests": thread_doc(s.threads[0]),
    }
