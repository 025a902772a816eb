"""Side-by-side runs of several scenarios (arms) at the same loads, with ratios, like the seed's
Figures 7 and 8 (shared vs split pool): system throughput, TTFT p50/p90, token-source shares."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from kvpool.sim.report import load_of

_COLUMNS = (
    ("throughput_tok_s", "system tok/s", "{:,.0f}"),
    ("ttft_p50_s", "TTFT p50", "{:.2f}s"),
    ("ttft_p90_s", "TTFT p90", "{:.2f}s"),
    ("share_gpu", "GPU", "{:.1%}"),
    ("share_pool", "pool", "{:.1%}"),
    ("share_computed", "computed", "{:.1%}"),
    ("reuse", "reuse", "{:.1%}"),
)


def ratio_table(arms: dict[str, Sequence[dict]]) -> Table:
    """One row per (load, arm); the first arm is the reference of the throughput and TTFT ratios."""
    names = list(arms)
    ref = names[0]
    t = Table(title=f"{' vs '.join(names)}  (ratios: {ref} / arm)")
    t.add_column(load_of(arms[ref][0])[0], justify="right")
    t.add_column("arm")
    for _, head, _ in _COLUMNS:
        t.add_column(head, justify="right")
    t.add_column("tput ratio", justify="right")
    t.add_column("TTFT p90 ratio", justify="right")
    for i, row0 in enumerate(arms[ref]):
        for name in names:
            r = arms[name][i]
            tput = row0["throughput_tok_s"] / r["throughput_tok_s"] if r["throughput_tok_s"] else float("nan")
            ttft = row0["ttft_p90_s"] / r["ttft_p90_s"] if r["ttft_p90_s"] else float("nan")
            t.add_row(f"{load_of(r)[1]:g}", name, *[fmt.format(r.get(k, 0)) for k, _, fmt in _COLUMNS],
                      f"{tput:.2f}x", f"{ttft:.2f}x")
    return t


def figure(arms: dict[str, Sequence[dict]], path: Path) -> None:
    """System throughput, TTFT p50/p90 and token-source shares per arm and load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(arms)
    first = arms[names[0]]
    key = load_of(first[0])[0]
    loads = [f"{load_of(r)[1]:g}" for r in first]
    x = np.arange(len(loads))
    w = 0.8 / len(names)
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 4))
    for j, n in enumerate(names):
        rows = arms[n]
        a1.bar(x + j * w, [r["throughput_tok_s"] / 1e3 for r in rows], w, label=n)
        a2.plot(loads, [r["ttft_p50_s"] for r in rows], "o-", label=f"{n} p50")
        a2.plot(loads, [r["ttft_p90_s"] for r in rows], "s--", label=f"{n} p90")
        gpu = np.array([r["share_gpu"] for r in rows]) * 100
        pool = np.array([r["share_pool"] for r in rows]) * 100
        comp = np.array([r["share_computed"] for r in rows]) * 100
        a3.bar(x + j * w, gpu, w, color="#55a868", label="GPU" if j == 0 else None)
        a3.bar(x + j * w, pool, w, bottom=gpu, color="#dd8452", label="pool" if j == 0 else None)
        a3.bar(x + j * w, comp, w, bottom=gpu + pool, color="#c44e52", label="computed" if j == 0 else None)
    ref = [r["throughput_tok_s"] for r in first]
    for j, n in enumerate(names[1:], start=1):  # the throughput ratio, first arm / this arm, on its bar
        for i, r in enumerate(arms[n]):
            if r["throughput_tok_s"] > 0:
                a1.text(x[i] + j * w, r["throughput_tok_s"] / 1e3, f"{ref[i] / r['throughput_tok_s']:.2f}x",
                        ha="center", va="bottom", fontsize=7)
    if len(names) > 1:
        a1.set_title(f"labels: {names[0]} / arm", fontsize=8)
    for ax in (a1, a3):
        ax.set_xticks(x + w * (len(names) - 1) / 2, loads)
        ax.set_xlabel(key)
    a1.set_ylabel("system throughput (K tok/s)")
    a1.legend(fontsize=7)
    a2.set_ylabel("TTFT (s)")
    a2.set_xlabel(key)
    a2.legend(fontsize=7)
    a3.set_ylabel("share of prompt tokens (%), arms left to right")
    a3.set_ylim(0, 100)
    a3.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
