"""Workload statistics (``kvpool trace stats``); every key is defined in docs/traces.md.

Contract: ``workload_stats(workload) -> dict[str, float | int]`` with flat keys. Percentiles are
numpy's default (linear interpolation). "Main" is thread 0 of a session, "sub" every other thread.

* Hits under an infinite prefix cache walk the requests in recorded time order with one "seen"
  set of block ids per session (``hash_scope == "local"``) or one for the whole workload
  (``"global"``, e.g. Mooncake); a request's hit is its longest run of leading block ids already
  seen. ``reuse_ceiling`` = sum(hit blocks) / sum(blocks); ``new_tokens`` of a request =
  ``max(0, in - hit blocks * block_tokens)``.
* Pauses are the recorded end-to-start gaps between consecutive main-thread requests
  (``t_k - t_{k-1} - api_time_{k-1}``, floored at 0).
"""

from __future__ import annotations

import numpy as np

from kvpool.workload.model import Session, Workload

PAUSE_CAP_S = 300.0


def _hits(sessions: list[Session]) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """(hit blocks, lcp with previous thread request) per (session k, request index)."""
    hits: dict[tuple[int, int], int] = {}
    lcps: dict[tuple[int, int], int] = {}
    order: list[tuple[float, int, int]] = []
    global_scope = any(s.hash_scope == "global" for s in sessions)
    shared: set[int] = set()
    if global_scope:
        for k, s in enumerate(sessions):
            order.extend((r.t_s, k, r.index) for r in s.requests)
        order.sort()
        groups = [order]
    else:
        groups = [[(0.0, k, r.index) for r in s.requests] for k, s in enumerate(sessions)]
    for group in groups:
        seen = shared if global_scope else set()
        for _, k, i in group:
            st = sessions[k].blocks
            lcp = int(st.lcp[i])
            n = int(st.n_blocks[i])
            off = int(st.off[i])
            tail = st.tail[off : off + n - lcp].tolist()
            h = lcp
            for b in tail:
                if b in seen:
                    h += 1
                else:
                    break
            seen.update(tail)
            hits[(k, i)] = h
            lcps[(k, i)] = int(st.prev_lcp[i])
    return hits, lcps


def _pct(a: list | np.ndarray, q: float) -> float:
    return float(np.percentile(np.asarray(a, dtype=np.float64), q)) if len(a) else float("nan")


def _mean(a) -> float:
    return float(np.mean(a)) if len(a) else float("nan")


def workload_stats(workload: Workload) -> dict[str, float | int]:
    """All statistics of a workload as one flat dict (see docs/traces.md for the keys)."""
    sessions = list(workload.sessions)
    hits, lcps = _hits(sessions)
    in_all, in_main, in_sub, out_main, out_all, new_tokens = [], [], [], [], [], []
    gaps, think, api, peak, turns = [], [], [], [], []
    hit_blocks = total_blocks = 0
    overlap_num = overlap_den = 0
    groups = sessions_with_sub = dropped = 0
    groups_per_sub_session, requests_per_group = [], []
    for k, s in enumerate(sessions):
        b = s.block_tokens
        n_sub = len(s.threads) - 1
        groups += n_sub
        sessions_with_sub += n_sub > 0
        if n_sub:
            groups_per_sub_session.append(n_sub)
            requests_per_group.extend(len(th.requests) for th in s.threads[1:])
        dropped += s.dropped_subagents
        peak.append(s.peak_context_tokens)
        turns.append(len(s.threads[0].requests))
        for r in s.requests:
            h = hits[(k, r.index)]
            n = int(s.blocks.n_blocks[r.index])
            hit_blocks += h
            total_blocks += n
            new_tokens.append(max(0, r.in_tokens - h * b))
            in_all.append(r.in_tokens)
            out_all.append(r.out_tokens)
            if r.api_time_s > 0:
                api.append(r.api_time_s)
            think.append(r.think_time_s)
            if r.thread == 0:
                in_main.append(r.in_tokens)
                out_main.append(r.out_tokens)
                if r.seq > 0:
                    gaps.append(next(d.gap_s for d in r.deps if d.kind == "prev"))
                    overlap_num += lcps[(k, r.index)]
                    overlap_den += n
            else:
                in_sub.append(r.in_tokens)
    gaps_a = np.asarray(gaps, dtype=np.float64)
    return {
        "traces": len(sessions),
        "requests": sum(len(s.requests) for s in sessions),
        "main_requests": len(in_main),
        "subagent_requests": len(in_sub),
        "subagent_groups": groups,
        "sessions_with_subagents": sessions_with_sub,
        "sessions_with_subagents_fraction": sessions_with_sub / len(sessions) if sessions else float("nan"),
        "dropped_subagents": dropped,
        "subagent_groups_per_session_p50": _pct(groups_per_sub_session, 50),
        "subagent_requests_per_group_p50": _pct(requests_per_group, 50),
        "input_tokens_total": int(sum(in_all)),
        "output_tokens_total": int(sum(out_all)),
        "input_tokens_all_p50": _pct(in_all, 50),
        "input_tokens_all_mean": _mean(in_all),
        "input_tokens_main_p50": _pct(in_main, 50),
        "input_tokens_main_p90": _pct(in_main, 90),
        "input_tokens_main_p99": _pct(in_main, 99),
        "input_tokens_sub_p50": _pct(in_sub, 50),
        "input_tokens_sub_p90": _pct(in_sub, 90),
        "input_tokens_max": int(max(in_all, default=0)),
        "output_tokens_main_p50": _pct(out_main, 50),
        "output_tokens_main_mean": _mean(out_main),
        "output_tokens_main_p90": _pct(out_main, 90),
        "new_tokens_p50": _pct(new_tokens, 50),
        "new_tokens_mean": _mean(new_tokens),
        "new_tokens_p99": _pct(new_tokens, 99),
        "main_turns_per_session_p50": _pct(turns, 50),
        "main_turns_per_session_p90": _pct(turns, 90),
        "pause_p50_s": _pct(gaps_a, 50),
        "pause_p90_s": _pct(gaps_a, 90),
        "pause_p99_s": _pct(gaps_a, 99),
        "pause_mean_s": _mean(gaps_a),
        "pause_over_300s_fraction": float(np.mean(gaps_a > PAUSE_CAP_S)) if len(gaps_a) else float("nan"),
        "pause_over_1800s_fraction": float(np.mean(gaps_a > 1800.0)) if len(gaps_a) else float("nan"),
        "think_time_p50_s": _pct(think, 50),
        "api_time_p50_s": _pct(api, 50),
        "peak_context_p50": _pct(peak, 50),
        "peak_context_max": int(max(peak, default=0)),
        "overlap_prev_main": overlap_num / overlap_den if overlap_den else float("nan"),
        "reuse_ceiling": hit_blocks / total_blocks if total_blocks else float("nan"),
    }
