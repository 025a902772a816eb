"""kvpool sim run / compare / plan through the installed CLI, on small runs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from trace_builders import KV_TRACES

KVPOOL = shutil.which("kvpool", path=str(Path(sys.executable).parent)) or "kvpool"
TRACE = str(KV_TRACES / "trace_0002.json.gz")
SMALL = ["--duration", "300", "--traces", TRACE, "--set", "workload.warmup_requests=1"]


def run(*args, cwd=None):
    return subprocess.run([KVPOOL, *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "COLUMNS": "160"})


def test_run_json_has_the_documented_keys(tmp_path):
    r = run("sim", "run", "mi355x-1p1d", "--sessions", "3,4", *SMALL, "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [x["sessions"] for x in rows] == [3, 4]
    keys = {"sessions", "duration_s", "gpus", "requests", "throughput_tok_s", "throughput_per_gpu_tok_s",
            "ttft_p50_s", "ttft_p90_s", "share_gpu", "share_pool", "share_computed", "reuse",
            "gen_speed_per_user_tok_s_p50", "decode_kv_occupancy_p50", "restore_stage_s_p50",
            "restore_spread_s_mean", "bytes_moved", "wall_s"}
    for x in rows:
        assert keys <= set(x)
        assert abs(x["share_gpu"] + x["share_pool"] + x["share_computed"] - 1) < 1e-9
        assert x["reuse"] == x["share_gpu"] + x["share_pool"]
    files = {p.name for p in tmp_path.iterdir()}
    assert {"mi355x-1p1d-sessions-3-4.json", "mi355x-1p1d-sessions-3-4.csv", "mi355x-1p1d-sessions-3-4.png"} <= files
    saved = json.loads((tmp_path / "mi355x-1p1d-sessions-3-4.json").read_text())
    strip = lambda xs: [{k: v for k, v in x.items() if k not in ("wall_s", "cpu_s", "sim_s_per_wall_s")} for x in xs]  # noqa: E731
    assert strip(saved) == strip(rows)  # the file holds what --json printed


def test_bad_flags_are_one_clear_line(tmp_path):
    for args, needle in [
        (["--sessions", "56,x"], "--sessions '56,x': 'x' is not an integer"),
        (["--sessions", "0"], "every value must be > 0"),
        (["--sessions", "4", "--rps", "1"], "not both"),
        (["--sessions", "4", "--traces", str(tmp_path / "nope")], "no such file or directory"),
        (["--sessions", "4", "--set", "pool.mode=mirror"], "pool.mode: value 'mirror'"),
        (["--duration", "-1"], "--duration -1: must be > 0"),
        (["--sessions", "4", "--traces", TRACE, "--set", "workload.context_scale=0.5"],
         "workload.context_scale=0.5 applies to the synthetic presets only"),
        (["--sessions", "4", "--set", "workload.context_scale=0"], "workload.context_scale"),
    ]:
        r = run("sim", "run", "mi355x-1p1d", *args, "--out", str(tmp_path))
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_compare_two_arms(tmp_path):
    r = run("sim", "compare", "mi355x-1p1d", str(_no_pool(tmp_path)), "--sessions", "3", *SMALL, "--json",
            "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    arms = json.loads(r.stdout)
    assert set(arms) == {"mi355x-1p1d", "no-pool"}
    assert arms["no-pool"][0]["share_pool"] == 0.0
    assert (tmp_path / "compare-mi355x-1p1d-vs-no-pool.png").is_file()


def _no_pool(tmp_path: Path) -> Path:
    text = run("scenario", "show", "mi355x-1p1d", "--toml").stdout
    p = tmp_path / "no-pool.toml"
    p.write_text(text.replace('name = "mi355x-1p1d"', 'name = "no-pool"').replace("gib_per_service = 768.0", "gib_per_service = 0.0"))
    return p


def test_plan_finds_the_threshold_and_reports_the_curve(tmp_path):
    r = run("sim", "plan", "mi355x-1p1d", "--target", "reuse>=0.5", "--vary", "pool.gib_per_service=0..768",
            "--load", "3", *SMALL, "--set", "prefill.gpu_mem_utilization=0.4", "--workers", "2", "--max-runs", "8",
            "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["direction"] == "minimize" and res["runs"] == len(res["curve"]) <= 8
    passing = [c["value"] for c in res["curve"] if c["meets_targets"]]
    failing = [c["value"] for c in res["curve"] if not c["meets_targets"]]
    assert 0 in failing and 768 in passing  # no pool and no GPU cache: nothing reused
    assert res["best"] == min(passing) and all(f < res["best"] for f in failing)


def test_plan_bad_target_and_vary(tmp_path):
    r = run("sim", "plan", "mi355x-1p1d", "--target", "speed>=1", "--vary", "pool.gib_per_service=0..10")
    assert r.returncode == 2 and "unknown metric 'speed'" in r.stderr
    r = run("sim", "plan", "mi355x-1p1d", "--target", "reuse>=0.9", "--vary", "pool.nope=0..10")
    assert r.returncode == 2 and "pool has no field 'nope'" in r.stderr
