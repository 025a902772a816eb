"""Side-by-side runs of several scenarios (arms) at the same loads, with ratios, like the seed's
Figures 7 and 8 (shared vs split pool): system and per-GPU throughput, TTFT p50/p90, token sources.

Contract:
    * ``arms`` is ``{arm name: [one result per load]}``, every arm at the same loads in the same
      order; the first arm is the reference.
    * Every ratio is the reference's value over another arm's, as the seed states them ("the shared
      pool is 1.6 times faster" = shared throughput / split throughput): ``ratios(arms)`` gives, per
      other arm and load, ``RATIO_KEYS`` of the reference over that arm (``None`` where that arm's
      value is 0). With the shared arm first, its throughput ratio is above 1 when it is faster and
      its TTFT ratio below 1 when it answers sooner.
    * ``ratio_table(arms, width)``: per load, one row per arm and one ``REF / ARM`` row of ratios;
      it fits ``width`` columns (``kvpool.tables.fitted``).
    * ``csv_rows(arms)``: one row per (arm, load): ``arm``, ``reference``, the load, the result's
      ``public`` keys, and ``reference_over_arm_KEY`` per ``RATIO_KEYS`` (empty on the reference's
      own rows). ``csv_text(arms)`` is their CSV, ``write_csv(arms, path)`` writes it.
    * ``figure(arms, path, title)``: system throughput, throughput per GPU, TTFT, token sources and
      lane time (``report.lane_panel``), one colour per arm in every panel; the throughput ratios
      stand above the reference's bars.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from kvpool.sim.report import THROUGHPUT_NOTE, lane_panel, load_of, public
from kvpool.tables import Col, fitted

RATIO_KEYS = ("throughput_tok_s", "throughput_per_gpu_tok_s", "ttft_p50_s", "ttft_p90_s")

#: (key, column head, format, keep rank: higher is left out first on a narrow terminal)
_COLUMNS = (
    ("throughput_tok_s", "system\ntok/s", "{:,.0f}", 0),
    ("throughput_per_gpu_tok_s", "tok/s/\nGPU", "{:,.0f}", 0),
    ("ttft_p50_s", "TTFT\np50", "{:.2f}s", 1),
    ("ttft_p90_s", "TTFT\np90", "{:.2f}s", 0),
    ("share_gpu", "GPU", "{:.1%}", 5),
    ("share_pool", "pool", "{:.1%}", 2),
    ("share_computed", "computed", "{:.1%}", 4),
    ("reuse", "reuse", "{:.1%}", 3),
)

#: One colour per arm, the same in every panel (matplotlib's tab10, in order).
ARM_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def ratios(arms: dict[str, Sequence[dict]]) -> dict[str, list[dict]]:
    """``{other arm: [{LOAD_KEY: load, KEY: reference / other, ...} per load]}``."""
    names = list(arms)
    ref = arms[names[0]]
    out: dict[str, list[dict]] = {}
    for n in names[1:]:
        out[n] = [{load_of(a)[0]: load_of(a)[1], **{k: _ratio(a[k], b[k]) for k in RATIO_KEYS}}
                  for a, b in zip(ref, arms[n])]
    return out


def _x(r: float | None) -> str:
    if r is None:
        return "-"
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def ratio_table(arms: dict[str, Sequence[dict]], width: int = 80) -> Table:
    """Per load: each arm's row, then one ``REF / ARM`` row per other arm with the ratios."""
    names = list(arms)
    ref = names[0]
    rat = ratios(arms)
    cols = [Col(load_of(arms[ref][0])[0]), Col("arm", "left")] + [Col(h, keep=k) for _, h, _, k in _COLUMNS]
    rows: list[list[str] | None] = []
    for i, row0 in enumerate(arms[ref]):
        load = f"{load_of(row0)[1]:g}"
        for n in names:
            r = arms[n][i]
            rows.append([load, n, *[fmt.format(r.get(k, 0)) for k, _, fmt, _ in _COLUMNS]])
        for n in names[1:]:
            q = rat[n][i]
            rows.append([load, f"{ref} / {n}", *[_x(q[k]) if k in RATIO_KEYS else "" for k, _, _, _ in _COLUMNS]])
        rows.append(None)
    title = f"{' vs '.join(names)}: the ratio rows are {ref}'s value over the other arm's"
    return fitted(cols, rows[:-1], width, title=title, note="every column is in the CSV")


def csv_rows(arms: dict[str, Sequence[dict]]) -> list[dict]:
    names = list(arms)
    ref = names[0]
    rat = ratios(arms)
    out = []
    for n in names:
        for i, r in enumerate(arms[n]):
            row = {"arm": n, "reference": ref, **public(r)}
            for k in RATIO_KEYS:
                q = rat[n][i][k] if n != ref else None
                row[f"reference_over_arm_{k}"] = "" if q is None else q
            out.append(row)
    return out


def csv_text(arms: dict[str, Sequence[dict]]) -> str:
    """The CSV of ``csv_rows`` (a column for every key any row has, in first-met order)."""
    rows = csv_rows(arms)
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=keys, restval="")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def write_csv(arms: dict[str, Sequence[dict]], path: Path) -> None:
    with path.open("w", newline="") as f:
        f.write(csv_text(arms))


_SOURCES = (("share_gpu", "GPU prefix cache", 1.0, ""), ("share_pool", "KV pool (Store)", 0.55, "//"),
            ("share_computed", "computed", 0.25, "xx"))


def figure(arms: dict[str, Sequence[dict]], path: Path, title: str = "") -> None:
    """System throughput and throughput per GPU (bars, the ratios above the reference's bars), TTFT
    p50/p90 (lines) and token sources (stacked shares), one colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Patch

    names = list(arms)
    colour = {n: ARM_COLOURS[j % len(ARM_COLOURS)] for j, n in enumerate(names)}
    first = arms[names[0]]
    key = load_of(first[0])[0]
    loads = [f"{load_of(r)[1]:g}" for r in first]
    x = np.arange(len(loads))
    w = 0.8 / len(names)
    fig, (a1, a2, a3, a4, a5) = plt.subplots(1, 5, figsize=(22, 4.8))
    rat = ratios(arms)
    _throughput_panel(a1, arms, rat, colour, x, w, "throughput_tok_s", "system throughput (K tok/s)")
    _throughput_panel(a2, arms, rat, colour, x, w, "throughput_per_gpu_tok_s", "throughput per GPU (K tok/s)")
    _ttft_panel(a3, arms, colour, loads, plt)
    _sources_panel(a4, arms, colour, x, w, Patch)
    lane_panel(a5, arms, x, w, colour)
    a5.set_title("lane time (bars in arm order)", fontsize=9)
    for ax in (a1, a2, a4, a5):
        ax.set_xticks(x + w * (len(names) - 1) / 2, loads)
    for ax in (a1, a2, a3, a4, a5):
        ax.set_xlabel(key)
    ratio_note = f"bar labels: {names[0]}'s throughput over {names[1]}'s" if len(names) == 2 else \
        f"bar labels: {names[0]}'s throughput over each other arm's"
    fig.legend(handles=[Patch(color=colour[n], label=n) for n in names], loc="upper center",
               ncol=len(names), fontsize=9, frameon=False, bbox_to_anchor=(0.5, 0.93))
    fig.suptitle(title or " vs ".join(names), fontsize=11)
    fig.text(0.5, 0.005, f"{ratio_note}. {THROUGHPUT_NOTE}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _throughput_panel(ax, arms, rat, colour, x, w, metric: str, ylabel: str) -> None:
    """One bar per arm and load; above the reference's bars, its value over each other arm's."""
    import numpy as np

    names = list(arms)
    tops = np.zeros(len(x))
    for j, n in enumerate(names):
        vals = np.array([r[metric] / 1e3 for r in arms[n]])
        ax.bar(x + j * w, vals, w, color=colour[n])
        tops = np.maximum(tops, vals)
    for i in range(len(x)):
        text = "\n".join(_x(rat[n][i][metric]) + (f" vs {n}" if len(names) > 2 else "") for n in names[1:])
        if text:
            ax.text(x[i], tops[i] * 1.02, text, ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(tops.max(), 1e-9) * (1.18 + 0.06 * max(0, len(names) - 2)))
    ax.set_ylabel(ylabel)


def _ttft_panel(ax, arms, colour, loads, plt) -> None:
    """TTFT p50 (solid) and p90 (dashed) per arm, from 0."""
    for n in arms:
        ax.plot(loads, [r["ttft_p50_s"] for r in arms[n]], "o-", color=colour[n])
        ax.plot(loads, [r["ttft_p90_s"] for r in arms[n]], "s--", color=colour[n])
    ax.set_ylim(bottom=0)
    ax.set_ylabel("time to first token (s)")
    ax.legend(handles=[plt.Line2D([], [], color="gray", marker="o", ls="-", label="p50"),
                       plt.Line2D([], [], color="gray", marker="s", ls="--", label="p90")], fontsize=8)


def _sources_panel(ax, arms, colour, x, w, Patch) -> None:
    """Each arm's token sources as stacked shares (one shade and hatch per source)."""
    import numpy as np

    for j, n in enumerate(arms):
        bottom = np.zeros(len(x))
        for k, _, alpha, hatch in _SOURCES:
            vals = np.array([r[k] for r in arms[n]]) * 100
            ax.bar(x + j * w, vals, w, bottom=bottom, color=colour[n], alpha=alpha, hatch=hatch,
                   edgecolor=colour[n], linewidth=0.6)
            bottom += vals
    ax.set_ylim(0, 100)
    ax.set_ylabel("share of prompt tokens (%)")
    ax.legend(handles=[Patch(facecolor="gray", alpha=a, hatch=h, edgecolor="gray", label=lab) for _, lab, a, h in _SOURCES],
              fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
