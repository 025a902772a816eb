"""Per-request records and the per-run metrics computed from them (definitions: docs/metrics.md).

One definition for the simulator and the backend's production mode: ``summarize`` takes plain
``RequestRecord`` values, whoever produced them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """What happened to one request (times in seconds since the run started)."""

    key: int
    session: str
    thread: int
    measured: bool
    arrival_s: float
    in_tokens: int
    out_tokens: int
    prefill: int = -1
    decode: int = -1
    gpu_tokens: int = 0
    pool_tokens: int = 0
    ssd_tokens: int = 0
    computed_tokens: int = 0
    restore_stage_s: list[float] = field(default_factory=list)
    restore_spread_s: float = 0.0
    restore_failed: bool = False
    prefill_start_s: float = 0.0
    prefill_end_s: float = 0.0
    handoff_s: float = 0.0
    first_token_s: float = 0.0
    end_s: float = 0.0
    restore_bytes: int = 0
    save_bytes: int = 0
    handoff_bytes: int = 0
    handoff_writes: int = 0
    rejected: str = ""

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ttft_s"] = self.ttft_s
        return d


#: Keys of one load's summary (``kvpool sim run --json``), documented in docs/metrics.md.
SUMMARY_KEYS = (
    "sessions", "rps", "duration_s", "gpus", "requests", "rejected", "throughput_tok_s", "throughput_per_gpu_tok_s",
    "ttft_p50_s", "ttft_p90_s", "share_gpu", "share_pool", "share_ssd", "share_computed", "reuse",
    "gen_speed_per_user_tok_s_p50", "decode_kv_occupancy_p50", "restore_stage_s_p50",
    "restore_spread_s_mean", "bytes_moved", "wall_s",
)


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else 0.0


def weighted_median(times_s: Sequence[float], values: Sequence[float], end_s: float) -> float:
    """Median of a step function ``values[i]`` holding from ``times_s[i]`` to the next time (or ``end_s``)."""
    if not len(times_s):
        return 0.0
    t = np.asarray(times_s, dtype=float)
    v = np.asarray(values, dtype=float)
    dur = np.diff(np.append(t, max(end_s, t[-1])))
    if dur.sum() <= 0:
        return float(v[-1])
    order = np.argsort(v, kind="stable")
    cum = np.cumsum(dur[order])
    return float(v[order][np.searchsorted(cum, cum[-1] / 2)])


def summarize(records: Sequence[RequestRecord], *, gpus: int, occupancy: tuple[list[float], list[float]] = ([], []),
              window: tuple[float, float] | None = None, cutoff_s: float | None = None) -> dict:
    """Per-run metrics over measured, non-rejected requests (AgentX definitions).

    ``occupancy``: decode KV occupancy as a step function (times, values); its median is taken
    over ``window`` (default: first arrival to last end of the measured requests).
    ``cutoff_s``: requests still running then are left out, as AIPerf leaves out the responses
    still pending when its grace period after the benchmark duration expires."""
    kept = [r for r in records if r.measured and not r.rejected and r.end_s > 0
            and (cutoff_s is None or r.end_s <= cutoff_s)]
    prompt = sum(r.in_tokens for r in kept)
    out = sum(r.out_tokens for r in kept)
    if kept:
        start = min(r.arrival_s for r in kept)
        end = max(r.end_s for r in kept)
    else:
        start = end = 0.0
    span = end - start
    tput = (prompt + out) / span if span > 0 else 0.0
    gpu = sum(r.gpu_tokens for r in kept)
    pool = sum(r.pool_tokens + r.ssd_tokens for r in kept)
    comp = sum(r.computed_tokens for r in kept)
    share = (lambda x: x / prompt if prompt else 0.0)
    speeds = [r.out_tokens / (r.end_s - r.first_token_s) for r in kept if r.out_tokens > 1 and r.end_s > r.first_token_s]
    stages = [s for r in kept if r.pool_tokens for s in r.restore_stage_s]
    spreads = [r.restore_spread_s for r in kept if r.pool_tokens]
    occ_t, occ_v = occupancy
    if window is None:
        window = (start, end)
    if occ_t:
        # the step function restricted to the window (its value at the window start included)
        before = [v for t, v in zip(occ_t, occ_v) if t <= window[0]]
        inside = [(t, v) for t, v in zip(occ_t, occ_v) if window[0] < t <= window[1]]
        occ_t = [window[0]] + [t for t, _ in inside] if before else [t for t, _ in inside]
        occ_v = ([before[-1]] if before else []) + [v for _, v in inside]
    return {
        "gpus": gpus,
        "requests": len(kept),
        "rejected": sum(1 for r in records if r.measured and r.rejected),
        "throughput_tok_s": tput,
        "throughput_per_gpu_tok_s": tput / gpus if gpus else 0.0,
        "ttft_p50_s": _pct([r.ttft_s for r in kept], 50),
        "ttft_p90_s": _pct([r.ttft_s for r in kept], 90),
        "share_gpu": share(gpu),
        "share_pool": share(pool),
        "share_ssd": share(sum(r.ssd_tokens for r in kept)),
        "share_computed": share(comp),
        "reuse": share(gpu + pool),
        "gen_speed_per_user_tok_s_p50": _pct(speeds, 50),
        "decode_kv_occupancy_p50": weighted_median(occ_t, occ_v, window[1]),
        "restore_stage_s_p50": _pct(stages, 50),
        "restore_spread_s_mean": float(np.mean(spreads)) if spreads else 0.0,
        "bytes_moved": int(sum(r.restore_bytes + r.save_bytes + r.handoff_bytes for r in kept)),
        "prompt_tokens": prompt,
        "output_tokens": out,
        "window_s": span,
    }
