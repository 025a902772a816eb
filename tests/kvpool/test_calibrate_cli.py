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
    written = json.loads(out.read_text())
    assert written["handoff"] == json.loads(json.dumps(refit(doc)["handoff"])) and "refitted_utc" in written
    assert load_calibration(out).handoff_fixed_s == written["handoff"]["fit"]["fixed_s"]
    assert json.loads(src.read_text()) == doc  # the measured file stays as it was


def test_a_file_without_its_samples_is_one_error_line(tmp_path):
    doc = json.loads(FILE.read_text())
    del doc["handoff"]["samples"][0]["bytes"]
    src = tmp_path / "cal.json"
    src.write_text(json.dumps(doc))
    code, _, stderr, _ = cli("calibrate", "--refit", str(src), "--out", str(tmp_path / "new.json"))
    assert code == 2 and stderr.startswith(f"error: {src}: cannot refit") and len(stderr.splitlines()) == 1
    assert not (tmp_path / "new.json").exists()
