"""The Plan page (``kvpool sim plan`` in the dashboard): inputs, every kind of bad input, results, caching.

Most tests replace the simulator runs of the search by a closed-form model (``search(evaluate=...)``),
so they take no simulation time; ``test_parity_and_cli.py`` runs a real search against the CLI.
"""

from __future__ import annotations

import json

import pytest
from conftest import TRACE, by_label, errors, press, set_plan

# Durations no real-simulation test uses, so faked results never meet a real test in the cache.
FAKE_DURATION_S = 97


def model(points):
    """A stand-in for the simulator: reuse grows with the pool, TTFT with the load (and falls with decode DCP)."""
    rows = []
    for s, load in points:
        rows.append({"scenario": s.name, "sessions": int(load), "duration_s": s.workload.duration_s, "gpus": 8,
                     "requests": 100, "reuse": min(1.0, s.pool.gib_per_service / 512), "ttft_p90_s": load / 10 * 4 / s.decode.dcp,
                     "throughput_per_gpu_tok_s": 100.0 * load, "wall_s": 0.0, "timeline": {}, "restore_stage_s": []})
    return rows


@pytest.fixture
def fake_sim(monkeypatch):
    """The search with ``model`` instead of simulator runs; the faked results leave the cache afterwards."""
    import kvpool.sim.plan as pl
    from kvpool.dashboard import data

    calls = []
    search = pl.search

    def evaluate(points):
        calls.append(len(points))
        return model(points)

    def searched(*args, on_run=None, **kwargs):
        reported = []

        def progress(value, row, meets):  # the page's progress bar, advanced once per run
            reported.append(value)
            on_run(value, row, meets)

        res = search(*args, evaluate=evaluate, on_run=progress, **kwargs)
        assert sorted(reported) == sorted(v for v, _, _ in res.explored)
        return res

    monkeypatch.setattr(pl, "search", searched)
    yield calls
    data.plan.clear()


def _plan_page(app):
    app.switch_page("pages/plan.py").run()
    assert not app.exception
    return app


def _shown_json(app) -> dict:
    return json.loads(next(c.value for c in app.code if c.language == "json"))


def test_plan_page_opens_with_inputs_and_no_results(app):
    _plan_page(app)
    assert by_label(app.text_area, "Targets").value == "reuse>=0.95\nttft_p90_s<=5"  # the README's example
    assert by_label(app.selectbox, "Variable").value == "pool.gib_per_service"
    assert "workload.sessions" in by_label(app.selectbox, "Variable").options
    assert (by_label(app.number_input, "From (LO)").value, by_label(app.number_input, "To (HI)").value) == (64.0, 768.0)
    assert by_label(app.number_input, "Sessions per run").value == 56  # the scenario's load
    assert by_label(app.number_input, "Seconds per run").value == 3600.0  # and its window
    assert by_label(app.number_input, "Synthetic sessions").value == 200
    assert not errors(app) and not by_label(app.button, "Run search").disabled
    assert any("press **Run search**" in i.value for i in app.info)
    assert not app.get("vega_lite_chart")
    assert not any("has not landed" in w.value for w in app.warning)


def test_a_search_shows_the_best_value_curve_charts_json_and_cli_line(app, fake_sim):
    _plan_page(app)
    set_plan(app, "reuse>=0.5\nttft_p90_s<=2.5", "pool.gib_per_service", 0.0, 768.0, load=8,
             duration=FAKE_DURATION_S, max_runs=8)
    assert not errors(app)
    press(app, "Run search")
    assert not app.exception and not errors(app), errors(app)
    metric = by_label(app.metric, "Smallest pool.gib_per_service")
    shown = _shown_json(app)
    assert shown["variable"] == "pool.gib_per_service" and shown["direction"] == "minimize"
    assert shown["targets"] == ["reuse>=0.5", "ttft_p90_s<=2.5"] and shown["runs"] == len(shown["curve"]) <= 9
    best = shown["best"]
    assert 256 <= best <= 256 + 768 / 64 and metric.value == f"{best:,.6g}"  # reuse = gib / 512 >= 0.5
    assert any(f"**{best:,.6g}** meets" in s.value for s in app.success)
    table = app.dataframe[0].value
    assert list(table["value"]) == [c["value"] for c in shown["curve"]] == sorted(c["value"] for c in shown["curve"])
    assert list(table.columns[:4]) == ["value", "meets_targets", "reuse", "ttft_p90_s"]
    assert list(table["meets_targets"]) == [v >= 256 for v in table["value"]]
    assert len(app.get("vega_lite_chart")) == 2  # one per target
    labels = [b.label for b in app.get("download_button")]
    assert "Download JSON" in labels and "Download CSV" in labels
    assert any(c.value == "kvpool sim plan mi355x-1p1d.toml --target 'reuse>=0.5' --target 'ttft_p90_s<=2.5' "
               "--vary pool.gib_per_service=0..768 --load 8 --duration 97 --set workload.synthetic_sessions=10 "
               "--workers 2 --max-runs 8 --json" for c in app.code), [c.value for c in app.code]


def test_loads_are_maximized(app, fake_sim):
    _plan_page(app)
    set_plan(app, "ttft_p90_s<=2.5", "workload.sessions", 4, 64, duration=FAKE_DURATION_S, max_runs=24)
    assert by_label(app.number_input, "Sessions per run").disabled  # the load is the variable
    press(app, "Run search")
    assert not errors(app), errors(app)
    shown = _shown_json(app)
    assert shown["direction"] == "maximize" and shown["best"] == 25  # ttft = sessions / 10
    assert by_label(app.metric, "Largest workload.sessions").value == "25"
    assert any("--vary workload.sessions=4..64 --duration 97" in c.value and "--load" not in c.value for c in app.code)


def test_nothing_in_range_meeting_the_targets_is_said_plainly(app, fake_sim):
    _plan_page(app)
    set_plan(app, "reuse>=0.5", "pool.gib_per_service", 0.0, 128.0, load=8, duration=FAKE_DURATION_S)
    press(app, "Run search")
    assert not app.exception
    err = errors(app)
    assert any("Nothing in range meets the targets" in e and "pool.gib_per_service=128 fails" in e
               and "Raise HI" in e for e in err), err
    assert _shown_json(app)["best"] is None and fake_sim == [2]  # both ends, one round
    assert not [m for m in app.metric if m.label.startswith("Smallest")]
    assert len(app.get("vega_lite_chart")) == 1


def test_a_result_comes_back_from_the_cache(app, fake_sim):
    _plan_page(app)
    set_plan(app, "reuse>=0.5", "pool.gib_per_service", 0.0, 768.0, load=8, duration=FAKE_DURATION_S)
    press(app, "Run search")
    first = _shown_json(app)
    runs = len(fake_sim)
    press(app, "Run search")
    assert len(fake_sim) == runs and _shown_json(app) == first
    by_label(app.number_input, "Max runs").set_value(5).run()  # another input: the shown result is marked old
    assert any("of other inputs" in c.value for c in app.caption)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"targets": "reuse>=0.95\nspeed>=1"}, "Targets, line 2: --target 'speed>=1': unknown metric 'speed'; allowed: requests"),
        ({"targets": "reuse=0.95"}, "Targets, line 1: --target 'reuse=0.95': expected METRIC>=VALUE (or <=, >, <)"),
        ({"targets": "  \n"}, "Targets: give at least one"),
        ({"field": "other field (type it)", "other": "pool.colour"},
         "Variable: --vary 'pool.colour=0..1': --set 'pool.colour=0.0': pool has no field 'colour'; allowed: mode"),
        ({"field": "other field (type it)", "other": ""}, "Variable: type a field"),
        ({"field": "other field (type it)", "other": "workload.rps"},
         "Variable: workload.rps is not this scenario's load; it runs in AgentX (sessions) mode, so vary workload.sessions"),
        ({"lo": 800.0}, "Variable: --vary 'pool.gib_per_service=800..768': LO must be below HI"),
        ({"field": "cluster.servers", "lo": 0},
         "Variable: --vary 'cluster.servers=0..4': mi355x-1p1d (cluster.servers=0): cluster.servers: value 0: Input should be greater than 0"),
        ({"load": 0}, "Sessions per run: value 0: must be > 0"),
        ({"duration": 0}, "Seconds per run 0: must be > 0"),
        ({"max_runs": 1}, "Max runs: value 1: must be at least 2"),
        ({"workers": 0}, "Points per round: value 0: must be at least 1"),
    ],
)
def test_bad_inputs_are_named_inline_and_block_the_search(app, edit, message):
    _plan_page(app)
    set_plan(app, **{"duration": 120, **edit})
    assert not app.exception
    assert any(message in e for e in errors(app)), errors(app)
    assert by_label(app.button, "Run search").disabled


def test_a_missing_trace_path_is_named(app):
    by_label(app.text_input, "Trace file or directory").set_value("/nonexistent/traces").run()
    _plan_page(app)
    assert any("workload.traces: value '/nonexistent/traces': no such file or directory" in e for e in errors(app))
    assert by_label(app.button, "Run search").disabled


def test_an_invalid_scenario_is_refused(app):
    by_label(app.number_input, "Decode DCP").set_value(3).run()
    _plan_page(app)
    assert any("does not validate" in w.value for w in app.warning)
    assert any("decode.dcp (3) must divide decode.tp (4)" in e for e in errors(app))


def test_a_point_inside_the_range_that_does_not_validate_is_an_error(app, fake_sim):
    _plan_page(app)  # decode.dcp=1..4 validates at both ends; 3 does not divide decode.tp (4)
    set_plan(app, "ttft_p90_s<=1", "other field (type it)", 1.0, 4.0, other="decode.dcp", load=8,
             duration=FAKE_DURATION_S)
    assert not errors(app), errors(app)  # ttft: 3.2 at dcp 1, 0.8 at dcp 4, so the search looks inside
    press(app, "Run search")
    assert not app.exception
    err = errors(app)
    assert any(e.startswith("The search stopped: a point of the search does not validate") and "decode.dcp (3) must divide decode.tp (4)" in e
               for e in err), err


def test_a_simulator_failure_is_shown_not_raised(app, monkeypatch):
    import kvpool.sim.run as run_mod

    def boom(*_a, **_k):
        raise ValueError("preset not finished")

    monkeypatch.setattr(run_mod, "run_point", boom)
    _plan_page(app)
    set_plan(app, "reuse>=0.5", "pool.gib_per_service", 0.0, 768.0, load=8, duration=61, workers=1)
    press(app, "Run search")
    assert not app.exception
    assert any("The search stopped: the simulator failed: ValueError: preset not finished" in e for e in errors(app))


def test_the_plan_summary_is_built_as_the_cli_builds_it():
    from kvpool.dashboard import results
    from kvpool.sim.documents import plan_summary
    from kvpool.scenario import load_scenario
    from kvpool.sim import plan as pl

    base = load_scenario("mi355x-1p1d")
    res = pl.search(base, pl.parse_vary("pool.gib_per_service=0..768", base), [pl.parse_target("reuse>=0.5")],
                    load=8, workers=2, max_runs=8, evaluate=model)
    summary = plan_summary(res)
    assert list(summary) == ["variable", "direction", "targets", "best", "runs", "curve"]
    assert summary["best"] == res.best and summary["runs"] == len(res.explored)
    assert all(set(c) >= {"value", "meets_targets", "reuse", "sessions"} and "timeline" not in c for c in summary["curve"])
    fails, meets = results.plan_bracket(summary)
    assert fails < 256 <= meets == res.best
    assert json.loads(results.plan_json(summary)) == summary


def test_trace_for_the_parity_test_exists():
    from pathlib import Path

    assert Path(TRACE).is_file(), f"test trace not found at {TRACE}"


def test_a_replay_scenario_varies_requests_per_second(app):
    by_label(app.selectbox, "Built-in scenario").set_value("mi350x-6p2d-tp4-replay-shared").run()
    _plan_page(app)
    options = by_label(app.selectbox, "Variable").options
    assert "workload.rps" in options and "workload.sessions" not in options
    assert by_label(app.number_input, "Requests per second per run").value > 0
    set_plan(app, field="other field (type it)", other="workload.sessions")
    assert any("Variable: workload.sessions is not this scenario's load; it runs in production replay (requests per "
               "second) mode, so vary workload.rps" in e for e in errors(app)), errors(app)
    set_plan(app, field="workload.rps")
    assert not errors(app)
    assert (by_label(app.number_input, "From (LO)").value, by_label(app.number_input, "To (HI)").value) == (0.2, 2.0)
    assert by_label(app.number_input, "Requests per second per run").disabled
