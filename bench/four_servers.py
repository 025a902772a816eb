"""Figures 7 and 8 of the seed, simulated: shared vs split pool on the four MI350X servers, side by
side with the seed's numbers, and checks of the runs against them.

Prints one JSON object: per figure, each arm's per-load metrics (the keys of ``kvpool sim run
--json``), the seed's targets, and the checks. "About X %" is read as X +- 5 points; a range
"A-B %" as A - 0.5 to B + 0.5 points (the seed's percentages are rounded); a ratio "within 15 %"
of its target. Also writes each figure's comparison PNG under --out.

    .venv/bin/python bench/four_servers.py [--figures 7,8] [--seed 7] [--out out/four-servers]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpool.scenario import load_scenario
from kvpool.sim import compare, report
from kvpool.sim.run import sweep

#: ../shared/reference/seed-targets.md
SEED_FIG7 = {
    "shared": {"share_pool": 0.58, "reuse": (0.95, 0.96), "share_computed": (0.04, 0.05), "ttft_p50_s": 1.0, "ttft_p90_s": (1.7, 1.8)},
    "split": {"share_pool": 0.11, "reuse": (0.51, 0.55), "ttft_p90_s": (7.0, 10.0)},
}
SEED_FIG8 = {
    "ratio": {56: 1.6, 96: 2.0, 112: 2.0},
    "shared_tok_s": {56: 256_000, 96: 389_000, 112: 348_000},
    "split_tok_s": (156_000, 194_000),
    "shared_reuse": (0.94, 0.96),
    "split_reuse": {56: 0.79, 112: 0.65},
    "ttft_p90_s": {"shared": (1.9, 2.3), "split": {56: 3.9, 112: 19.3}},
}
ABOUT = 0.05  # "about X %": X +- 5 points
ROUNDING = 0.005  # a published whole percentage covers +- half a point


def _in_range(x: float, lo: float, hi: float, slack: float = ROUNDING) -> bool:
    return lo - slack <= x <= hi + slack


def figure7_checks(shared: list[dict], split: list[dict]) -> dict[str, bool]:
    s7, p7 = SEED_FIG7["shared"], SEED_FIG7["split"]
    return {
        "shared_store_about_58": all(abs(r["share_pool"] - s7["share_pool"]) <= ABOUT for r in shared),
        "shared_reuse_95_96": all(_in_range(r["reuse"], *s7["reuse"]) for r in shared),
        "split_store_about_11": all(abs(r["share_pool"] - p7["share_pool"]) <= ABOUT for r in split),
        "split_reuse_51_55": all(_in_range(r["reuse"], *p7["reuse"]) for r in split),
    }


def figure8_checks(shared: list[dict], split: list[dict]) -> dict[str, bool]:
    by_sh = {r["sessions"]: r for r in shared}
    by_sp = {r["sessions"]: r for r in split}
    loads = sorted(by_sh)
    ratio = {n: by_sh[n]["throughput_tok_s"] / by_sp[n]["throughput_tok_s"] for n in loads}
    out = {f"ratio_{n}_within_15pct_of_{t:g}": abs(ratio[n] / t - 1) <= 0.15
           for n, t in SEED_FIG8["ratio"].items() if n in ratio}
    split_reuse = [by_sp[n]["reuse"] for n in loads]
    out["split_reuse_falls_within_60_80"] = (all(a >= b for a, b in zip(split_reuse, split_reuse[1:]))
                                             and all(_in_range(x, 0.60, 0.80) for x in split_reuse))
    out["shared_reuse_94_96"] = all(_in_range(by_sh[n]["reuse"], *SEED_FIG8["shared_reuse"]) for n in loads)
    first, last = loads[0], loads[-1]
    out["split_ttft_p90_rises_steeply"] = by_sp[last]["ttft_p90_s"] >= 3 * by_sp[first]["ttft_p90_s"]
    out["shared_ttft_p90_stays_near_first"] = by_sh[last]["ttft_p90_s"] <= 1.5 * by_sh[first]["ttft_p90_s"]
    return out


def run_figure(fig: int, seed: int | None, out: Path, workers: int) -> dict:
    names = (("mi350x-6p2d-tp4-replay-shared", "mi350x-6p2d-tp4-replay-split") if fig == 7
             else ("mi350x-6p2d-shared", "mi350x-6p2d-split"))
    loads = (0.6, 0.8, 1.0) if fig == 7 else (56, 72, 96, 112)
    sets = [] if seed is None else [f"seed={seed}"]
    arms = {n: sweep(load_scenario(n, sets), loads, workers=workers) for n in names}
    compare.figure(arms, out / f"figure{fig}.png")
    shared, split = arms[names[0]], arms[names[1]]
    checks = figure7_checks(shared, split) if fig == 7 else figure8_checks(shared, split)
    result = {"arms": {n: [report.public(r) for r in rows] for n, rows in arms.items()},
              "seed_targets": SEED_FIG7 if fig == 7 else SEED_FIG8, "checks": checks}
    if fig == 8:
        result["ratio"] = {r["sessions"]: r["throughput_tok_s"] / q["throughput_tok_s"] for r, q in zip(shared, split)}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--figures", default="7,8", help="which figures, e.g. 7 or 7,8")
    ap.add_argument("--seed", type=int, default=None, help="the scenarios' seed (default: theirs, 7)")
    ap.add_argument("--out", type=Path, default=Path("out/four-servers"))
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    figs = [int(x) for x in a.figures.split(",")]
    if not set(figs) <= {7, 8}:
        ap.error(f"--figures {a.figures}: allowed are 7 and 8")
    a.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps({f"figure{f}": run_figure(f, a.seed, a.out, a.workers) for f in figs}, indent=1, default=float))


if __name__ == "__main__":
    main()
