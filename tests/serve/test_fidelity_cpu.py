"""Fidelity on the CPU: a short replay against a real ``kvpool serve cpu-tiny`` and the simulator's run of
the same workload on the calibrated scenario agree on where the prompt tokens came from.

The calibration (``tests/data/calibration/cpu-tiny.json``) was written by ``kvpool calibrate
cpu-tiny`` on its own synthetic prompts, so the traces replayed here are held out. The simulator
runs with the deployment's serve capacities and page discipline (``cost.kv_capacity = "serve"``: a
request holds pages for its whole prompt while in flight, ``sim.steps.pages``) and the replay's
prompt scaling (``workload.token_scale``), the mechanisms that otherwise differ. At 3 sessions the
prefill KV fills: a request waits for pages, and what the cache keeps depends on which request
released its pages first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "tests" / "data" / "traces" / "kv-cache-tester"
CALIBRATION = ROOT / "tests" / "data" / "calibration" / "cpu-tiny.json"
SETS = ["workload.token_scale=0.03125", "workload.max_output_tokens=16", "workload.duration_s=20.0",
        "workload.grace_s=20.0"]
SESSIONS = 3
SHARES = ("share_gpu", "share_pool", "share_computed")


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The real run's summary and the simulated one's, of the same workload."""
    from kvpool.backend.serve.launch import start_serve
    from kvpool.scenario.load import load_scenario
    from kvpool.sim.run import run_point

    tmp = tmp_path_factory.mktemp("fidelity")
    served = start_serve("cpu-tiny", [], tmp / "serve")
    url = served.url
    try:
        cmd = [sys.executable, "-m", "kvpool.cli", "replay", "cpu-tiny", "--url", url, "--traces", str(TRACES),
               "--sessions", str(SESSIONS), "--out", str(tmp / "replay"), "--json"]
        for x in SETS:
            cmd += ["--set", x]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    finally:
        served.stop()
    assert done.returncode == 0, done.stderr[-2000:]
    real = json.loads(done.stdout)["results"][0]
    s = load_scenario("cpu-tiny", [*SETS, 'cost.kv_capacity="serve"', f'cost.calibration="{CALIBRATION}"',
                                   f"workload.sessions={SESSIONS}"])
    return real, run_point(s, SESSIONS, str(TRACES))


@pytest.mark.timeout(240)
def test_computed_and_reused_tokens_are_within_two_points_of_the_real_run(both):
    real, sim = both
    assert real["requests"] >= 3 and real["errors"] == 0
    assert sim["requests"] == real["requests"] and sim["prompt_tokens"] == real["prompt_tokens"]
    assert real["share_pool"] > 0.2 and real["share_gpu"] > 0  # every source is exercised
    assert abs(sim["share_computed"] - real["share_computed"]) <= 0.02, (real["share_computed"], sim["share_computed"])
    assert abs(sim["reuse"] - real["reuse"]) <= 0.02, (real["reuse"], sim["reuse"])


@pytest.mark.timeout(240)
def test_gpu_and_pool_shares_are_within_two_points_of_the_real_run(both):
    real, sim = both
    for k in SHARES:
        assert abs(sim[k] - real[k]) <= 0.02, (k, real[k], sim[k])


def test_a_prediction_holds_out_the_traces_its_calibration_replayed(tmp_path):
    from kvpool.backend.serve.calibrate_replay import replayed_files, trace_digests

    split = ROOT / "tests" / "data" / "traces" / "kv-cache-tester-split"
    calibrated = {"replay": {"files": trace_digests(split / "calibration")}}
    assert replayed_files(calibrated, split / "predicted") == []  # the split is disjoint, by content
    assert replayed_files(calibrated, TRACES) == [f["name"] for f in calibrated["replay"]["files"]]
    assert replayed_files({}, TRACES) == []  # a calibration without a replay phase replayed nothing
    doc = json.loads(CALIBRATION.read_text())
    doc["replay"] = {"files": trace_digests(split / "predicted")[:1]}
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(doc))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "fidelity.py"), "--calibration", str(cal), "--traces",
                           str(split / "predicted"), "--work", str(tmp_path / "work"), "--loads", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"error: --traces {split / 'predicted'}: trace_0002.json.gz replayed by the calibration {cal} (its replay.files): "
        "a prediction holds out the traces it is calibrated on"]
