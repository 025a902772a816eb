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


def _download(app, downloads, label: str) -> tuple[str, bytes]:
    return downloads.of(by_label(app.get("download_button"), label))


def _outside_run(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "run"}


def test_the_run_downloads_are_the_cli_files_with_their_provenance(downloads, app, tmp_path):
    """The JSON download is the document the printed command writes (id, provenance, results; only
    the run block differs), under the same file name; the CSV is the same bytes."""
    from kvpool.scenario import load_scenario, to_toml
    from kvpool.sim.provenance import kvpool_version

    app.switch_page("pages/run.py").run()
    set_run(app, workers=2)
    press(app, "Run sweep")
    assert not app.exception and not [e.value for e in app.error]
    json_name, json_bytes = _download(app, downloads, "Download JSON")
    csv_name, csv_bytes = _download(app, downloads, "Download CSV")
    doc = json.loads(json_bytes)
    prov = doc["provenance"]
    assert prov["scenario"]["name"] == "mi355x-1p1d" and prov["scenario"]["source"] == "mi355x-1p1d.toml"
    assert prov["seed"] == 42 and prov["kvpool_version"] == kvpool_version() and prov["duration_s"] == SMALL_DURATION_S
    assert prov["set"] == [f"workload.synthetic_sessions={SMALL_SYNTHETIC}"]
    assert prov["workload"] == {"kind": "synthetic", "preset": "agentx-062126", "sessions": SMALL_SYNTHETIC,
                                "context_scale": 1.0}
    assert prov["loads"] == {"sessions": [8, 16]}
    command = next(c.value for c in app.code if c.value.startswith("kvpool sim run"))
    assert doc["run"]["produced_by"] == "kvpool dashboard (Run page)" and doc["run"]["command"] == command

    (tmp_path / "mi355x-1p1d.toml").write_text(to_toml(load_scenario("mi355x-1p1d")))
    cli = _run_shown(command, tmp_path)
    assert _outside_run(doc) == _outside_run(cli)
    assert cli["run"]["produced_by"] == "kvpool sim run"
    assert json_name == f"mi355x-1p1d-sessions-8-16-{cli['id']}.json" and (tmp_path / json_name).is_file()
    assert csv_name == json_name.replace(".json", ".csv") and csv_bytes == (tmp_path / csv_name).read_bytes()


def test_the_comparison_downloads_are_the_cli_files_with_their_provenance(downloads, app, tmp_path):
    app.switch_page("pages/compare.py").run()
    by_label(app.multiselect, "Scenarios").set_value(["mi355x-1p1d", "h200-1p1d"])
    set_run(app, "8")
    press(app, "Run comparison")
    assert not app.exception and not [e.value for e in app.error]
    json_name, json_bytes = _download(app, downloads, "Download comparison JSON")
    csv_name, csv_bytes = _download(app, downloads, "Download comparison CSV")
    doc = json.loads(json_bytes)
    arms = doc["provenance"]["arms"]
    assert list(arms) == ["mi355x-1p1d", "h200-1p1d"] and doc["ratios"]["reference"] == "mi355x-1p1d"
    assert [arms[n]["scenario"]["source"] for n in arms] == ["mi355x-1p1d", "h200-1p1d"]
    assert all(a["seed"] == 42 and a["duration_s"] == SMALL_DURATION_S and a["kvpool_version"] for a in arms.values())
    assert doc["run"]["produced_by"] == "kvpool dashboard (Compare page)"
    command = next(c.value for c in app.code if c.value.startswith("kvpool sim compare"))
    cli = _run_shown(command, tmp_path)
    assert _outside_run(doc) == _outside_run(cli)
    assert json_name == f"compare-mi355x-1p1d-vs-h200-1p1d-{cli['id']}.json"
    assert csv_bytes == (tmp_path / csv_name).read_bytes()


def _same_rows(got: dict, want: dict) -> dict:
    """The keys whose values differ, all but the wall-clock ones."""
    keys = set(want) - set(results.WALL_CLOCK_KEYS)
    assert keys <= set(got), keys - set(got)
    return {k: (got[k], want[k]) for k in keys if not _same(got[k], want[k])}


def test_a_dashboard_plan_and_the_cli_give_identical_results(app, tmp_path):
    """The small, fast search of tests/sim (one real trace, a GPU prefix cache of 75K tokens): the printed command
    run with the scenario the Scenario page downloads prints the same object the page shows."""
    from kvpool.scenario import load_scenario, to_toml

    overrides = ["workload.warmup_requests=1", "prefill.gpu_mem_utilization=0.472"]
    by_label(app.text_input, "Trace file or directory").set_value(TRACE).run()
    by_label(app.text_area, "More overrides").set_value("\n".join(overrides)).run()
    assert not app.exception and not [e.value for e in app.error]
    app.switch_page("pages/plan.py").run()
    set_plan(app, "reuse>=0.9", "pool.gib_per_service", 0.0, 768.0, load=3, duration=300, workers=2, max_runs=8)
    press(app, "Run search")
    assert not app.exception and not [e.value for e in app.error], [e.value for e in app.error]
    shown = json.loads(next(c.value for c in app.code if c.language == "json"))
    command = next(c.value for c in app.code if c.value.startswith("kvpool sim plan"))
    assert command == ("kvpool sim plan mi355x-1p1d.toml --target 'reuse>=0.9' --vary pool.gib_per_service=0..768 "
                       f"--load 3 --duration 300 --set workload.synthetic_sessions={SMALL_SYNTHETIC} --workers 2 --max-runs 8 --json")

    edited = load_scenario("mi355x-1p1d", [f"workload.traces={json.dumps(TRACE)}", *overrides])
    (tmp_path / "mi355x-1p1d.toml").write_text(to_toml(edited))
    cli = _run_shown(command, tmp_path)
    assert {k: v for k, v in shown.items() if k not in ("curve", "run")} == {k: v for k, v in cli.items()
                                                                             if k not in ("curve", "run")}
    assert shown["provenance"]["scenario"]["source"] == "mi355x-1p1d.toml"
    assert shown["provenance"]["search"]["vary"] == "pool.gib_per_service=0..768"
    assert shown["run"]["produced_by"] == "kvpool dashboard (Plan page)"
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


def test_the_csv_download_has_the_cli_keys():
    rows = [{"scenario": "x", "sessions": 8, "duration_s": 60.0, "requests": 3, "timeline": {}, "restore_stage_s": []}]
    assert results.to_csv(rows).splitlines()[0] == "sessions,duration_s,requests,scenario"
    assert results.stem("x", rows, "0123abcd") == "x-sessions-8-0123abcd"


def test_run_settings_at_the_scenarios_values_add_no_flags():
    from kvpool.dashboard.ui import RunSettings

    own = RunSettings([56, 72], None, None, 2)
    assert own.cli("x.toml") == "kvpool sim run x.toml --sessions 56,72 --json"
    assert own.overrides() == ['workload.mode="agentx"']
    short = RunSettings([0.6], 300.0, 40, 2, "rps")
    assert short.cli("x.toml") == "kvpool sim run x.toml --rps 0.6 --duration 300 --set workload.synthetic_sessions=40 --json"
    assert short.overrides() == ["workload.synthetic_sessions=40", "workload.duration_s=300.0", 'workload.mode="replay"']


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
