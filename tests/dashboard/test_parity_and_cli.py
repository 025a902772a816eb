"""The dashboard's numbers are the CLI's numbers; ``kvpool dashboard`` serves on 127.0.0.1 only."""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import SMALL_DURATION_S, SMALL_LOADS, SMALL_SYNTHETIC, TRACE, by_label, press, set_plan, set_run

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
    expected = json.loads(cli.stdout)["results"]
    assert len(shown) == len(expected) == 2
    for got, want in zip(shown, expected):
        keys = set(want) - set(results.WALL_CLOCK_KEYS)
        assert keys <= set(got)
        different = {k: (got[k], want[k]) for k in keys if not _same(got[k], want[k])}
        assert not different, different


def _run_shown(command: str, cwd: Path) -> dict | list:
    """Run a command line the dashboard prints (``kvpool ...``) with the installed CLI; its ``--json`` output."""
    argv = shlex.split(command)
    assert argv[0] == "kvpool"
    r = subprocess.run([KVPOOL, *argv[1:], "--out", str(cwd)], capture_output=True, text=True, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _same_rows(got: dict, want: dict) -> dict:
    """The keys whose values differ, all but the wall-clock ones."""
    keys = set(want) - set(results.WALL_CLOCK_KEYS)
    assert keys <= set(got), keys - set(got)
    return {k: (got[k], want[k]) for k in keys if not _same(got[k], want[k])}


def test_a_dashboard_plan_and_the_cli_give_identical_results(app, tmp_path):
    """The small, fast search of tests/sim (one real trace, no GPU prefix cache): the printed command
    run with the scenario the Scenario page downloads prints the same object the page shows."""
    from kvpool.scenario import load_scenario, to_toml

    overrides = ["workload.warmup_requests=1", "prefill.gpu_mem_utilization=0.4"]
    by_label(app.text_input, "Trace file or directory").set_value(TRACE).run()
    by_label(app.text_area, "More overrides").set_value("\n".join(overrides)).run()
    assert not app.exception and not [e.value for e in app.error]
    app.switch_page("pages/plan.py").run()
    set_plan(app, "reuse>=0.5", "pool.gib_per_service", 0.0, 768.0, load=3, duration=300, workers=2, max_runs=8)
    press(app, "Run search")
    assert not app.exception and not [e.value for e in app.error], [e.value for e in app.error]
    shown = json.loads(next(c.value for c in app.code if c.language == "json"))
    command = next(c.value for c in app.code if c.value.startswith("kvpool sim plan"))
    assert command == ("kvpool sim plan mi355x-1p1d.toml --target 'reuse>=0.5' --vary pool.gib_per_service=0..768 "
                       f"--load 3 --duration 300 --set workload.synthetic_sessions={SMALL_SYNTHETIC} --workers 2 --max-runs 8 --json")

    edited = load_scenario("mi355x-1p1d", [f"workload.traces={json.dumps(TRACE)}", *overrides])
    (tmp_path / "mi355x-1p1d.toml").write_text(to_toml(edited))
    cli = _run_shown(command, tmp_path)
    assert {k: v for k, v in shown.items() if k != "curve"} == {k: v for k, v in cli.items()
                                                                 if k not in ("curve", "id", "provenance", "run")}
    assert shown["best"] is not None and 0 < shown["best"] < 768 and shown["runs"] == len(cli["curve"]) <= 8
    assert [c["value"] for c in shown["curve"]] == [c["value"] for c in cli["curve"]]
    for got, want in zip(shown["curve"], cli["curve"]):
        assert not _same_rows(got, want), _same_rows(got, want)
    frame = app.dataframe[0].value
    assert list(frame["value"]) == [c["value"] for c in cli["curve"]]
    assert list(frame["reuse"]) == [c["reuse"] for c in cli["curve"]]


def test_a_dashboard_comparison_and_the_cli_give_identical_numbers(app, tmp_path):
    app.switch_page("pages/compare.py").run()
    by_label(app.multiselect, "Scenarios").set_value(["mi355x-1p1d", "h200-1p1d"])
    set_run(app, "8")
    press(app, "Run comparison")
    assert not app.exception and not [e.value for e in app.error]
    command = next(c.value for c in app.code if c.value.startswith("kvpool sim compare"))
    assert command == (f"kvpool sim compare mi355x-1p1d h200-1p1d --sessions 8 --duration {SMALL_DURATION_S} "
                       f"--set workload.synthetic_sessions={SMALL_SYNTHETIC} --json")
    cli = _run_shown(command, tmp_path)["arms"]
    assert list(cli) == ["mi355x-1p1d", "h200-1p1d"]
    shown = app.dataframe[1].value.to_dict("records")  # "All metrics": one row per scenario and load
    want = [{"scenario": name, **row} for name, rows in cli.items() for row in rows]
    assert len(shown) == len(want) == 2
    for got, w in zip(shown, want):
        assert not _same_rows(got, w), _same_rows(got, w)


def test_the_json_download_has_the_cli_keys():
    rows = [{"scenario": "x", "sessions": 8, "duration_s": 60.0, "requests": 3, "timeline": {}, "restore_stage_s": []}]
    assert json.loads(results.to_json(rows)) == [{"scenario": "x", "sessions": 8, "duration_s": 60.0, "requests": 3}]
    assert results.to_csv(rows).splitlines()[0] == "sessions,duration_s,requests,scenario"
    assert results.stem("x", rows) == "x-sessions-8"
    arms = {"a": rows, "b": rows}  # kvpool sim compare --json: {scenario name: [per-load objects]}
    assert json.loads(results.compare_json(arms)) == {n: json.loads(results.to_json(r)) for n, r in arms.items()}


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
