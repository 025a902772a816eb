#!/usr/bin/env python3
"""Fidelity: the same workload through ``kvpool serve`` (real) and ``kvpool sim run`` (simulated).

One run, in order:

    calibrate  a fresh ``kvpool serve SCENARIO``, measured by ``kvpool calibrate --url`` on its own
               synthetic prompts (``backend.serve.calibrate``: fresh random ids, never the traces)
               and, with ``--calibration-traces PATH``, a replay of PATH's traces that scales the
               prefill grid to the server as a replay finds it (``--replay-traces``), then stopped;
               or ``--calibration FILE`` from an earlier run. A calibration whose replay phase
               replayed any of ``--traces``' files (by content, its ``replay.files``) is refused:
               the prediction holds out the traces it is calibrated on
    real       per load: a fresh ``kvpool serve SCENARIO`` (empty GPU caches and pool) and
               ``kvpool replay`` of ``--traces`` at that many sessions for ``--duration`` s with
               ``workload.token_scale`` = ``--token-scale``; the server is stopped after each load
    simulated  ``kvpool.sim.run.run_point`` of the same scenario, traces, loads, seed and
               overrides, plus ``cost.kv_capacity = "serve"`` (the serve capacities and page discipline) and
               ``cost.calibration`` = the file: the held-out prediction (the fit never saw the traces)
    compare    per load: token shares (GPU / pool / computed, error in points), TTFT p50 and p90,
               throughput and decode speed per user (``gen_speed_per_user_tok_s_p50``; error in %),
               requests; where each run's requests spent their time (``phases``: prefill window,
               hand-off and time per output token, requests in prefill and sequences decoding
               on average); the real run's engine time accounts (``stack_real``:
               ``engine_accounts.stack_cost``; null for a kept replay whose summary has none);
               a prefill stage's time per computed token (``prefill_stage_us_per_token``: the
               real stages' forward seconds (``real``) and their steps' round trips less their
               waits behind earlier steps (``real_stage``, what ``sim.replay_fit`` matches), over
               the tokens the engines computed in steps; the simulated stages' calibrated steps); the
               prefill pipeline's steps in flight on average over the run
               (``prefill_steps_in_flight``: the real engines' accounts over the replay's window,
               the simulated pipelines' over the simulated time);
               a table on stdout, the document in ``--out``, and
               an overlay plot in ``--plot`` (TTFT CDF real vs simulated and token shares, per load)

Usage (CPU; a GPU scenario the same way, e.g. ``--scenario h200-tiny``):

    python bench/fidelity.py --scenario cpu-tiny --loads 2,3,4 --duration 40 --token-scale 1/32 \
        --set workload.max_output_tokens=64 --out bench/results/fidelity-cpu.json --plot docs/img/fidelity-cpu.png

``--work DIR`` keeps every load's replay there; ``--reuse`` takes a load's replay (and the
calibration) from it when present, so loads can be run one command at a time and compared together.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

from kvpool.backend.serve.engine_accounts import engine_urls, stack_cost, stage_time, time_accounts
from kvpool.sim.replay_fit import stage_us_per_token

ROOT = Path(__file__).resolve().parents[1]
KVPOOL = [sys.executable, "-m", "kvpool.cli"]
SHARES = ("share_gpu", "share_pool", "share_computed")
RELATIVE = ("ttft_p50_s", "ttft_p90_s", "throughput_tok_s", "gen_speed_per_user_tok_s_p50")


def log(msg: str) -> None:
    print(f"[fidelity] {msg}", file=sys.stderr, flush=True)


def overrides(a) -> list[str]:
    return [*a.sets, f"workload.token_scale={float(Fraction(a.token_scale))!r}", f"workload.duration_s={a.duration!r}"]


def calibrate(a, work: Path) -> Path:
    from kvpool.backend.serve.launch import start_serve

    path = work / "calibration.json"
    if a.calibration:
        return Path(a.calibration)
    if a.reuse and path.exists():
        return path
    served = start_serve(a.scenario, a.sets, work / "serve-calibrate")
    url = served.url
    replay = []
    if a.calibration_traces:
        replay = ["--replay-traces", a.calibration_traces, "--replay-sessions", str(a.calibration_sessions),
                  "--run-dir", str(served.run_dir)]
    sets = [*a.sets, f"workload.token_scale={float(Fraction(a.token_scale))!r}"]
    try:
        log(f"calibrating {url}")
        subprocess.run([*KVPOOL, "calibrate", a.scenario, "--url", url, "--out", str(path), *replay,
                        *sum((["--set", x] for x in sets), [])], check=True)
    finally:
        served.stop()
    return path


def held_out(caldoc: dict, cal: Path, traces: str) -> None:
    """Exit with one error line when the calibration's replay phase replayed any of ``traces``' files."""
    from kvpool.backend.serve.calibrate_replay import replayed_files

    seen = replayed_files(caldoc, traces)
    if seen:
        print(f"error: --traces {traces}: {', '.join(seen)} replayed by the calibration {cal} (its replay.files): "
              "a prediction holds out the traces it is calibrated on", file=sys.stderr)
        sys.exit(2)


def real_load(a, work: Path, load: int) -> tuple[dict, list[dict], dict | None]:
    """A load's real run: the replay's summary, its records and the engines' time accounts
    (``engine_accounts.stack_cost``; None for a kept replay whose summary has none)."""
    from kvpool.backend.serve.launch import start_serve

    where = work / f"real-{load}"
    done = where / "summary.json"
    if not (a.reuse and done.exists()):
        shutil.rmtree(where / "replay", ignore_errors=True)  # an earlier replay's records are not this one's
        where.mkdir(parents=True, exist_ok=True)
        served = start_serve(a.scenario, a.sets, where / "serve")
        url = served.url
        try:
            log(f"replaying {load} sessions against {url}")
            cmd = [*KVPOOL, "replay", a.scenario, "--url", url, "--traces", a.traces, "--sessions", str(load),
                   "--out", str(where / "replay"), "--json", *sum((["--set", x] for x in overrides(a)), [])]
            urls = engine_urls(served.run_dir)
            before, t0 = time_accounts(urls), time.monotonic()
            doc = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            after = time_accounts(urls)
            stack = {**stack_cost(before, after, time.monotonic() - t0), "stage_time": stage_time(before, after)}
        finally:
            served.stop()
        jsonl = next((where / "replay").glob("*.jsonl"))
        done.write_text(json.dumps({"summary": doc["results"][0], "jsonl": str(jsonl.relative_to(where)),
                                    "stack": stack}))
    kept = json.loads(done.read_text())
    records = [json.loads(line) for line in (where / kept["jsonl"]).read_text().splitlines() if line.strip()]
    return kept["summary"], records, kept.get("stack")


def simulated(a, cal: Path, loads: list[int]) -> list[tuple[dict, list[dict], list[str], float | None, float | None]]:
    from kvpool.scenario.load import load_scenario
    from kvpool.sim.engine import Simulation
    from kvpool.sim.run import make_replay, run_point, workload_for

    out = []
    for load in loads:
        s = load_scenario(a.scenario, [*overrides(a), 'cost.kv_capacity="serve"', f'cost.calibration="{cal}"',
                                       'workload.mode="agentx"', f"workload.sessions={load}"])
        row = run_point(s, load, a.traces)
        sim = Simulation(s, make_replay(s, workload_for(s, a.traces), load))
        recs = [r.as_dict() for r in sim.run()]
        out.append((row, recs, row.get("cost_notes", []), stage_us_per_token(sim),
                    simulated_steps_in_flight(sim)))
    return out


def simulated_steps_in_flight(sim) -> float | None:
    """The simulated prefill pipelines' steps in flight, on average over the run (summed over the
    instances): the time integral of the steps that left stage 0's start and not the last stage."""
    return sum(p.steps_in_flight_s for p in sim.prefills) / sim.env.now if sim.env.now > 0 else None


def real_steps_in_flight(stack: dict | None) -> float | None:
    """The real prefill engines' steps in flight, on average over the replay's window (summed over
    the engines): ``kvpool:prefill_steps_in_flight_seconds`` over the window."""
    engines = [e for e in (stack or {}).get("engines", {}).values() if "mean_steps_in_flight" in e]
    if not engines or not stack.get("window_s"):
        return None
    in_flight_s = sum((e["mean_steps_in_flight"] or 0.0) * e["pending_s"] for e in engines)
    return in_flight_s / stack["window_s"]


def real_stage_us_per_token(stack: dict | None, records: list[dict]) -> float | None:
    """The real prefill stages' forward time per computed token: per prefill engine the mean over
    its stages of ``kvpool:prefill_stage_forward_seconds`` in the replay's window (``stack``),
    summed, over the tokens the replay's requests computed. The hops between stages are not in it."""
    engines = [e for e in (stack or {}).get("engines", {}).values() if e.get("stage_forward_s")]
    tokens = sum(r.get("computed_tokens", 0) for r in records)
    if not engines or not tokens:
        return None
    return 1e6 * sum(statistics.fmean(e["stage_forward_s"]) for e in engines) / tokens


def real_stage_step_us_per_token(stack: dict | None) -> float | None:
    """The real prefill stages' step time per computed token: their compute calls' round trips less
    their waits behind earlier steps (``engine_accounts.stage_time``, the figure ``sim.replay_fit``
    matches), over the tokens the engines computed in steps; None for a kept replay without it."""
    p = ((stack or {}).get("stage_time") or {}).get("prefill") or {}
    return 1e6 * p["stage_s"] / p["step_tokens"] if p.get("step_tokens") else None


def ttfts(records: list[dict], cutoff_s: float | None = None) -> list[float]:
    return sorted(r["first_token_s"] - r["arrival_s"] for r in records
                  if r.get("measured") and not r.get("rejected") and not r.get("error") and r.get("end_s", 0) > 0
                  and (cutoff_s is None or r["end_s"] <= cutoff_s))


def phases(records: list[dict]) -> dict:
    """Where a run's requests spent their time, to say which mechanism differs: medians of the
    prefill window, the hand-off and the time per output token, and over the run (first arrival
    to last end) the time-averaged requests in their prefill window and sequences decoding.
    Every request that reached its first token counts (warm-up turns too: they load the workers)."""
    done = [r for r in records if r.get("first_token_s", -1) >= 0 and r.get("end_s", 0) > 0 and not r.get("error")]
    if not done:
        return {}
    t0, t1 = min(r["arrival_s"] for r in done), max(r["end_s"] for r in done)
    per_token = [(r["end_s"] - r["first_token_s"]) / (r["out_tokens"] - 1) for r in done if r["out_tokens"] > 1]
    return {"requests": len(done),
            "prefill_window_s_p50": statistics.median(r["prefill_end_s"] - r["prefill_start_s"] for r in done),
            "handoff_s_p50": statistics.median(r["handoff_s"] for r in done),
            "time_per_output_token_s_p50": statistics.median(per_token) if per_token else None,
            "in_prefill_mean": _time_average([(r["prefill_start_s"], r["prefill_end_s"]) for r in done], t0, t1),
            "decoding_mean": _time_average([(r["first_token_s"], r["end_s"]) for r in done], t0, t1)}


def _time_average(spans: list[tuple[float, float]], t0: float, t1: float) -> float:
    """How many of ``spans`` are open at once, on average over [t0, t1]."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans) / (t1 - t0) if t1 > t0 else 0.0


def compare(real: dict, sim: dict) -> dict:
    row = {}
    for k in SHARES:
        row[k] = {"real": real[k], "sim": sim[k], "error_points": 100 * (sim[k] - real[k])}
    for k in RELATIVE:
        row[k] = {"real": real[k], "sim": sim[k],
                  "error_pct": 100 * (sim[k] - real[k]) / real[k] if real[k] else None}
    row["requests"] = {"real": real["requests"], "sim": sim["requests"]}
    return row


def print_table(rows: list[dict]) -> None:
    head = f"{'sessions':>8} {'requests':>9} {'GPU %':>15} {'pool %':>15} {'computed %':>15} {'TTFT p50 s':>20} " \
           f"{'TTFT p90 s':>20} {'tok/s':>20} {'tok/s/user p50':>20}"
    print(head)
    print("-" * len(head))
    for r in rows:
        c = r["compare"]
        sh = [f"{100 * c[k]['real']:5.1f}/{100 * c[k]['sim']:5.1f} {c[k]['error_points']:+4.1f}" for k in SHARES]
        rel = [f"{c[k]['real']:6.2f}/{c[k]['sim']:6.2f} {c[k]['error_pct'] or 0:+5.0f}%" for k in RELATIVE]
        print(f"{r['sessions']:>8} {c['requests']['real']:>4}/{c['requests']['sim']:<4} " + " ".join(f"{x:>15}" for x in sh)
              + " " + " ".join(f"{x:>20}" for x in rel))
    print("(real/simulated, then the error: points for shares, % for TTFT, throughput and decode speed per user)")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(rows)
    fig, axes = plt.subplots(2, n, figsize=(4.2 * n, 7), squeeze=False)
    for i, r in enumerate(rows):
        ax = axes[0][i]
        for name, xs, style in (("real", r["ttft_real"], "-"), ("simulated", r["ttft_sim"], "--")):
            if xs:
                ax.step(xs, [(k + 1) / len(xs) for k in range(len(xs))], style, where="post", label=name)
        ax.set_title(f"{r['sessions']} sessions: TTFT CDF")
        ax.set_xlabel("TTFT, s")
        ax.set_ylim(0, 1.02)
        ax.legend(loc="lower right")
        ax = axes[1][i]
        c = r["compare"]
        x = range(len(SHARES))
        ax.bar([k - 0.2 for k in x], [100 * c[k]["real"] for k in SHARES], 0.4, label="real")
        ax.bar([k + 0.2 for k in x], [100 * c[k]["sim"] for k in SHARES], 0.4, label="simulated")
        ax.set_xticks(list(x), ["GPU", "pool", "computed"])
        ax.set_ylabel("% of prompt tokens")
        ax.set_title(f"{r['sessions']} sessions: token sources")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="cpu-tiny")
    p.add_argument("--traces", default=str(ROOT / "tests/data/traces/kv-cache-tester"))
    p.add_argument("--loads", default="2,3,4", help="AgentX sessions per load, comma-separated")
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--token-scale", default="1/32")
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--calibration", default=None, help="use this calibration file instead of calibrating first")
    p.add_argument("--calibration-traces", default=None,
                   help="the calibration replays these traces (never --traces' files) and scales its prefill grid to them")
    p.add_argument("--calibration-sessions", type=int, default=8, help="AgentX lanes of the calibration's replay")
    p.add_argument("--work", default=None, help="keep the replays and the calibration here (default: out/fidelity-SCENARIO)")
    p.add_argument("--reuse", action="store_true", help="take a load's replay (and the calibration) from --work when present")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args()
    loads = [int(x) for x in a.loads.split(",") if x.strip()]
    work = Path(a.work or f"out/fidelity-{a.scenario}")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cal = calibrate(a, work)
    caldoc = json.loads(Path(cal).read_text())
    held_out(caldoc, cal, a.traces)
    if caldoc.get("replay"):
        log(f"calibration {cal}: prefill.replay_scale {caldoc['prefill'].get('replay_scale', 1.0):.3f} "
            f"from a replay of {caldoc['replay']['traces']}")
    reals = [real_load(a, work, n) for n in loads]
    sims = simulated(a, cal, loads)
    rows = []
    for n, (real, rrecs, stack), (srow, srecs, notes, sim_stage_us, sim_in_flight) in zip(loads, reals, sims):
        rows.append({"sessions": n, "compare": compare(real, srow), "cost_notes": notes,
                     "phases": {"real": phases(rrecs), "sim": phases(srecs)}, "stack_real": stack,
                     "prefill_stage_us_per_token": {"real": real_stage_us_per_token(stack, rrecs),
                                                    "real_stage": real_stage_step_us_per_token(stack), "sim": sim_stage_us},
                     "prefill_steps_in_flight": {"real": real_steps_in_flight(stack), "sim": sim_in_flight},
                     "ttft_real": ttfts(rrecs), "ttft_sim": ttfts(srecs)})
    print_table(rows)
    for r in rows:
        stage = r["prefill_stage_us_per_token"]
        if stage["real"] is not None and stage["sim"] is not None:
            step = "" if stage["real_stage"] is None else f", {stage['real_stage']:.1f} us its steps' round trips"
            print(f"sessions {r['sessions']}: a prefill stage per computed token: real {stage['real']:.1f} us "
                  f"(its forward alone{step}), simulated {stage['sim']:.1f} us (calibrated cells, hops included)")
        fill = r["prefill_steps_in_flight"]
        if fill["real"] is not None and fill["sim"] is not None:
            print(f"sessions {r['sessions']}: prefill steps in flight on average: real {fill['real']:.2f}, "
                  f"simulated {fill['sim']:.2f}")
    for r in rows:
        for line in r["cost_notes"]:
            print(f"note: sessions {r['sessions']}: {line}")
    replay = caldoc.get("replay") or {}
    doc = {"scenario": a.scenario, "traces": a.traces, "loads": loads, "duration_s": a.duration,
           "token_scale": a.token_scale, "sets": a.sets, "calibration": str(cal),
           "calibration_replay": {"traces": replay.get("traces"), "files": [f["name"] for f in replay.get("files", [])],
                                  "sessions": replay.get("sessions"),
                                  "prefill_replay_scale": caldoc["prefill"].get("replay_scale")} if replay else None,
           "device": caldoc.get("device"), "kvpool_version": caldoc.get("kvpool_version"),
           "rows": [{k: v for k, v in r.items()} for r in rows], "wall_s": time.perf_counter() - t0}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
        log(f"wrote {a.out}")
    if a.plot:
        plot(rows, Path(a.plot), f"{a.scenario} on {caldoc.get('device', {}).get('name', '?')}: real vs simulated")
        log(f"wrote {a.plot}")


if __name__ == "__main__":
    main()
