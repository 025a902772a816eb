"""AppTest of every page: opens without an exception, edits, bad input named by field, runs, caching."""

from __future__ import annotations

import time

from conftest import by_label, errors, press, set_run

from kvpool.scenario import load_scenario, to_toml


def test_scenario_page_opens_with_the_default_scenario_and_its_derived_figures(app):
    assert not app.exception
    assert "mi355x-1p1d" in app.subheader[0].value
    metrics = {m.label: m.value for m in app.metric}
    assert metrics["KV bytes per token"] == "48,672"
    assert metrics["Pool capacity"] == "1.50 TiB"


def test_page_reopens_quickly(app):
    t0 = time.perf_counter()
    app.run()
    assert time.perf_counter() - t0 < 2.0
    assert not app.exception


def test_picking_a_builtin_loads_it(app):
    by_label(app.selectbox, "Built-in scenario").set_value("h200-1p1d").run()
    assert not app.exception
    assert "h200-1p1d" in app.subheader[0].value
    assert by_label(app.number_input, "Decode TP").value == load_scenario("h200-1p1d").decode.tp


def test_a_bad_field_value_shows_an_error_naming_the_field(app):
    by_label(app.number_input, "GiB per Store service").set_value(-5.0).run()
    assert not app.exception
    errs = errors(app)
    assert any("pool.gib_per_service" in e and "greater than or equal to 0" in e for e in errs), errs
    assert by_label(app.get("download_button"), "Download scenario TOML").disabled


def test_a_cross_field_error_is_shown_next_to_both_fields(app):
    by_label(app.number_input, "Decode DCP").set_value(3).run()
    errs = errors(app)
    assert sum("decode.dcp (3) must divide decode.tp (4)" in e for e in errs) >= 3  # summary + DCP + TP


def test_an_edit_changes_the_derived_figures_and_the_cli_line(app):
    by_label(app.number_input, "GiB per Store service").set_value(384.0).run()
    assert not errors(app)
    assert {m.label: m.value for m in app.metric}["Pool capacity"] == "0.75 TiB"
    assert any("--set 'pool.gib_per_service=384.0'" in c.value for c in app.code)


def test_an_unknown_advanced_override_lists_the_allowed_fields(app):
    by_label(app.text_area, "More overrides").set_value("pool.colour=1").run()
    assert not app.exception
    assert any("pool has no field 'colour'; allowed: mode, parts" in e for e in errors(app))


def test_a_bad_toml_upload_names_the_file_and_keeps_the_scenario(app):
    app.file_uploader[0].set_value(("bad.toml", b"name = [1,\n", "application/toml")).run()
    assert not app.exception
    assert any(e.startswith("upload bad.toml: not valid TOML") for e in errors(app)), errors(app)
    assert "mi355x-1p1d" in app.subheader[0].value


def test_an_invalid_upload_names_the_field(app):
    text = to_toml(load_scenario("mi355x-1p1d")).replace("dcp = 4", "dcp = 3")
    app.file_uploader[0].set_value(("dcp.toml", text.encode(), "application/toml")).run()
    errs = errors(app)
    assert any(e.startswith("upload dcp.toml") and "decode.dcp (3) must divide decode.tp (4)" in e for e in errs), errs


def test_a_good_upload_becomes_the_base(app):
    text = to_toml(load_scenario("h200-1p1d", ["name=\"mine\""]))
    app.file_uploader[0].set_value(("mine.toml", text.encode(), "application/toml")).run()
    assert not errors(app)
    assert "mine" in app.subheader[0].value and "upload mine.toml" in app.caption[1].value


def test_a_pasted_toml_goes_through_the_same_checks(app):
    by_label(app.text_area, "Scenario TOML").set_value("[pool]\nmode = 1\n")
    press(app, "Load pasted TOML")
    assert any(e.startswith("upload pasted.toml: name: required field is missing") for e in errors(app)), errors(app)


def test_run_page_sweeps_plots_and_offers_downloads(app):
    app.switch_page("pages/run.py").run()
    assert not app.exception
    set_run(app)
    press(app, "Run sweep")
    assert not app.exception, app.exception
    frame = app.dataframe[0].value
    assert list(frame["sessions"]) == [8, 16]
    assert (frame["requests"] > 0).all()
    charts = app.get("vega_lite_chart")
    assert len(charts) >= 6
    labels = [b.label for b in app.get("download_button")]
    assert "Download CSV" in labels and "Download JSON" in labels
    assert any("kvpool sim run mi355x-1p1d.toml --sessions 8,16 --duration 120" in c.value for c in app.code)


def test_run_results_come_back_from_the_cache(app, monkeypatch):
    import kvpool.sim.run as run_mod

    app.switch_page("pages/run.py").run()
    set_run(app, "8")
    press(app, "Run sweep")
    first = app.dataframe[0].value

    def no_rerun(*_a, **_k):
        raise AssertionError("the same inputs were simulated again")

    monkeypatch.setattr(run_mod, "sweep", no_rerun)
    t0 = time.perf_counter()
    press(app, "Run sweep")
    assert time.perf_counter() - t0 < 5.0
    assert not errors(app)
    assert app.dataframe[0].value.equals(first)


def test_run_page_bad_loads_and_duration_are_named(app):
    app.switch_page("pages/run.py").run()
    set_run(app, "8,x")
    press(app, "Run sweep")
    assert any("Sessions (AgentX lanes) '8,x': 'x' is not an integer" in e for e in errors(app)), errors(app)
    set_run(app, "8", duration=0)
    press(app, "Run sweep")
    assert any("Seconds per load 0: must be > 0" in e and "(workload.duration_s)" in e for e in errors(app)), errors(app)
    assert not app.exception


def test_run_page_refuses_an_invalid_scenario(app):
    by_label(app.number_input, "Decode DCP").set_value(3).run()
    app.switch_page("pages/run.py").run()
    assert not app.exception
    assert any("does not validate" in w.value for w in app.warning)
    assert any("decode.dcp (3) must divide decode.tp (4)" in e for e in errors(app))


def test_a_failing_workload_is_shown_not_raised(app, monkeypatch):
    import kvpool.sim.run as run_mod

    def boom(*_a, **_k):
        raise ValueError("preset not finished")

    monkeypatch.setattr(run_mod, "_synthetic", boom)
    app.switch_page("pages/run.py").run()
    set_run(app, "9", duration=61)
    press(app, "Run sweep")
    assert not app.exception
    assert any("the simulator failed: ValueError: preset not finished" in e for e in errors(app)), errors(app)


def test_compare_page_runs_two_scenarios_with_ratios(app):
    app.switch_page("pages/compare.py").run()
    assert not app.exception
    by_label(app.multiselect, "Scenarios").set_value(["mi355x-1p1d", "h200-1p1d"])
    set_run(app, "8")
    press(app, "Run comparison")
    assert not app.exception, app.exception
    ratio = app.dataframe[0].value
    assert list(ratio["ratio"]) == ["mi355x-1p1d / h200-1p1d"]  # the first over the other, as kvpool sim compare
    shown = app.dataframe[1].value.set_index("scenario")
    assert ratio["throughput per GPU"][0] == (shown.loc["mi355x-1p1d", "throughput_per_gpu_tok_s"]
                                              / shown.loc["h200-1p1d", "throughput_per_gpu_tok_s"])
    assert len(app.get("vega_lite_chart")) >= 3


def test_compare_page_needs_two_scenarios(app):
    app.switch_page("pages/compare.py").run()
    by_label(app.multiselect, "Scenarios").set_value(["mi355x-1p1d"])
    set_run(app, "8")
    press(app, "Run comparison")
    assert any("pick at least two" in e for e in errors(app))
    assert not app.exception


def _chart_specs(at) -> dict[str, dict]:
    """The drawn Vega-Lite specs by title."""
    import json

    specs = {}
    for c in at.get("vega_lite_chart"):
        spec = json.loads(c.proto.spec)
        title = spec.get("title")
        specs[title if isinstance(title, str) else json.dumps(title)] = spec
    return specs


def _chart_frame(at, title: str):
    """The data of the drawn chart titled ``title`` (Streamlit sends it as Arrow next to the spec)."""
    import json

    import pyarrow as pa

    for c in at.get("vega_lite_chart"):
        if json.loads(c.proto.spec).get("title") == title:
            return pa.ipc.open_stream(c.proto.datasets[0].data.data).read_pandas()
    raise AssertionError(f"no chart titled {title!r}")


def test_decode_occupancy_over_time_comes_from_the_sweep_without_another_run(app, monkeypatch):
    import kvpool.sim.engine as engine

    app.switch_page("pages/run.py").run()
    set_run(app, "8,16")
    press(app, "Run sweep")
    assert not app.exception
    assert "Decode KV occupancy over time" in _chart_specs(app)
    frame = _chart_frame(app, "Decode KV occupancy over time")
    assert set(frame["load"]) == {"8 sessions", "16 sessions"}
    assert frame["decode_kv_occupancy"].between(0.0, 1.0).all() and frame["decode_kv_occupancy"].max() > 0
    assert not [b for b in app.button if b.label.startswith("Simulate decode")]
    assert not any("not exported" in c.value for c in app.caption)

    def no_rerun(*_a, **_k):
        raise AssertionError("the decode series was simulated again")

    monkeypatch.setattr(engine, "Simulation", no_rerun)
    app.run()
    assert not app.exception and "Decode KV occupancy over time" in _chart_specs(app)


def test_reset_edits_returns_to_the_base(app):
    by_label(app.number_input, "GiB per Store service").set_value(384.0).run()
    press(app, "Reset edits")
    assert not app.code
    assert by_label(app.number_input, "GiB per Store service").value == 768.0
    assert {m.label: m.value for m in app.metric}["Pool capacity"] == "1.50 TiB"


def test_edits_survive_a_visit_to_another_page(app):
    by_label(app.number_input, "GiB per Store service").set_value(384.0).run()
    app.switch_page("pages/plan.py").run()
    assert any(m.value == "0.75 TiB" for m in app.metric)
    app.switch_page("pages/scenario.py").run()
    assert by_label(app.number_input, "GiB per Store service").value == 384.0


def test_compare_can_use_the_edited_scenario(app):
    by_label(app.number_input, "GiB per Store service").set_value(384.0).run()
    app.switch_page("pages/compare.py").run()
    by_label(app.multiselect, "Scenarios").set_value(["mi355x-1p1d", "edited: mi355x-1p1d"])
    set_run(app, "8")
    press(app, "Run comparison")
    assert not app.exception, app.exception
    assert list(app.dataframe[0].value["ratio"]) == ["mi355x-1p1d / edited: mi355x-1p1d"]
    assert any(c.value.startswith("kvpool sim compare mi355x-1p1d mi355x-1p1d.toml --sessions 8") for c in app.code)
    assert not app.get("download_button")  # two arms named mi355x-1p1d: kvpool sim compare would refuse them
    assert any("share a name" in c.value for c in app.caption)


def test_a_missing_trace_path_is_named_before_running(app):
    by_label(app.text_input, "Trace file or directory").set_value("/nonexistent/traces").run()
    assert not errors(app)  # any path is a valid scenario field...
    app.switch_page("pages/run.py").run()
    set_run(app, "8")
    press(app, "Run sweep")
    assert any("workload.traces: value '/nonexistent/traces': no such file or directory" in e for e in errors(app))


def test_a_replay_scenario_sweeps_requests_per_second(app):
    by_label(app.selectbox, "Built-in scenario").set_value("mi350x-6p2d-tp4-replay-shared").run()
    app.switch_page("pages/run.py").run()
    by_label(app.text_input, "Requests per second").set_value("0.2")
    by_label(app.number_input, "Seconds per load").set_value(60.0)
    by_label(app.number_input, "Synthetic sessions").set_value(10)
    press(app, "Run sweep")
    assert not app.exception and not errors(app)
    assert list(app.dataframe[0].value["rps"]) == [0.2]
    assert any("--rps 0.2 --duration 60" in c.value for c in app.code)


def test_compare_refuses_mixed_load_kinds(app):
    app.switch_page("pages/compare.py").run()
    by_label(app.multiselect, "Scenarios").set_value(["mi355x-1p1d", "mi350x-6p2d-tp4-replay-shared"])
    set_run(app, "8")
    press(app, "Run comparison")
    assert not app.exception
    assert any("must share a load kind" in e and "mi350x-6p2d-tp4-replay-shared (rps)" in e for e in errors(app)), errors(app)


def test_run_loads_follow_the_scenario_load_kind(app):
    app.switch_page("pages/run.py").run()
    assert by_label(app.text_input, "Sessions").value == "56,72,96,112"
    app.switch_page("pages/scenario.py").run()
    by_label(app.selectbox, "Built-in scenario").set_value("mi350x-6p2d-tp4-replay-split").run()
    app.switch_page("pages/run.py").run()
    assert by_label(app.text_input, "Requests per second").value == "0.6,0.8,1.0,1.2"


def test_compare_drops_an_edited_pick_that_no_longer_validates(app):
    app.switch_page("pages/compare.py").run()
    by_label(app.multiselect, "Scenarios").set_value(["mi355x-1p1d", "edited: mi355x-1p1d"])
    set_run(app, "8")
    press(app, "Run comparison")
    app.switch_page("pages/scenario.py").run()
    by_label(app.number_input, "Decode DCP").set_value(3).run()
    app.switch_page("pages/compare.py").run()
    assert not app.exception
    assert by_label(app.multiselect, "Scenarios").value == ["mi355x-1p1d"]


def test_run_and_compare_open_at_the_scenarios_own_window(app):
    """A planner's first sweep is the scenario's measurement (an hour per load for mi355x-1p1d, 200
    synthetic sessions), and the Compare page starts from the seed's Figure 8, shared over split."""
    app.switch_page("pages/run.py").run()
    assert by_label(app.text_input, "Sessions").value == "56,72,96,112"
    assert by_label(app.number_input, "Seconds per load").value == 3600.0
    assert by_label(app.number_input, "Synthetic sessions").value == 200
    assert not app.warning
    app.switch_page("pages/compare.py").run()
    assert by_label(app.multiselect, "Scenarios").value == ["mi350x-6p2d-shared", "mi350x-6p2d-split"]
    assert by_label(app.number_input, "Seconds per load").value == 900.0  # the seed's window for Figure 8
    assert by_label(app.text_input, "Sessions").value == "56,112"


def test_a_short_window_and_a_degenerate_load_are_said_on_the_page(app):
    app.switch_page("pages/run.py").run()
    set_run(app, "8", duration=61)
    press(app, "Run sweep")
    assert not app.exception and not errors(app), errors(app)
    warnings = [w.value for w in app.warning]
    assert any(w.startswith("61 s per load, the scenario's is 3600 s.") and "measures mostly the start" in w
               for w in warnings), warnings
    assert any(w.startswith("Not a measurement: sessions 8: ") and "give a longer --duration" in w
               for w in warnings), warnings
