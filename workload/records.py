"""Per-request records and the per-run metrics computed from them (definitions: docs/metrics.md).

One record type and one metrics function for both worlds: the simulator's lifecycle fills a
``RequestRecord`` per request, and so does the backend's store connector (the token, restore and
save fields; the identity and timing fields are for the engine serving the request to fill).
``summarize`` takes plain ``RequestRecord`` values, whoever produced them.

Contract:
    * ``RequestRecord``'s fields keep their order (callers may construct it positionally); a new
      field goes last, with a default.
    * ``summarize(records, gpus=...)`` is a pure function of its arguments: the keys of
      docs/metrics.md's per-run table that a run's records determine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    """What happened to one request (times in seconds since the run started; docs/metrics.md).

    The identity fields (``key`` .. ``out_tokens``) come from the replay; a producer that does not
    know one (the store connector knows the request id and the prompt only) leaves its default.
    ``key`` is the replay's request key in the simulator and the engine's request id in the backend.
    """

    key: int | str
    session: str = ""
    thread: int = 0
    measured: bool = True
    arrival_s: float = 0.0
    in_tokens: int = 0
    out_tokens: int = 0
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
    lookup_answered: bool = True

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


def _counted(records: Sequence[RequestRecord], cutoff_s: float | None = None) -> list[RequestRecord]:
    """The requests every metric is over: measured, admitted, finished (by ``cutoff_s`` if given)."""
    return [r for r in records if r.measured and not r.rejected and r.end_s > 0
            and (cutoff_s is None or r.end_s <= cutoff_s)]


def _span_s(kept: Sequence[RequestRecord]) -> tuple[float, float]:
    """First arrival and last end of ``kept`` (0, 0 when empty)."""
    if not kept:
        return 0.0, 0.0
    return min(r.arrival_s for r in kept), max(r.end_s for r in kept)


def _token_shares(kept: Sequence[RequestRecord], prompt_tokens: int) -> dict:
    """Where the prompt tokens came from, each over Σ prompt tokens (0 without any)."""
    gpu = sum(r.gpu_tokens for r in kept)
    pool = sum(r.pool_tokens + r.ssd_tokens for r in kept)
    computed = sum(r.computed_tokens for r in kept)
    ssd = sum(r.ssd_tokens for r in kept)

    def share(x: int) -> float:
        return x / prompt_tokens if prompt_tokens else 0.0

    return {"share_gpu": share(gpu), "share_pool": share(pool), "share_ssd": share(ssd),
            "share_computed": share(computed), "reuse": share(gpu + pool)}


def _restore_times(kept: Sequence[RequestRecord]) -> dict:
    """Per-rank restore times and spreads over the requests that loaded from the pool."""
    stages = [s for r in kept if r.pool_tokens for s in r.restore_stage_s]
    spreads = [r.restore_spread_s for r in kept if r.pool_tokens]
    return {"restore_stage_s_p50": _pct(stages, 50),
            "restore_spread_s_mean": float(np.mean(spreads)) if spreads else 0.0}


def _occupancy_in(occupancy: tuple[list[float], list[float]],
                  window: tuple[float, float]) -> tuple[list[float], list[float]]:
    """The step function ``occupancy`` restricted to ``window``, its value at the window start included."""
    occ_t, occ_v = occupancy
    if not occ_t:
        return occ_t, occ_v
    before = [v for t, v in zip(occ_t, occ_v) if t <= window[0]]
    inside = [(t, v) for t, v in zip(occ_t, occ_v) if window[0] < t <= window[1]]
    times = [window[0]] + [t for t, _ in inside] if before else [t for t, _ in inside]
    values = ([before[-1]] if before else []) + [v for _, v in inside]
    return times, values


def summarize(records: Sequence[RequestRecord], *, gpus: int, occupancy: tuple[list[float], list[float]] = ([], []),
              window: tuple[float, float] | None = None, cutoff_s: float | None = None) -> dict:
    """Per-run metrics over measured, non-rejected requests (AgentX definitions).

    ``occupancy``: decode KV occupancy as a step function (times, values); its median is taken
    over ``window`` (default: first arrival to last end of the measured requests).
    ``cutoff_s``: requests still running then are left out, as AIPerf leaves out the responses
    still pending when its grace period after the benchmark duration expires."""
    kept = _counted(records, cutoff_s)
    prompt = sum(r.in_tokens for r in kept)
    out = sum(r.out_tokens for r in kept)
    start, end = _span_s(kept)
    span = end - start
    tput = (prompt + out) / span if span > 0 else 0.0
    speeds = [r.out_tokens / (r.end_s - r.first_token_s) for r in kept if r.out_tokens > 1 and r.end_s > r.first_token_s]
    if window is None:
        window = (start, end)
    occ_t, occ_v = _occupancy_in(occupancy, window)
    return {
        "gpus": gpus,
        "requests": len(kept),
        "rejected": sum(1 for r in records if r.measured and r.rejected),
        "throughput_tok_s": tput,
        "throughput_per_gpu_tok_s": tput / gpus if gpus else 0.0,
        "ttft_p50_s": _pct([r.ttft_s for r in kept], 50),
        "ttft_p90_s": _pct([r.ttft_s for r in kept], 90),
        **_token_shares(kept, prompt),
        "gen_speed_per_user_tok_s_p50": _pct(speeds, 50),
        "decode_kv_occupancy_p50": weighted_median(occ_t, occ_v, window[1]),
        **_restore_times(kept),
        "bytes_moved": int(sum(r.restore_bytes + r.save_bytes + r.handoff_bytes for r in kept)),
        "prompt_tokens": prompt,
        "output_tokens": out,
        "window_s": span,
    }
