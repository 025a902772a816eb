"""The dashboard's numbers are the CLI's numbers; ``kvpool dashboard`` serves on 127.0.0.1 only."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from conftest import SMALL_DURATION_S, SMALL_LOADS, SMALL_SYNTHETIC, press, set_run

from kvpool.dashboard import knobs, results

KVPOOL = str(Path(sys.executable).with_name("kvpool"))


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if a is None or b is None:
        return (a is None or (isinstance(a, float) and math.isnan(a))) and (b is None or (isinstance(b, float) and math.isnan(b)))
    return a == b


def test_a_dashboard_sweep_and_the_cli_give_identical_numbers(app, tmp_path):
    app.switch_page("pages/run.py").run()
    set_run(app, workers=2)
    press(app, "Run sweep")
    assert not app.exception
    shown = app.dataframe[0].value.to_dict("records")

    cli = subprocess.run(
        [KVPOOL, "sim", "run", "mi355x-1p1d", "--sessions", SMALL_LOADS, "--duration", str(SMALL_DURATION_S),
         "--set", f"workload.synthetic_sessions={SMALL_SYNTHETIC}", "--json", "--out", str(tmp_path)],
        capture_output=True, text=True, check=True,
    )
    expected = json.loads(cli.stdout)
    assert len(shown) == len(expected) == 2
    for got, want in zip(shown, expected):
        keys = set(want) - set(results.WALL_CLOCK_KEYS)
        assert keys <= set(got)
        different = {k: (got[k], want[k]) for k in keys if not _same(got[k], want[k])}
        assert not different, different


def test_the_json_download_has_the_cli_keys():
    rows = [{"scenario": "x", "sessions": 8, "duration_s": 60.0, "requests": 3, "timeline": {}, "restore_stage_s": []}]
    assert json.loads(results.to_json(rows)) == [{"scenario": "x", "sessions": 8, "duration_s": 60.0, "requests": 3}]
    assert results.to_csv(rows).splitlines()[0] == "sessions,duration_s,requests,scenario"
    assert results.stem("x", rows) == "x-sessions-8"


def test_override_text_round_trips_through_the_cli_parser():
    from kvpool.scenario.load import parse_override

    for path, value in [("pool.mode", "split"), ("prefill.stage_layers", [20, 20, 20, 18]), ("gate.enabled", True),
                        ("pool.gib_per_service", 384.0), ("decode.tp", 4)]:
        assert parse_override(knobs.override_text(path, value)) == (path.split("."), value)


def test_field_errors_match_whole_field_names_only():
    lines = ["f: decode.dcp (3) must divide decode.tp (4)", "f: prefill.tp: value 0: bad"]
    assert knobs.field_errors(lines, "decode.tp") == lines[:1]
    assert knobs.field_errors(lines, "prefill.tp") == lines[1:]
    assert knobs.field_errors(lines, "decode.instances") == []


def test_dashboard_command_binds_loopback_headless():
    from kvpool.cli.dashboard import app_file, streamlit_command

    cmd = streamlit_command(8765)
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--server.port") + 1] == "8765"
    assert cmd[cmd.index("--server.headless") + 1] == "true"
    assert app_file().is_file() and app_file().name == "app.py"


def test_dashboard_command_rejects_a_bad_port():
    r = subprocess.run([KVPOOL, "dashboard", "--port", "70000"], capture_output=True, text=True)
    assert r.returncode == 2 and "error: --port 70000: must be 1..65535" in r.stderr
