"""Reports of simulator runs: terminal tables, JSON/CSV files and a figure shaped like the seed's
Figure 6 (throughput per GPU and the stacked token-source shares per load, with TTFT), with the
lanes' time as stacked shares beside it.

Contract:
    * ``public(row)`` is a result's documented model outputs (docs/metrics.md), without time series
      and without the wall-clock figures (``WALL_CLOCK_KEYS``), which ``timing(row)`` returns.
    * ``run_document(rows, provenance, run)`` is the JSON document of a run: ``id`` (a short hash of
      the provenance), ``provenance`` (what produced it, ``sim.provenance``), ``results`` (one
      ``public`` object per load) and ``run`` (how this execution went: the front end that produced it,
      executor, workers and each load's wall-clock figures; ``sim.documents`` builds both blocks).
      Equal inputs give documents equal outside ``run``, byte for byte.
    * ``lane_table(arms, width)``: errors, censored requests and the lane-time shares per arm and
      load; ``lane_panel(ax, arms, x, w)`` draws those shares as stacked bars.
    * ``write_files(rows, out_dir, stem, ...)`` writes ``stem.json`` (that document), ``stem.csv``
      (``csv_text``: the ``public`` keys) and ``stem.png``.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from kvpool.workload.records import LANE_PHASES, SUMMARY_KEYS

#: (key, column head, format, keep rank: higher is left out first on a narrow terminal)
_TABLE_COLUMNS = (
    ("throughput_per_gpu_tok_s", "tok/s/\nGPU", "{:,.0f}", 0),
    ("ttft_p50_s", "TTFT\np50", "{:.2f}s", 0),
    ("ttft_p90_s", "TTFT\np90", "{:.2f}s", 0),
    ("share_gpu", "GPU", "{:.1%}", 3),
    ("share_pool", "pool", "{:.1%}", 0),
    ("share_computed", "computed", "{:.1%}", 2),
    ("reuse", "reuse", "{:.1%}", 0),
    ("gen_speed_per_user_tok_s_p50", "tok/s/\nuser", "{:.0f}", 1),
    ("decode_kv_occupancy_p50", "decode\nKV", "{:.0%}", 4),
    ("restore_stage_s_p50", "restore/\nstage", "{:.3f}s", 5),
    ("requests", "requests", "{:,}", 0),
    ("wall_s", "wall", "{:.1f}s", 6),
)

#: The seed's definition of throughput, stated on every figure that shows it.
THROUGHPUT_NOTE = "Throughput counts every prompt token, cached or not, plus generated tokens, per second."


def load_of(row: dict) -> tuple[str, float]:
    return ("sessions", row["sessions"]) if "sessions" in row else ("rps", row["rps"])


#: Figures of the machine that ran the simulation, not of the simulated system (the ``run`` block).
WALL_CLOCK_KEYS = ("wall_s", "cpu_s", "sim_s_per_wall_s")


def public(row: dict) -> dict:
    """The documented model outputs of one result (docs/metrics.md): no time series, no wall clock."""
    out = {k: row[k] for k in SUMMARY_KEYS if k in row and k not in WALL_CLOCK_KEYS}
    for extra in ("scenario", "simulated_s", "pool_evicted_groups", "prompt_tokens", "output_tokens", "window_s"):
        if extra in row:
            out[extra] = row[extra]
    return out


def timing(row: dict) -> dict:
    """One load's wall-clock figures, with its load: ``{"sessions": 56, "wall_s": ..., ...}``."""
    key, value = load_of(row)
    return {key: value, **{k: row[k] for k in WALL_CLOCK_KEYS if k in row}}


#: A result below these is not a measurement: too few requests finished inside the window, or the
#: median request waited for its first token longer than a quarter of the window.
MIN_REQUESTS = 10
MAX_TTFT_P50_FRACTION = 0.25


def degenerate_reason(row: dict) -> str | None:
    """Why one load's result is no measurement (docs/metrics.md, "Degenerate runs"), or None."""
    window = row.get("duration_s", 0.0)
    n = row.get("requests", 0)
    rejected = row.get("rejected", 0)
    if n < MIN_REQUESTS and rejected:
        return (f"the admission gate rejected {rejected} request{'s' if rejected > 1 else ''} and {n} finished inside "
                f"the {window:g} s window: a request is admitted when its input + output tokens fit "
                "gate.tokens_per_decode x gate.budget_fraction on a decode instance within gate.max_wait_s "
                "(and gate.max_input_tokens / max_output_tokens); raise the budget or the wait, or set gate.enabled=false")
    if n == 0:
        return (f"no request finished inside the {window:g} s window (the simulation ran {row.get('simulated_s', 0):.0f} s): "
                "the window is shorter than one request takes; give a longer --duration")
    if n < MIN_REQUESTS:
        return (f"only {n} request{'s' if n > 1 else ''} finished inside the {window:g} s window (TTFT p50 "
                f"{row.get('ttft_p50_s', 0):.1f} s): too few to measure; give a longer --duration")
    if row.get("ttft_p50_s", 0) > MAX_TTFT_P50_FRACTION * window:
        return (f"TTFT p50 {row['ttft_p50_s']:.1f} s is more than a quarter of the {window:g} s window: requests "
                "take about as long as the window; give a longer --duration or a lower load")
    return None


def run_document(rows: Sequence[dict], provenance: dict, run: dict) -> dict:
    from kvpool.sim.provenance import short_id

    return {"id": short_id(provenance), "provenance": provenance, "results": [public(r) for r in rows], "run": run}


def table(rows: Sequence[dict], title: str = "", width: int = 80) -> Table:
    """One row per load; fits ``width`` columns (``kvpool.tables.fitted``: the least needed columns
    are left out of a narrow terminal, every one stays in the CSV)."""
    from kvpool.tables import Col, fitted

    cols = [Col(load_of(rows[0])[0] if rows else "load")] + [Col(h, keep=k) for _, h, _, k in _TABLE_COLUMNS]
    cells = [[f"{load_of(r)[1]:g}", *[fmt.format(r.get(k, 0)) for k, _, fmt, _ in _TABLE_COLUMNS]] for r in rows]
    return fitted(cols, cells, width, title=title, note="every column is in the CSV")


#: Lane phases as the tables and plots name them, with a colour each (``LANE_PHASES`` order).
LANE_LABELS = {
    "recorded_wait": ("recorded wait", "#d9d9d9"), "front_end": ("front end", "#bcbd22"), "gate": ("gate", "#8c564b"),
    "control_plane": ("control plane", "#e377c2"), "restore": ("restore", "#dd8452"),
    "prefill_queue": ("prefill queue", "#c44e52"), "prefill_compute": ("prefill compute", "#937860"),
    "handoff": ("hand-off", "#17becf"), "decode": ("decode", "#4c72b0"), "hung": ("hung", "#000000"),
    "unstamped": ("unstamped", "#7f7f7f"),
}


#: keep rank of each phase's column in ``lane_table`` (higher is left out first on a narrow terminal)
_LANE_KEEP = {"recorded_wait": 0, "decode": 0, "hung": 0, "prefill_queue": 1, "prefill_compute": 1, "gate": 2,
              "restore": 3, "control_plane": 3}


def lane_table(arms: dict[str, Sequence[dict]], width: int = 80) -> Table:
    """Per arm and load: errors, censored requests and where the lanes' time went (shares of
    ``lane_s``, docs/metrics.md "Lane time"); phases no row spends time in are left out."""
    from kvpool.tables import Col, fitted

    rows = [r for rs in arms.values() for r in rs]
    phases = [p for p in LANE_PHASES if any(r.get(f"lane_share_{p}", 0) > 0 for r in rows)]
    key = load_of(rows[0])[0] if rows else "load"
    cols = [Col("arm", "left"), Col(key), Col("errors"), Col("censored")]
    cols += [Col(LANE_LABELS[p][0].replace(" ", "\n", 1), keep=_LANE_KEEP.get(p, 4)) for p in phases]
    cells = [[n, f"{load_of(r)[1]:g}", f"{r.get('errors', 0):,}", f"{r.get('censored', 0):,}",
              *[f"{r.get(f'lane_share_{p}', 0):.1%}" for p in phases]] for n, rs in arms.items() for r in rs]
    return fitted(cols, cells, width, title="where the lanes' time went (shares of the measured window)",
                  note="every column is in the CSV")


def lane_panel(ax, arms: dict[str, Sequence[dict]], x, w, colours: dict[str, str] | None = None) -> None:
    """Stacked shares of lane time per load, one bar per arm (outlined in the arm's colour)."""
    import numpy as np

    names = list(arms)
    rows = [r for rs in arms.values() for r in rs]
    phases = [p for p in LANE_PHASES if any(r.get(f"lane_share_{p}", 0) > 0 for r in rows)]
    for j, n in enumerate(names):
        bottom = np.zeros(len(x))
        for p in phases:
            vals = np.array([r.get(f"lane_share_{p}", 0.0) for r in arms[n]]) * 100
            ax.bar(x + j * w, vals, w, bottom=bottom, color=LANE_LABELS[p][1],
                   edgecolor=(colours or {}).get(n, "white"), linewidth=0.8,
                   label=LANE_LABELS[p][0] if j == 0 else None)
            bottom += vals
    ax.set_ylim(0, 100)
    ax.set_ylabel("share of lane time (%)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)


def csv_text(rows: Sequence[dict]) -> str:
    """The CSV of a sweep: one row per load, the ``public`` keys as columns."""
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=list(public(rows[0])) if rows else [])
    w.writeheader()
    for r in rows:
        w.writerow(public(r))
    return buf.getvalue()


def write_files(rows: Sequence[dict], out_dir: Path, stem: str, *, document: dict | None = None,
                title: str = "") -> list[Path]:
    """``stem.json`` (``document``, a ``run_document``; without one, the list of ``public`` rows),
    ``stem.csv`` and ``stem.png`` (titled ``title``, else the stem); returns the paths. Each file is
    written under a temporary name and renamed into place (``kvpool.outputs.atomic_path``)."""
    from kvpool.outputs import atomic_path

    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / f"{stem}.json"
    with atomic_path(js) as tmp:
        tmp.write_text(json.dumps(document if document is not None else [public(r) for r in rows], indent=2) + "\n")
    cs = out_dir / f"{stem}.csv"
    with atomic_path(cs) as tmp, tmp.open("w", newline="") as f:
        f.write(csv_text(rows))
    png = out_dir / f"{stem}.png"
    with atomic_path(png) as tmp:
        figure(rows, tmp, title=title or stem)
    return [js, cs, png]


def figure(rows: Sequence[dict], path: Path, title: str = "") -> None:
    """Throughput per GPU (bars) and token sources (stacked shares), TTFT p50/p90 (right panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = load_of(rows[0])[0]
    xs = [f"{load_of(r)[1]:g}" for r in rows]
    fig, (ax1, ax2, ax3, ax4) = plt.subplots(1, 4, figsize=(17, 4.4))
    ax1.bar(xs, [r["throughput_per_gpu_tok_s"] / 1e3 for r in rows], color="#4c72b0")
    ax1.set_ylabel("throughput per GPU (K tok/s)")
    ax1.set_xlabel(key)
    gpu = [r["share_gpu"] * 100 for r in rows]
    pool = [r["share_pool"] * 100 for r in rows]
    comp = [r["share_computed"] * 100 for r in rows]
    ax2.bar(xs, gpu, label="GPU prefix cache", color="#55a868")
    ax2.bar(xs, pool, bottom=gpu, label="KV pool (Store)", color="#dd8452")
    ax2.bar(xs, comp, bottom=[a + b for a, b in zip(gpu, pool)], label="computed", color="#c44e52")
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("share of prompt tokens (%)")
    ax2.set_xlabel(key)
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8, frameon=False)
    ax3.plot(xs, [r["ttft_p50_s"] for r in rows], "o-", label="TTFT p50")
    ax3.plot(xs, [r["ttft_p90_s"] for r in rows], "s--", label="TTFT p90")
    ax3.set_ylim(bottom=0)
    ax3.set_ylabel("time to first token (s)")
    ax3.set_xlabel(key)
    ax3.legend(fontsize=8)
    import numpy as np

    x = np.arange(len(xs))
    lane_panel(ax4, {"": rows}, x, 0.8)
    ax4.set_xticks(x, xs)
    ax4.set_xlabel(key)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.text(0.5, 0.005, THROUGHPUT_NOTE, ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
