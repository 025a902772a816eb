"""Synthetic agent sessions in the Weka format, from fitted presets.

Contract:
    * ``generate_session(params, seed=S, index=k) -> dict`` returns one Weka trace document
      (``id = "synth-{preset}-{S}-{k:05d}"``, 64-token blocks, local ids, spawn-relative inner
      times like kv-cache-tester). The same (params, seed, index) always gives the same document;
      sessions are independent, so N sessions can be generated in any order or in parallel.
    * ``generate_records`` is the light form (no block ids) used by the fitting loop;
      ``records_stats`` computes the calibration statistics from it with the definitions of
      :mod:`kvpool.workload.stats`.
    * Presets: ``preset_params(name)`` for a name in ``kvpool.workload.presets.PRESETS``; their
      numbers are package data (:mod:`kvpool.workload.presets`), written by
      :mod:`kvpool.workload.fit`.

The session model (docs/traces.md, "Synthetic sessions"):
    * A main thread of ``turns`` requests. The first has ``init_tokens`` of input. Each later turn
      resends the previous prompt plus the previous output plus ``add_tokens`` (tool results,
      user text), after an end-to-start pause from ``gap_main_s``.
    * History rewrites: with probability ``break_p_short`` (pause <= 300 s) or ``break_p_long``
      (longer pause) only a leading fraction ``keep_frac`` of the previous prompt still matches
      (often just the system and tool prefix) - like the seed's session ebaea288, where after an
      87-minute pause only the first 32,704 of 147,904 tokens matched. A share
      ``compact_share`` of rewrites also shrinks the context to ``compact_tokens`` (compaction);
      so does a prompt that would pass the session's context limit: ``max_context_tokens``
      with probability ``big_context_p`` (1M-token models), else ``context_limit_tokens``.
    * Subagents: a session has them with probability ``sub_session_p``; it gets ``sub_groups``
      subagents (threads), spawned from random main turns in parallel fan-outs of
      ``Geometric`` size (mean ``sub_fanout_mean``). A child runs ``sub_requests`` requests growing like the main
      thread (``sub_init_tokens``, ``sub_add_tokens``, ``gap_sub_s``); all children of a session
      share a ``sub_prefix_tokens`` prompt prefix. The next main turn waits for the children
      (join); children spawned by the last turn run in the background.
    * Server time ``api_base_s + api_per_100k_in_s * in/1e5 + api_per_1k_out_s * out/1e3``.
    * Session-level draws (turns, first input, whether it has subagents, context limit) use
      ``session_draws``: a low-discrepancy (R4) sequence over the session index, so any N
      consecutive sessions follow the preset's distributions closely (far less seed-to-seed
      spread of the request-weighted medians than independent draws).
"""

from __future__ import annotations

from collections.abc import Callable

import gzip
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from kvpool.workload.model import Session, Workload
from kvpool.workload.presets import preset_fields
from kvpool.workload.weka import session_from_weka, session_to_weka

BLOCK_TOKENS = 64
LONG_PAUSE_S = 300.0


@dataclass(frozen=True)
class QTable:
    """A distribution as an inverse-CDF table: ``values[i]`` is the ``probs[i]`` quantile.

    Sampling interpolates linearly in probability and log-linearly in value (values > 0), so a
    table of a few quantiles reproduces medians exactly and keeps heavy tails.
    """

    probs: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.probs) != len(self.values) or len(self.probs) < 2:
            raise ValueError("QTable needs matching probs/values, at least 2")
        if self.probs[0] != 0.0 or self.probs[-1] != 1.0 or list(self.probs) != sorted(self.probs):
            raise ValueError("QTable probs must rise from 0 to 1")
        if min(self.values) <= 0 or list(self.values) != sorted(self.values):
            raise ValueError("QTable values must be positive and non-decreasing")

    def ppf(self, u: np.ndarray | float) -> np.ndarray:
        return np.exp(np.interp(u, self.probs, np.log(self.values)))

    def sample(self, rng: np.random.Generator, n: int | None = None) -> np.ndarray | float:
        u = rng.random(n)
        return self.ppf(u) if n is not None else float(self.ppf(u))

    def scaled(self, k: float) -> QTable:
        return QTable(self.probs, tuple(v * k for v in self.values))


@dataclass(frozen=True)
class SynthParams:
    """All numbers of a preset (see the module docstring for the model)."""

    name: str
    turns: QTable
    init_tokens: QTable
    add_tokens: QTable
    out_main: QTable
    gap_main_s: QTable
    break_p_short: float
    break_p_long: float
    compact_share: float
    keep_frac: QTable
    compact_tokens: QTable
    max_context_tokens: int
    big_context_p: float
    context_limit_tokens: QTable
    api_base_s: float
    api_per_100k_in_s: float
    api_per_1k_out_s: float
    sub_session_p: float
    sub_groups: QTable
    sub_fanout_mean: float
    sub_requests: QTable
    sub_init_tokens: QTable
    sub_add_tokens: QTable
    out_sub: QTable
    gap_sub_s: QTable
    sub_prefix_tokens: int
    models: tuple[str, ...] = field(default=("claude-opus-4-5",))

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> SynthParams:
        kw = {}
        for k, v in d.items():
            if isinstance(v, dict) and set(v) == {"probs", "values"}:
                kw[k] = QTable(tuple(v["probs"]), tuple(v["values"]))
            elif isinstance(v, list):
                kw[k] = tuple(v)
            else:
                kw[k] = v
        return SynthParams(**kw)

    def with_(self, **kw) -> SynthParams:
        return replace(self, **kw)

    def with_context_scale(self, k: float) -> SynthParams:
        """The same sessions with every prompt-side token count times ``k`` (first prompts,
        growth per turn, compaction targets, context limits, subagent prompts and their shared
        prefix); outputs, turns and timing are unchanged. ``k = 1`` returns ``self``."""
        if k <= 0:
            raise ValueError(f"context scale must be > 0, got {k}")
        if k == 1:
            return self
        return replace(self, **{f: getattr(self, f).scaled(k) for f in CONTEXT_FIELDS},
                       sub_prefix_tokens=round(self.sub_prefix_tokens * k),
                       max_context_tokens=round(self.max_context_tokens * k))


#: The prompt-side token distributions of a preset (what ``with_context_scale`` scales).
CONTEXT_FIELDS = ("init_tokens", "add_tokens", "compact_tokens", "context_limit_tokens", "sub_init_tokens", "sub_add_tokens")


# -- light records ----------------------------------------------------------------------------
@dataclass
class Rec:
    """One generated request before block ids: ``keep`` blocks shared with its thread's previous
    request (or, for a child's first request, with the session's subagent prefix)."""

    thread: int
    t_s: float
    in_tokens: int
    out_tokens: int
    api_s: float
    keep: int
    gap_s: float


@dataclass
class SessionRecords:
    main: list[Rec]
    # (anchor main turn, spawn time, children: list of request lists)
    groups: list[tuple[int, float, list[list[Rec]]]]
    sub_prefix_blocks: int


def _api(p: SynthParams, n_in: int, n_out: int, rng: np.random.Generator) -> float:
    base = p.api_base_s + p.api_per_100k_in_s * n_in / 1e5 + p.api_per_1k_out_s * n_out / 1e3
    return round(float(base * rng.lognormal(0.0, 0.25)), 3)


def _grow(
    p: SynthParams, prev_in: int, prev_out: int, add: int, gap_s: float, limit: int, rng: np.random.Generator
) -> tuple[int, int]:
    """(next input tokens, tokens still matching the previous prompt) for one main turn."""
    pb = p.break_p_long if gap_s > LONG_PAUSE_S else p.break_p_short
    nxt = prev_in + prev_out + add
    keep = prev_in
    compact = nxt > limit
    if rng.random() < pb:
        keep = int(prev_in * min(1.0, p.keep_frac.sample(rng)))
        compact = compact or rng.random() < p.compact_share
    if compact:
        nxt = int(p.compact_tokens.sample(rng))
        keep = min(int(prev_in * min(1.0, p.keep_frac.sample(rng))), nxt // 2)
    return nxt, keep


#: Additive recurrence of Roberts' R4 sequence (g solves g**5 = g + 1), dimensions ordered so
#: that the turns get the step closest to the golden ratio: consecutive session indices get
#: well-spread session-level draws, jointly and one by one, so any N sessions match the preset
#: closely.
_R_G = 1.1673039782614187
_R_ALPHA = np.array([1.0 / _R_G ** (j + 1) for j in (2, 3, 1, 0)])


def session_draws(seed: int, index: int) -> np.ndarray:
    """The four stratified uniforms of session ``index`` (turns, first input, subagents, context)."""
    offset = np.random.default_rng([seed, 0x5E55]).random(4)
    return (offset + index * _R_ALPHA) % 1.0


def generate_records(p: SynthParams, rng: np.random.Generator, u: np.ndarray | None = None) -> SessionRecords:
    """One session's requests without block ids (see the module docstring).

    ``u``: the session's stratified uniforms (``session_draws``); drawn from ``rng`` if None.
    """
    if u is None:
        u = rng.random(4)
    n_turns = max(1, int(round(float(p.turns.ppf(u[0])))))
    outs = np.maximum(1, np.round(p.out_main.sample(rng, n_turns))).astype(int)
    adds = np.maximum(1, np.round(p.add_tokens.sample(rng, n_turns))).astype(int)
    gaps = p.gap_main_s.sample(rng, n_turns)
    # subagent spawn points first: joins push the next main turn later
    groups_at: dict[int, list[int]] = {}  # main turn -> sizes of the fan-outs it spawns
    if n_turns > 1 and u[2] < p.sub_session_p:
        # u[2] / p is again uniform and stratified: it sets how many subagents
        left = max(1, int(round(float(p.sub_groups.ppf(u[2] / p.sub_session_p)))))
        while left > 0:
            fan = min(left, int(rng.geometric(1.0 / max(1.0, p.sub_fanout_mean))))
            groups_at.setdefault(int(rng.integers(0, n_turns)), []).append(fan)
            left -= fan
    sub_prefix = int(p.sub_prefix_tokens)
    main: list[Rec] = []
    groups: list[tuple[int, float, list[list[Rec]]]] = []
    t = 0.0
    join_t = 0.0
    limit = p.max_context_tokens
    if u[3] >= p.big_context_p:
        v = (u[3] - p.big_context_p) / (1.0 - p.big_context_p)
        limit = min(limit, int(float(p.context_limit_tokens.ppf(v))))
    n_in = min(limit, max(BLOCK_TOKENS, int(float(p.init_tokens.ppf(u[1])))))
    keep = 0
    for k in range(n_turns):
        if k > 0:
            gap = float(gaps[k])
            n_in, keep = _grow(p, main[-1].in_tokens, int(outs[k - 1]), int(adds[k]), gap, limit, rng)
            t = max(t + gap, join_t)
            gap = t - main[-1].t_s - main[-1].api_s
        else:
            gap = 0.0
        api = _api(p, n_in, int(outs[k]), rng)
        main.append(Rec(0, round(t, 3), int(n_in), int(outs[k]), api, keep // BLOCK_TOKENS, round(gap, 3)))
        t = main[-1].t_s + api
        join_t = 0.0
        for fan in groups_at.get(k, []):
            spawn = round(t + float(rng.uniform(0.05, 1.0)), 3)
            children = []
            for _c in range(fan):
                children.append(_child(p, spawn, sub_prefix, rng))
            groups.append((k, spawn, children))
            ends = [c[-1].t_s + c[-1].api_s for c in children]
            join_t = max(join_t, max(ends) + float(rng.uniform(0.05, 2.0)))
    return SessionRecords(main, groups, sub_prefix // BLOCK_TOKENS)


def _child(p: SynthParams, spawn_s: float, sub_prefix: int, rng: np.random.Generator) -> list[Rec]:
    n = max(1, int(round(p.sub_requests.sample(rng))))
    out = []
    t = spawn_s
    n_in = max(sub_prefix + BLOCK_TOKENS, int(p.sub_init_tokens.sample(rng)))
    keep = sub_prefix
    for j in range(n):
        gap = 0.0
        if j > 0:
            gap = float(p.gap_sub_s.sample(rng))
            prev = out[-1]
            n_in = prev.in_tokens + prev.out_tokens + max(1, int(p.sub_add_tokens.sample(rng)))
            keep = prev.in_tokens
            t = prev.t_s + prev.api_s + gap
        n_out = max(1, int(round(p.out_sub.sample(rng))))
        api = _api(p, n_in, n_out, rng)
        out.append(Rec(1, round(t, 3), int(n_in), n_out, api, keep // BLOCK_TOKENS, round(gap, 3)))
    return out


# -- Weka documents ---------------------------------------------------------------------------
def _session_rng(seed: int, index: int, name: str) -> np.random.Generator:
    tag = int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little")
    return np.random.default_rng([seed, index, tag])


def _request(r: Rec, ids: list[int], model: str) -> dict:
    return {
        "t": r.t_s, "type": "n", "model": model, "in": r.in_tokens, "out": r.out_tokens,
        "hash_ids": ids, "api_time": r.api_s, "think_time": r.gap_s,
    }


def records_to_weka(rec: SessionRecords, trace_id: str, models: tuple[str, ...], *, arrays: bool = False) -> dict:
    """The Weka document of generated records (block ids assigned in first-use order).

    ``arrays``: each request's ``hash_ids`` is an int64 numpy array rather than a list (the same
    ids; ``session_from_weka`` takes it as it is, so an in-memory workload skips building and
    checking millions of Python ints). A document for a file keeps lists (JSON)."""
    nxt = 0

    def fresh(n: int):
        nonlocal nxt
        out = np.arange(nxt, nxt + n, dtype=np.int64) if arrays else list(range(nxt, nxt + n))
        nxt += n
        return out

    def cat(head, tail):
        return np.concatenate((head, tail)) if arrays else head + tail

    model = models[0]
    by_anchor: dict[int, list[tuple[float, list[list[Rec]]]]] = {}
    for a, spawn, children in rec.groups:
        by_anchor.setdefault(a, []).append((spawn, children))
    sub_prefix_ids = None
    entries: list[dict] = []
    ids = fresh(0)
    n_agents = 0
    for k, r in enumerate(rec.main):
        n_blocks = r.in_tokens // BLOCK_TOKENS
        ids = ids[: min(r.keep, n_blocks)]
        ids = cat(ids, fresh(n_blocks - len(ids)))
        entries.append(_request(r, ids, model))
        for spawn, children in by_anchor.get(k, []):
            for child in children:
                if sub_prefix_ids is None:
                    sub_prefix_ids = fresh(rec.sub_prefix_blocks)
                inner = []
                cids = fresh(0)
                for j, q in enumerate(child):
                    nb = q.in_tokens // BLOCK_TOKENS
                    cids = sub_prefix_ids[: min(q.keep, nb)] if j == 0 else cids[: min(q.keep, nb)]
                    cids = cat(cids, fresh(nb - len(cids)))
                    d = _request(q, cids, models[-1])
                    d["t"] = round(q.t_s - spawn, 3)
                    inner.append(d)
                n_agents += 1
                end = child[-1].t_s + child[-1].api_s
                entries.append({
                    "t": spawn, "type": "subagent", "agent_id": f"agent_{n_agents:03d}", "subagent_type": "Explore",
                    "status": "completed", "duration_ms": round((end - spawn) * 1000.0, 1),
                    "total_tokens": sum(q.in_tokens + q.out_tokens for q in child), "requests": inner,
                })
    return {"id": trace_id, "models": list(models), "block_size": BLOCK_TOKENS, "hash_id_scope": "local", "requests": entries}


def generate_session(p: SynthParams, *, seed: int, index: int, arrays: bool = False) -> dict:
    """Session ``index`` of preset ``p`` under ``seed``, as a Weka trace document (``arrays``: see
    ``records_to_weka``)."""
    rng = _session_rng(seed, index, p.name)
    rec = generate_records(p, rng, session_draws(seed, index))
    return records_to_weka(rec, f"synth-{p.name}-{seed}-{index:05d}", p.models, arrays=arrays)


def write_weka_dir(docs, out: str | Path) -> int:
    """Write documents (or Sessions) as ``<id>.json.gz`` files in directory ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for d in docs:
        if isinstance(d, Session):
            d = session_to_weka(d)
        (out / f"{d['id']}.json.gz").write_bytes(gzip.compress(json.dumps(d, separators=(",", ":")).encode(), 1))
        n += 1
    return n


def synthetic_workload(preset: str, sessions: int, seed: int, *, context_scale: float = 1.0,
                       on_session: Callable[[int], None] | None = None) -> Workload:
    """A :class:`Workload` of ``sessions`` synthetic sessions, in memory (no file);
    ``context_scale``: see ``SynthParams.with_context_scale``; ``on_session(k)`` after session ``k``
    is made (progress)."""
    p = preset_params(preset).with_context_scale(context_scale)
    out = []
    for k in range(sessions):
        out.append(session_from_weka(generate_session(p, seed=seed, index=k, arrays=True), source=f"synth:{preset}"))
        if on_session is not None:
            on_session(k)
    return Workload(tuple(out))


# -- light statistics (for fitting) -----------------------------------------------------------
def records_stats(recs: list[SessionRecords]) -> dict[str, float]:
    """The calibration statistics of generated records (definitions of ``workload_stats``)."""
    in_all, in_main, in_sub, out_main, new, gaps, turns, peak = [], [], [], [], [], [], [], []
    hit = tot = 0
    with_sub = 0
    groups_per, reqs_per = [], []
    for rec in recs:
        turns.append(len(rec.main))
        with_sub += bool(rec.groups)
        if rec.groups:
            groups_per.append(sum(len(ch) for _a, _s, ch in rec.groups))
            reqs_per.extend(len(c) for _a, _s, ch in rec.groups for c in ch)
        pk = 0
        for k, r in enumerate(rec.main):
            nb = r.in_tokens // BLOCK_TOKENS
            h = min(r.keep, nb) if k else 0
            hit += h
            tot += nb
            new.append(max(0, r.in_tokens - h * BLOCK_TOKENS))
            in_all.append(r.in_tokens)
            in_main.append(r.in_tokens)
            out_main.append(r.out_tokens)
            pk = max(pk, r.in_tokens + r.out_tokens)
            if k:
                gaps.append(r.gap_s)
        first_child = True
        for _a, _s, children in rec.groups:
            for child in children:
                for j, q in enumerate(child):
                    nb = q.in_tokens // BLOCK_TOKENS
                    h = min(q.keep, nb) if (j or not first_child) else 0
                    hit += h
                    tot += nb
                    new.append(max(0, q.in_tokens - h * BLOCK_TOKENS))
                    in_all.append(q.in_tokens)
                    in_sub.append(q.in_tokens)
                    pk = max(pk, q.in_tokens + q.out_tokens)
                first_child = False
        peak.append(pk)
    g = np.asarray(gaps)
    med = lambda a: float(np.median(a)) if len(a) else float("nan")  # noqa: E731
    return {
        "input_tokens_all_p50": med(in_all),
        "input_tokens_main_p50": med(in_main),
        "input_tokens_main_p90": float(np.percentile(in_main, 90)),
        "input_tokens_sub_p50": med(in_sub),
        "input_tokens_sub_p90": float(np.percentile(in_sub, 90)) if in_sub else float("nan"),
        "output_tokens_main_p50": med(out_main),
        "new_tokens_p50": med(new),
        "main_turns_per_session_p50": med(turns),
        "main_turns_per_session_p90": float(np.percentile(turns, 90)),
        "peak_context_p50": med(peak),
        "pause_p50_s": med(g),
        "pause_p90_s": float(np.percentile(g, 90)) if len(g) else float("nan"),
        "pause_over_300s_fraction": float(np.mean(g > 300)) if len(g) else float("nan"),
        "sessions_with_subagents_fraction": with_sub / len(recs),
        "subagent_request_fraction": len(in_sub) / len(in_all),
        "subagent_groups_per_session_p50": med(groups_per),
        "subagent_requests_per_group_p50": med(reqs_per),
        "reuse_ceiling": hit / tot if tot else float("nan"),
    }


def preset_params(name: str) -> SynthParams:
    """The fitted parameters of preset ``name`` (KeyError lists the presets)."""
    return SynthParams.from_dict(preset_fields(name))
