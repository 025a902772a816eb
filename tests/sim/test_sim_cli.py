"""kvpool sim run / compare / plan through the installed CLI, on small runs."""

import hashlib
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


WALL_CLOCK = {"wall_s", "cpu_s", "sim_s_per_wall_s"}


def test_run_json_has_the_documented_keys(tmp_path):
    r = run("sim", "run", "mi355x-1p1d", "--sessions", "3,4", *SMALL, "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert list(doc) == ["id", "provenance", "results", "run"]
    rows = doc["results"]
    assert [x["sessions"] for x in rows] == [3, 4]
    keys = {"sessions", "duration_s", "gpus", "requests", "throughput_tok_s", "throughput_per_gpu_tok_s",
            "ttft_p50_s", "ttft_p90_s", "share_gpu", "share_pool", "share_computed", "reuse",
            "gen_speed_per_user_tok_s_p50", "decode_kv_occupancy_p50", "restore_stage_s_p50",
            "restore_spread_s_mean", "bytes_moved"}
    for x in rows:
        assert keys <= set(x) and not WALL_CLOCK & set(x)  # the wall clock is in the run block
        assert abs(x["share_gpu"] + x["share_pool"] + x["share_computed"] - 1) < 1e-9
        assert x["reuse"] == x["share_gpu"] + x["share_pool"]
    assert [set(x) for x in doc["run"]["loads"]] == [{"sessions"} | WALL_CLOCK] * 2
    assert [x["sessions"] for x in doc["run"]["loads"]] == [3, 4] and all(x["wall_s"] > 0 for x in doc["run"]["loads"])
    stem = f"mi355x-1p1d-sessions-3-4-{doc['id']}"
    files = {p.name for p in tmp_path.iterdir()}
    assert {f"{stem}.json", f"{stem}.csv", f"{stem}.png"} <= files
    assert json.loads((tmp_path / f"{stem}.json").read_text()) == doc  # the file holds what --json printed
    assert not WALL_CLOCK & set((tmp_path / f"{stem}.csv").read_text().splitlines()[0].split(","))


def test_provenance_records_every_input(tmp_path):
    from importlib.metadata import version

    from kvpool.scenario import load_scenario
    from kvpool.sim.provenance import scenario_sha256, short_id

    r = run("sim", "run", "mi355x-1p1d", "--sessions", "3", *SMALL, "--seed", "7", "--set", "pool.gib_per_service=64",
            "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    p = doc["provenance"]
    overrides = ["workload.warmup_requests=1", "pool.gib_per_service=64", "workload.duration_s=300.0", "seed=7",
                 'workload.mode="agentx"']
    assert p["scenario"] == {"name": "mi355x-1p1d", "source": "mi355x-1p1d",
                             "sha256": scenario_sha256(load_scenario("mi355x-1p1d", overrides))}
    assert p["set"] == ["workload.warmup_requests=1", "pool.gib_per_service=64"] and p["overrides"] == overrides
    assert p["seed"] == 7 and p["duration_s"] == 300.0 and p["mode"] == "agentx" and p["loads"] == {"sessions": [3]}
    digest = hashlib.sha256(Path(TRACE).read_bytes()).hexdigest()
    assert p["workload"] == {"kind": "traces", "path": TRACE, "files": 1, "sha256": digest}
    assert p["kvpool_version"] == version("kvpool") and doc["id"] == short_id(p)
    assert (tmp_path / f"mi355x-1p1d-sessions-3-{doc['id']}.json").is_file()
    r = run("sim", "run", "mi355x-1p1d", "--sessions", "3", *SMALL, "--out", str(tmp_path))
    title = r.stdout.splitlines()[0]
    assert "traces trace_0002.json.gz" in title and "agentx" not in title, title  # a trace replay says so


def test_synthetic_provenance_names_the_preset(tmp_path):
    r = run("sim", "run", "mi355x-1p1d", "--sessions", "2", "--duration", "60", "--set", "workload.synthetic_sessions=3",
            "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["provenance"]["workload"] == {"kind": "synthetic", "preset": "agentx-062126",
                                                              "sessions": 3, "context_scale": 1.0}


def test_different_inputs_never_share_a_file_and_equal_inputs_give_equal_results(tmp_path):
    base = ["sim", "run", "mi355x-1p1d", "--sessions", "3", *SMALL, "--out", str(tmp_path)]
    runs = {}
    for extra in ([], [], ["--duration", "200"], ["--seed", "1"], ["--set", "pool.gib_per_service=64"]):
        r = run(*base, *extra, "--json")
        assert r.returncode == 0, r.stderr
        runs.setdefault(tuple(extra), []).append(json.loads(r.stdout))
    ids = [docs[0]["id"] for docs in runs.values()]
    assert len(set(ids)) == len(ids) == 4  # every different input has its own name
    files = sorted(p.name for p in tmp_path.glob("*.json"))
    assert files == sorted(f"mi355x-1p1d-sessions-3-{i}.json" for i in ids)
    one, two = runs[()]
    strip = lambda d: json.dumps({k: v for k, v in d.items() if k != "run"}, indent=2)  # noqa: E731
    assert strip(one) == strip(two)  # byte-identical outside the run block
    saved = json.loads((tmp_path / f"mi355x-1p1d-sessions-3-{one['id']}.json").read_text())
    assert strip(saved) == strip(one)


def test_a_window_shorter_than_a_request_warns(tmp_path):
    r = run("sim", "run", "mi355x-1p1d", "--rps", "0.6", "--duration", "60", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert ("warning: rps 0.6: no request finished inside the 60 s window" in r.stderr
            and "the window is shorter than one request takes; give a longer --duration" in r.stderr), r.stderr
    r = run("sim", "run", "mi355x-1p1d", "--rps", "0.6", "--duration", "60", "--json", "--out", str(tmp_path))
    assert json.loads(r.stdout)["warnings"][0].startswith("rps 0.6: no request finished") and "warning:" in r.stderr


def test_prompts_larger_than_the_prefill_kv_fail_and_the_run_says_why(tmp_path):
    """A prefill KV of 28,735 tokens (utilization 0.47) against prompts of up to ~70K tokens: those
    requests fail as the engine refuses them, and the run says how many, the largest prompt and
    the capacity."""
    r = run("sim", "run", "mi355x-1p1d", "--sessions", "3", *SMALL, "--set", "prefill.gpu_mem_utilization=0.47",
            "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (line,) = [w for w in doc["warnings"] if "prefill instance's KV" in w]
    failed = int(line.split(": ", 1)[1].split(" of ")[0])
    assert failed > 0 and doc["results"][0]["errors"] >= 1 and "(28,735 tokens, derived from HBM" in line, line
    assert "prefill instance's KV" in r.stderr


def test_a_measured_run_has_no_warning(tmp_path):
    r = run("sim", "run", "mi355x-1p1d", "--sessions", "3", *SMALL, "--json", "--out", str(tmp_path))
    assert r.returncode == 0 and "warning" not in r.stderr and "warnings" not in json.loads(r.stdout), r.stderr


def test_degenerate_reasons():
    from kvpool.sim.report import degenerate_reason

    row = {"sessions": 4, "duration_s": 600.0, "requests": 1, "ttft_p50_s": 448.0, "simulated_s": 900.0}
    assert "only 1 request finished inside the 600 s window (TTFT p50 448.0 s)" in degenerate_reason(row)
    assert "more than a quarter of the 600 s window" in degenerate_reason({**row, "requests": 50})
    assert degenerate_reason({**row, "requests": 50, "ttft_p50_s": 2.0}) is None


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
    doc = json.loads(r.stdout)
    arms = doc["arms"]
    assert set(arms) == {"mi355x-1p1d", "no-pool"} == set(doc["provenance"]["arms"]) == set(doc["run"]["arms"])
    assert arms["no-pool"][0]["share_pool"] == 0.0 and not WALL_CLOCK & set(arms["no-pool"][0])
    assert doc["provenance"]["arms"]["no-pool"]["scenario"]["source"] == str(_no_pool(tmp_path))
    assert (tmp_path / f"compare-mi355x-1p1d-vs-no-pool-{doc['id']}.png").is_file()
    ratio = doc["ratios"]["over"]["no-pool"][0]
    assert doc["ratios"]["reference"] == "mi355x-1p1d" and ratio["sessions"] == 3
    assert ratio["throughput_tok_s"] == arms["mi355x-1p1d"][0]["throughput_tok_s"] / arms["no-pool"][0]["throughput_tok_s"]
    lines = (tmp_path / f"compare-mi355x-1p1d-vs-no-pool-{doc['id']}.csv").read_text().splitlines()
    head = lines[0].split(",")
    assert head[:3] == ["arm", "reference", "sessions"] and len(lines) == 3
    assert {"throughput_tok_s", "throughput_per_gpu_tok_s", "reference_over_arm_throughput_tok_s"} <= set(head)


def _no_pool(tmp_path: Path) -> Path:
    text = run("scenario", "show", "mi355x-1p1d", "--toml").stdout
    p = tmp_path / "no-pool.toml"
    p.write_text(text.replace('name = "mi355x-1p1d"', 'name = "no-pool"').replace("gib_per_service = 768.0", "gib_per_service = 0.0"))
    return p


def test_plan_finds_the_threshold_and_reports_the_curve(tmp_path):
    r = run("sim", "plan", "mi355x-1p1d", "--target", "reuse>=0.9", "--vary", "pool.gib_per_service=0..768",
            "--load", "3", *SMALL, "--set", "prefill.gpu_mem_utilization=0.472", "--workers", "2", "--max-runs", "8",
            "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["direction"] == "minimize" and res["runs"] == len(res["curve"]) <= 8
    passing = [c["value"] for c in res["curve"] if c["meets_targets"]]
    failing = [c["value"] for c in res["curve"] if not c["meets_targets"]]
    assert 0 in failing and 768 in passing  # no pool and a GPU cache of 75K tokens: histories recomputed
    assert res["best"] == min(passing) and all(f < res["best"] for f in failing)
    assert res["provenance"]["search"]["vary"] == "pool.gib_per_service=0..768" and "failed" not in res
    assert [p["value"] for p in res["run"]["points"]] == [c["value"] for c in res["curve"]]


def test_plan_without_an_answer_exits_1_naming_the_target_that_failed(tmp_path):
    args = ["sim", "plan", "mi355x-1p1d", "--target", "reuse>=0.9", "--target", "ttft_p90_s<=0.001",
            "--vary", "pool.gib_per_service=0..768", "--load", "3", *SMALL, "--set", "prefill.gpu_mem_utilization=0.472",
            "--workers", "2", "--max-runs", "4", "--out", str(tmp_path)]
    r = run(*args)
    assert r.returncode == 1, r.stderr
    assert "error: no value of pool.gib_per_service in 0..768 GiB meets every target:" in r.stderr, r.stderr
    assert "ttft_p90_s<=0.001 fails at every value tried (0..768): closest ttft_p90_s=" in r.stderr, r.stderr
    assert "reuse>=0.9 fails at 0 (reuse=0." in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run(*args, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["best"] is None
    assert any(x.startswith("ttft_p90_s<=0.001 fails at every value") for x in json.loads(r.stdout)["failed"])


def test_plan_bad_target_and_vary(tmp_path):
    r = run("sim", "plan", "mi355x-1p1d", "--target", "speed>=1", "--vary", "pool.gib_per_service=0..10")
    assert r.returncode == 2 and "unknown metric 'speed'" in r.stderr
    r = run("sim", "plan", "mi355x-1p1d", "--target", "reuse>=0.9", "--vary", "pool.nope=0..10")
    assert r.returncode == 2 and "pool has no field 'nope'" in r.stderr


def test_usage_errors_are_one_error_line_with_status_2():
    for args, needle in [
        (["sim", "run", "--bogus"], "error: No such option: --bogus"),
        (["sim", "plan", "mi355x-1p1d"], "error: Missing option '--target'"),
        (["sim", "run", "--duration", "abc"], "error: Invalid value for '--duration'"),
        (["sim", "nope"], "error: No such command 'nope'"),
    ]:
        r = run(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(needle), (args, r.stderr)
        assert lines[0].endswith(f"(see kvpool {args[0]}{' ' + args[1] if args[1] != 'nope' else ''} --help)"), lines


def test_building_a_synthetic_workload_reports_each_session_once(tmp_path, monkeypatch):
    """The first run's workload build advances its progress once per session; a second build of
    the same workload comes from memory or the cache and reports nothing."""
    from kvpool.scenario import load_scenario
    from kvpool.sim import run as run_mod

    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(run_mod, "_synthetic_kept", {})
    s = load_scenario("mi355x-1p1d", ["workload.synthetic_sessions=7", "seed=12345"])
    seen: list[int] = []
    w = run_mod.build_synthetic(s, on_session=seen.append)
    assert seen == list(range(7)) and len(w.sessions) == 7
    assert run_mod.build_synthetic(s, on_session=seen.append) is w and seen == list(range(7))
    assert run_mod.workload_for(s) is w
