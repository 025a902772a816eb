"""``kvpool calibrate --refit``: a calibration file's curves refitted from its samples, without a server."""

from __future__ import annotations

import json
from pathlib import Path

from test_fuzz_inputs import cli

from kvpool.sim.calibration import load_calibration

FILE = Path(__file__).resolve().parents[1] / "data" / "calibration" / "cpu-tiny.json"


def test_refit_writes_the_refitted_file_beside_the_old_one_and_says_what_changed(tmp_path):
    from kvpool.backend.serve.calibrate import refit

    doc = json.loads(FILE.read_text())
    doc["handoff"]["fit"]["fixed_s"] = 9.0  # a fit its samples do not give
    src = tmp_path / "cal.json"
    src.write_text(json.dumps(doc))
    code, stdout, stderr, _ = cli("calibrate", "--refit", str(src))
    assert code == 0, stderr
    assert "handoff: 9000.00 ms" in stdout and stdout.rstrip().endswith("cal.refit.json")
    out = tmp_path / "cal.refit.json"
    written = json.loads(out.read_text(), parse_constant=_not_json)  # strict JSON: no Infinity or NaN
    assert written["handoff"] == json.loads(json.dumps(refit(doc)["handoff"])) and "refitted_utc" in written
    assert load_calibration(out).handoff_fixed_s == written["handoff"]["fit"]["fixed_s"]
    assert json.loads(src.read_text()) == doc  # the measured file stays as it was


def _not_json(name: str):
    raise AssertionError(f"{name} is not JSON")


def test_a_transfer_that_costs_no_more_per_byte_is_written_as_json_and_said_so(tmp_path):
    doc = json.loads(FILE.read_text())
    for x in doc["handoff"]["samples"]:
        x["s"] = 0.004  # every hand-off took 4 ms, whatever its bytes
    src = tmp_path / "flat.json"
    src.write_text(json.dumps(doc))
    code, stdout, stderr, _ = cli("calibrate", "--refit", str(src))
    assert code == 0, stderr
    assert "-> 4.00 ms (no measurable cost per byte)" in stdout
    written = json.loads((tmp_path / "flat.refit.json").read_text(), parse_constant=_not_json)
    assert written["handoff"]["gb_s"] is None and written["handoff"]["fit"]["fixed_s"] == 0.004
    assert load_calibration(tmp_path / "flat.refit.json").handoff_fixed_s == 0.004


def test_a_file_without_its_samples_is_one_error_line(tmp_path):
    doc = json.loads(FILE.read_text())
    del doc["handoff"]["samples"][0]["bytes"]
    src = tmp_path / "cal.json"
    src.write_text(json.dumps(doc))
    code, _, stderr, _ = cli("calibrate", "--refit", str(src), "--out", str(tmp_path / "new.json"))
    assert code == 2 and stderr.startswith(f"error: {src}: cannot refit") and len(stderr.splitlines()) == 1
    assert not (tmp_path / "new.json").exists()


def test_a_calibration_whose_server_changed_speed_is_warned_about():
    from kvpool.cli.calibrate import SPEED_DRIFT_LIMIT, speed_drift_warning

    assert speed_drift_warning(None) is None
    assert speed_drift_warning(1.0) is None
    assert speed_drift_warning(SPEED_DRIFT_LIMIT) is None and speed_drift_warning(1 / SPEED_DRIFT_LIMIT) is None
    slower = speed_drift_warning(1.47)
    assert slower is not None and "1.47x" in slower and "sharing.prefill_alone_over_grid" in slower
    assert speed_drift_warning(0.8) is not None


def test_refit_keeps_a_version_3_files_replay_scale_as_measured(tmp_path):
    doc = json.loads(FILE.read_text())
    doc["version"] = 3
    doc["prefill"]["replay_scale"] = 1.2
    doc["replay"] = {"traces": "held-out", "files": [], "prefill": {"stage_us_per_token": 250.0}}
    src = tmp_path / "v3.json"
    src.write_text(json.dumps(doc))
    code, stdout, stderr, _ = cli("calibrate", "--refit", str(src))
    assert code == 0, stderr
    assert "prefill.replay_scale: 1.200, as measured (not refitted)" in stdout
    written = json.loads((tmp_path / "v3.refit.json").read_text())
    assert written["prefill"]["replay_scale"] == 1.2 and written["replay"] == doc["replay"]
    assert load_calibration(tmp_path / "v3.refit.json").prefill_scale == 1.2


def test_a_file_of_an_unknown_version_is_one_error_line(tmp_path):
    doc = json.loads(FILE.read_text())
    doc["version"] = 4
    src = tmp_path / "v4.json"
    src.write_text(json.dumps(doc))
    code, _, stderr, _ = cli("calibrate", "--refit", str(src))
    assert code == 2 and len(stderr.splitlines()) == 1
    assert stderr.startswith(f"error: {src}: field version must be one of 2, 3")


def test_a_replay_phase_it_cannot_run_is_one_error_line_before_any_server_is_started(tmp_path):
    traces = str(FILE.parents[1] / "traces" / "kv-cache-tester-split" / "calibration")
    for argv, message in (
            (["--url", "http://127.0.0.1:1", "--replay-traces", traces], "error: --replay-traces with --url needs --run-dir"),
            (["--replay-traces", str(tmp_path / "none")], "error: --replay-traces: "),
            (["--replay-traces", traces, "--replay-sessions", "0"], "error: --replay-sessions 0: must be at least 1"),
            (["--replay-traces", traces, "--replay-duration", "0"], "error: --replay-duration 0: must be")):
        code, _, stderr, _ = cli("calibrate", "cpu-tiny", *argv, "--out", str(tmp_path / "cal.json"))
        assert code == 2 and stderr.startswith(message) and len(stderr.splitlines()) == 1, (argv, stderr)
    assert not (tmp_path / "cal.json").exists()
