"""Figure 6 of the seed, simulated: mi355x-1p1d at 56/72/96/112 sessions, side by side with the
seed's published numbers, on the agentx-062126 synthetic preset and (optionally) real traces.

Prints one JSON object: per workload, the per-load metrics, the seed's targets, and the checks of
the figure's shape (GPU share falls and pool share rises with load, reuse >= 95 % and below the
trace ceiling, throughput rises from 56 to 96 and flattens at 112, TTFT p50 at 112 well above 96,
decode KV occupancy highest at 112). Also writes the PNGs under --out.

    .venv/bin/python bench/figure6.py [--duration 3600] [--traces ../shared/traces/kv-cache-tester] [--out out/figure6]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpool.scenario import load_scenario
from kvpool.sim import report
from kvpool.sim.run import sweep, workload_for
from kvpool.workload.stats import workload_stats

SEED = {  # ../shared/reference/seed-targets.md, single server (Figure 6)
    56: {"throughput_per_gpu_tok_s": 31_000, "share_gpu": 0.81, "share_pool": 0.16, "reuse_min": 0.95, "ttft_p50_s_max": 2.5},
    72: {"reuse_min": 0.95, "ttft_p50_s_max": 2.5},
    96: {"throughput_per_gpu_tok_s": 44_000, "reuse_min": 0.95, "ttft_p50_s_max": 2.5, "gen_speed_per_user_tok_s_p50": 46},
    112: {"throughput_per_gpu_tok_s": 44_000, "share_pool": 0.46, "share_computed": 0.046, "reuse_min": 0.95,
          "ttft_p50_s": 7.0, "decode_kv_occupancy_p50": 0.91, "gen_speed_per_user_tok_s_p50": 46},
}
LOADS = (56, 72, 96, 112)


def shape_checks(rows: list[dict], ceiling: float) -> dict:
    by = {r["sessions"]: r for r in rows}
    return {
        "gpu_share_falls": all(by[a]["share_gpu"] >= by[b]["share_gpu"] for a, b in zip(LOADS, LOADS[1:])),
        "pool_share_rises": all(by[a]["share_pool"] <= by[b]["share_pool"] for a, b in zip(LOADS, LOADS[1:])),
        "reuse_at_least_95": all(r["reuse"] >= 0.95 for r in rows),
        "reuse_below_ceiling": all(r["reuse"] <= ceiling + 1e-9 for r in rows),
        "throughput_rises_56_to_96": by[56]["throughput_per_gpu_tok_s"] < by[96]["throughput_per_gpu_tok_s"],
        "throughput_flat_at_112": abs(by[112]["throughput_per_gpu_tok_s"] / by[96]["throughput_per_gpu_tok_s"] - 1) < 0.1,
        "ttft_p50_112_well_above_96": by[112]["ttft_p50_s"] > 1.5 * by[96]["ttft_p50_s"],
        "decode_kv_highest_at_112": by[112]["decode_kv_occupancy_p50"] == max(r["decode_kv_occupancy_p50"] for r in rows),
    }


def run(label: str, traces: str | None, duration: float, out: Path, workers: int) -> dict:
    s = load_scenario("mi355x-1p1d", [f"workload.duration_s={duration}"])
    ceiling = workload_stats(workload_for(s, traces))["reuse_ceiling"]
    rows = sweep(s, LOADS, traces=traces, workers=workers)
    report.write_files(rows, out, f"figure6-{label}")
    return {"workload": label, "trace_reuse_ceiling": ceiling, "loads": [report.public(r) for r in rows],
            "shape": shape_checks(rows, ceiling)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--traces", default=None, help="also run on these real traces")
    ap.add_argument("--out", type=Path, default=Path("out/figure6"))
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    result = {"seed": SEED, "runs": [run("agentx-062126", None, a.duration, a.out, a.workers)]}
    if a.traces:
        result["runs"].append(run("kv-cache-tester-real", a.traces, a.duration, a.out, a.workers))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
