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
    * ``lane_time(records, window)`` splits every lane's time in ``window`` over ``LANE_PHASES``
      (docs/metrics.md, "Lane time"); the shares sum to 1.
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
    The phase stamps (``gate_arrival_s`` .. ``hung_from_s``) are -1 until the request reaches that
    phase, and stay -1 where the producer does not stamp them.
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
    lane: int = -1
    gate_arrival_s: float = -1.0
    admitted_s: float = -1.0
    compute_queued_s: float = -1.0
    compute_start_s: float = -1.0
    decode_start_s: float = -1.0
    hung_from_s: float = -1.0
    error: str = ""
    save_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ttft_s"] = self.ttft_s
        return d


#: Where a lane's time goes (``lane_time``), in the order a request passes them; ``recorded_wait``
#: is a lane with nothing in flight, ``unstamped`` a request whose producer stamps no phases.
LANE_PHASES = ("recorded_wait", "front_end", "gate", "control_plane", "restore", "prefill_queue",
               "prefill_compute", "handoff", "decode", "hung", "unstamped")

#: Keys of one load's summary (``kvpool sim run --json``), documented in docs/metrics.md.
SUMMARY_KEYS = (
    "sessions", "rps", "duration_s", "gpus", "requests", "rejected", "throughput_tok_s", "throughput_per_gpu_tok_s",
    "ttft_p50_s", "ttft_p90_s", "share_gpu", "share_pool", "share_ssd", "share_computed", "reuse",
    "gen_speed_per_user_tok_s_p50", "decode_kv_occupancy_p50", "restore_stage_s_p50",
    "restore_spread_s_mean", "bytes_moved", "errors", "censored", "lane_s",
    *(f"lane_share_{p}" for p in LANE_PHASES), "wall_s",
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
    """The requests every metric is over: measured, admitted, finished without error (by
    ``cutoff_s`` if given)."""
    return [r for r in records if r.measured and not r.rejected and not r.error and r.end_s > 0
            and (cutoff_s is None or r.end_s <= cutoff_s)]


def _errors_censored(records: Sequence[RequestRecord], cutoff_s: float | None) -> tuple[int, int]:
    """Measured requests that failed by ``cutoff_s``, and measured admitted ones still in flight then."""
    errors = censored = 0
    for r in records:
        if not r.measured or r.rejected:
            continue
        if cutoff_s is not None and r.end_s > cutoff_s:
            censored += 1
        elif r.error:
            errors += 1
    return errors, censored


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


def request_phases(r: RequestRecord) -> list[tuple[str, float, float]]:
    """``r``'s phases as (phase, start, end), in order, from its arrival to its end (none when it
    has not ended). Each stamped phase lasts until the next stamped one (or the end); a hung
    request is ``hung`` from ``hung_from_s``. Without stamps, the request is one ``unstamped`` span."""
    end = r.end_s
    if end <= 0 or end < r.arrival_s:
        return []
    if r.gate_arrival_s < 0:
        return [("unstamped", r.arrival_s, end)]
    marks = [("front_end", r.arrival_s), ("gate", r.gate_arrival_s)]
    if r.admitted_s >= 0:
        marks.append(("control_plane", r.admitted_s))
        if r.prefill_start_s > 0:
            marks.append(("restore", r.prefill_start_s))
        for phase, t in (("prefill_queue", r.compute_queued_s), ("prefill_compute", r.compute_start_s)):
            if t >= 0:
                marks.append((phase, t))
        if r.compute_start_s >= 0 and r.prefill_end_s > 0:
            marks.append(("handoff", r.prefill_end_s))
        if r.decode_start_s >= 0:
            marks.append(("decode", r.decode_start_s))
    stop = r.hung_from_s if r.hung_from_s >= 0 else end
    out = []
    for i, (phase, t) in enumerate(marks):
        if t >= stop:
            break
        nxt = marks[i + 1][1] if i + 1 < len(marks) else stop
        out.append((phase, t, min(nxt, stop)))
    if r.hung_from_s >= 0:
        out.append(("hung", r.hung_from_s, end))
    return out


def lane_time(records: Sequence[RequestRecord], window: tuple[float, float]) -> tuple[float, dict[str, float]]:
    """(lane-seconds, share per ``LANE_PHASES``) of every lane over ``window``.

    A lane is a record's ``lane`` (its ``session`` where the producer gives no lane); every lane
    that sent any request counts for the whole window. At each moment a lane's time goes in
    equal parts to the phases of its requests in flight then (parallel subagents share it), and to
    ``recorded_wait`` when it has none. Every request counts, measured or not, rejected or failed:
    the lane spent that time. The shares sum to 1 (all 0 when the window or the lanes are empty)."""
    w0, w1 = window
    acc = dict.fromkeys(LANE_PHASES, 0.0)
    spans: dict[object, list[tuple[float, int, str]]] = {}
    for r in records:
        lane = spans.setdefault(r.lane if r.lane >= 0 else r.session, [])
        for phase, a, b in request_phases(r):
            a, b = max(a, w0), min(b, w1)
            if b > a:
                lane.append((a, 1, phase))
                lane.append((b, -1, phase))
    span = max(0.0, w1 - w0)
    total = span * len(spans)
    if total <= 0:
        return 0.0, {p: 0.0 for p in LANE_PHASES}
    for events in spans.values():
        events.sort(key=lambda e: (e[0], e[1]))  # at one moment, ends before starts
        active: dict[str, int] = {}
        n = 0
        t_prev = w0
        for t, step, phase in events:
            dt = t - t_prev
            if dt > 0:
                if n:
                    for p, c in active.items():
                        if c:
                            acc[p] += dt * c / n
                else:
                    acc["recorded_wait"] += dt
            t_prev = t
            active[phase] = active.get(phase, 0) + step
            n += step
        acc["recorded_wait"] += w1 - t_prev
    return total, {p: acc[p] / total for p in LANE_PHASES}


def summarize(records: Sequence[RequestRecord], *, gpus: int, occupancy: tuple[list[float], list[float]] = ([], []),
              window: tuple[float, float] | None = None, cutoff_s: float | None = None,
              lane_window: tuple[float, float] | None = None) -> dict:
    """Per-run metrics over measured, non-rejected requests that did not fail (AgentX definitions).

    ``occupancy``: decode KV occupancy as a step function (times, values); its median is taken
    over ``window`` (default: first arrival to last end of the measured requests).
    ``cutoff_s``: requests still running then are left out (``censored``), as AIPerf leaves out the
    responses still pending when its grace period after the benchmark duration expires.
    ``lane_window``: the window of the lane-time breakdown (``lane_time``; default: first arrival to
    last end of the measured requests)."""
    kept = _counted(records, cutoff_s)
    errors, censored = _errors_censored(records, cutoff_s)
    prompt = sum(r.in_tokens for r in kept)
    out = sum(r.out_tokens for r in kept)
    start, end = _span_s(kept)
    span = end - start
    tput = (prompt + out) / span if span > 0 else 0.0
    speeds = [r.out_tokens / (r.end_s - r.first_token_s) for r in kept if r.out_tokens > 1 and r.end_s > r.first_token_s]
    if window is None:
        window = (start, end)
    occ_t, occ_v = _occupancy_in(occupancy, window)
    if lane_window is None:
        measured = [r for r in records if r.measured]
        lane_window = _span_s(measured) if measured else (0.0, 0.0)
    lane_s, lane_shares = lane_time(records, lane_window)
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
        "errors": errors,
        "censored": censored,
        "lane_s": lane_s,
        **{f"lane_share_{p}": v for p, v in lane_shares.items()},
        "prompt_tokens": prompt,
        "output_tokens": out,
        "window_s": span,
    }
