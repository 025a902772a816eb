"""Simulator results as tables for the dashboard (pure pandas; no Streamlit here).

Contract:
    * ``summary_frame(rows)``: one row per load with the documented keys of ``kvpool.sim.report.public``
      (docs/metrics.md) - the same values ``kvpool sim run --json`` prints.
    * ``timeline_frame`` (pool) / ``decode_frame`` (decode KV) / ``restore_frame``: long frames of the
      time series and samples a result carries (``run_point``'s ``timeline`` and ``restore_stage_s``),
      for the charts.
    * ``compare_frame(runs)`` and ``ratio_frame(runs)``: several scenarios side by side, and the
      first one's ratios over each other one at the same load (``kvpool sim compare``'s direction).
    * The downloads are the CLI's files, byte for byte: ``document_json(doc)`` a result document of
      ``kvpool.sim.documents`` (``id``, ``provenance``, results, ``run``), ``to_csv(rows)`` and
      ``compare_csv(runs)`` the CSVs of ``kvpool sim run`` and ``compare``; ``stem`` the run's file stem.
    * ``plan_json`` the text of a search's document (``kvpool.sim.documents.plan_document``);
      ``plan_frame`` its curve as a table; ``plan_bracket`` the values either side of the threshold.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pandas as pd

from kvpool.sim.report import load_of, public

# The ratios the Compare page shows: ``kvpool.sim.compare.RATIO_KEYS``, the reference's value over
# another arm's (the seed's reading: a throughput ratio above 1 means the reference is faster, a
# TTFT ratio below 1 that it answers sooner).
RATIO_LABELS: dict[str, str] = {
    "throughput_tok_s": "system throughput",
    "throughput_per_gpu_tok_s": "throughput per GPU",
    "ttft_p50_s": "TTFT p50",
    "ttft_p90_s": "TTFT p90",
}

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


def to_csv(rows: Sequence[dict]) -> str:
    """The CSV ``kvpool sim run`` writes (``kvpool.sim.report.csv_text``: the documented keys as columns)."""
    from kvpool.sim.report import csv_text

    return csv_text(rows)


def stem(scenario_name: str, rows: Sequence[dict], run_id: str) -> str:
    """The CLI's file stem: ``NAME-sessions-56-72-ID``, ID the document's ``id``."""
    from kvpool.outputs import safe_name

    return (f"{safe_name(scenario_name)}-{load_name(rows)}-" + "-".join(f"{load_of(r)[1]:g}" for r in rows)
            + f"-{run_id}")


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


def ratio_frame(runs: dict[str, Sequence[dict]]) -> pd.DataFrame:
    """Per other scenario and load: the first scenario's value over that one's, for each ratio of
    ``kvpool sim compare`` (``kvpool.sim.compare.ratios``; NaN where the other's value is 0)."""
    from kvpool.sim.compare import ratios

    names = list(runs)
    if len(names) < 2:
        return pd.DataFrame()
    key = load_name(runs[names[0]])
    out = []
    for name, per_load in ratios(runs).items():
        for r in per_load:
            rec = {"ratio": f"{names[0]} / {name}", key: r[key]}
            for metric, label in RATIO_LABELS.items():
                rec[label] = float("nan") if r[metric] is None else r[metric]
            out.append(rec)
    return pd.DataFrame(out)


def document_json(doc: dict) -> str:
    """A result document as the CLI writes its JSON file (``kvpool.sim.documents``)."""
    return json.dumps(doc, indent=2) + "\n"


def compare_csv(runs: dict[str, Sequence[dict]]) -> str:
    """The CSV ``kvpool sim compare`` writes beside its JSON (``kvpool.sim.compare.csv_text``)."""
    from kvpool.sim.compare import csv_text

    return csv_text(runs)


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
