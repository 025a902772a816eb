"""Simulator results as tables for the dashboard (pure pandas; no Streamlit here).

Contract:
    * ``summary_frame(rows)``: one row per load with the documented keys of ``kvpool.sim.report.public``
      (docs/metrics.md) - the same values ``kvpool sim run --json`` prints.
    * ``timeline_frame`` (pool) / ``decode_frame`` (decode KV) / ``restore_frame``: long frames of the
      time series and samples a result carries (``run_point``'s ``timeline`` and ``restore_stage_s``),
      for the charts.
    * ``compare_frame(runs)`` and ``ratio_frame(runs, baseline)``: several scenarios side by side,
      and each one's metrics over the baseline's at the same load.
    * ``to_csv`` / ``to_json``: the downloads, the same keys as the CLI's files;
      ``compare_json(arms)``: what ``kvpool sim compare --json`` prints (``{scenario name: [per-load objects]}``).
    * ``plan_summary(result)``: the object ``kvpool sim plan --json`` prints (variable, direction, targets,
      best, runs, curve) from a ``kvpool.sim.plan.PlanResult``; ``plan_json`` its text; ``plan_frame`` the
      curve as a table; ``plan_bracket`` the values either side of the threshold.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pandas as pd

from kvpool.sim.report import load_of, public

# Metrics whose ratio the Compare page shows (higher is better unless noted in the label).
RATIO_METRICS: tuple[tuple[str, str], ...] = (
    ("throughput_per_gpu_tok_s", "throughput per GPU"),
    ("ttft_p50_s", "TTFT p50 (lower is better)"),
    ("ttft_p90_s", "TTFT p90 (lower is better)"),
    ("reuse", "reuse"),
    ("share_pool", "pool share"),
    ("gen_speed_per_user_tok_s_p50", "tok/s per user"),
)

# Keys that measure the machine that ran the simulation, not the simulated system.
WALL_CLOCK_KEYS = ("wall_s", "cpu_s", "sim_s_per_wall_s")


def load_name(rows: Sequence[dict]) -> str:
    """``sessions`` or ``rps``."""
    return load_of(rows[0])[0] if rows else "load"


def summary_frame(rows: Sequence[dict]) -> pd.DataFrame:
    """One row per load: the documented keys, load first."""
    key = load_name(rows)
    frame = pd.DataFrame([public(r) for r in rows])
    if key in frame:
        frame = frame[[key] + [c for c in frame.columns if c != key]]
    return frame


def to_json(rows: Sequence[dict]) -> str:
    """What ``kvpool sim run --json`` prints and writes."""
    return json.dumps([public(r) for r in rows], indent=2) + "\n"


def to_csv(rows: Sequence[dict]) -> str:
    """The CSV ``kvpool sim run`` writes (the documented keys as columns)."""
    return pd.DataFrame([public(r) for r in rows]).to_csv(index=False)


def stem(scenario_name: str, rows: Sequence[dict]) -> str:
    """The CLI's file stem: ``NAME-sessions-56-72``."""
    from kvpool.outputs import safe_name

    return f"{safe_name(scenario_name)}-{load_name(rows)}-" + "-".join(f"{load_of(r)[1]:g}" for r in rows)


def _label(row: dict) -> str:
    key, value = load_of(row)
    return f"{value:g} {key}"


def timeline_frame(rows: Sequence[dict]) -> pd.DataFrame:
    """Pool occupancy (fraction of capacity) and cumulative evicted groups over simulated time, per load."""
    parts = []
    for r in rows:
        tl = r.get("timeline") or {}
        if not tl.get("pool_t"):
            continue
        parts.append(pd.DataFrame({
            "load": _label(r),
            "t_s": tl["pool_t"],
            "pool_used": tl["pool_used"],
            "evicted_groups": tl["pool_evicted"],
        }))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["load", "t_s", "pool_used", "evicted_groups"])


def restore_frame(rows: Sequence[dict]) -> pd.DataFrame:
    """Restore-latency samples per stage (seconds) per load (``restore_stage_s``, every 4th sorted sample)."""
    parts = [pd.DataFrame({"load": _label(r), "restore_stage_s": r["restore_stage_s"]})
             for r in rows if r.get("restore_stage_s")]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["load", "restore_stage_s"])


def decode_frame(rows: Sequence[dict]) -> pd.DataFrame:
    """Decode KV occupancy (reserved over capacity) over simulated time, per load: ``run_point``'s
    ``timeline["decode_t"]`` / ``timeline["decode_occ"]`` (downsampled like the pool series)."""
    parts = []
    for r in rows:
        tl = r.get("timeline") or {}
        if not tl.get("decode_t"):
            continue
        parts.append(pd.DataFrame({"load": _label(r), "t_s": tl["decode_t"], "decode_kv_occupancy": tl["decode_occ"]}))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["load", "t_s", "decode_kv_occupancy"])


def compare_frame(runs: dict[str, Sequence[dict]]) -> pd.DataFrame:
    """Every scenario's summary rows, with a ``scenario`` column first."""
    parts = []
    for name, rows in runs.items():
        f = summary_frame(rows).drop(columns=["scenario"], errors="ignore")
        f.insert(0, "scenario", name)
        parts.append(f)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def ratio_frame(runs: dict[str, Sequence[dict]], baseline: str) -> pd.DataFrame:
    """Per other scenario and load: each ``RATIO_METRICS`` value over the baseline's (NaN where 0)."""
    base_rows = runs[baseline]
    key = load_name(base_rows)
    base = {load_of(r)[1]: r for r in base_rows}
    out = []
    for name, rows in runs.items():
        if name == baseline:
            continue
        for r in rows:
            b = base.get(load_of(r)[1])
            if b is None:
                continue
            rec = {"scenario": f"{name} / {baseline}", key: load_of(r)[1]}
            for metric, label in RATIO_METRICS:
                rec[label] = r[metric] / b[metric] if b.get(metric) else float("nan")
            out.append(rec)
    return pd.DataFrame(out)


def compare_json(arms: dict[str, Sequence[dict]]) -> str:
    """What ``kvpool sim compare --json`` prints: ``{scenario name: [per-load objects]}``."""
    return json.dumps({name: [public(r) for r in rows] for name, rows in arms.items()}, indent=2) + "\n"


def plan_summary(result) -> dict:
    """The object ``kvpool sim plan --json`` prints and writes, built exactly as the CLI builds it."""
    curve = [{"value": v, "meets_targets": ok, **public(row)} for v, row, ok in result.curve()]
    return {"variable": result.variable.field, "direction": "maximize" if result.variable.maximize else "minimize",
            "targets": [str(t) for t in result.targets], "best": result.best, "runs": len(curve), "curve": curve}


def plan_json(summary: dict) -> str:
    return json.dumps(summary, indent=2) + "\n"


def plan_frame(summary: dict, metrics: Sequence[str] = ()) -> pd.DataFrame:
    """The explored curve, one row per run in value order: value, meets_targets, ``metrics`` first, then the rest."""
    frame = pd.DataFrame(summary["curve"])
    if frame.empty:
        return frame
    first = ["value", "meets_targets", *dict.fromkeys(m for m in metrics if m in frame and m not in ("value", "meets_targets"))]
    return frame[first + [c for c in frame.columns if c not in first]]


def plan_bracket(summary: dict) -> tuple[float | None, float | None]:
    """(last value that fails, first that meets) next to the best value, in the search's direction.

    Minimizing, the threshold lies between the largest failing value below ``best`` and ``best``;
    maximizing, between ``best`` and the smallest failing value above it. None where no such run.
    """
    best = summary["best"]
    if best is None:
        return None, None
    fails = [c["value"] for c in summary["curve"] if not c["meets_targets"]]
    if summary["direction"] == "minimize":
        below = [v for v in fails if v < best]
        return (max(below) if below else None), best
    above = [v for v in fails if v > best]
    return (min(above) if above else None), best
