"""The knob list matches the scenario model for every built-in scenario (no Streamlit needed)."""

from __future__ import annotations

import pytest

from kvpool.dashboard import knobs
from kvpool.scenario import ScenarioError, builtin_names, load_scenario
from kvpool.scenario.load import read_raw


@pytest.mark.parametrize("name", builtin_names())
def test_every_knob_shows_and_round_trips_on_every_builtin(name):
    s = load_scenario(name)
    raw, label = read_raw(name)
    values = {}
    for k in knobs.KNOBS:
        v = knobs.value_at(s, k.path)
        assert k.help.startswith(f"`{k.path}`: ") and len(k.help) > len(k.path) + 5
        if k.kind == "choice":
            assert v in k.choices()
        values[k.path] = knobs.model_value(k, knobs.widget_value(k, v))
    assert knobs.knob_overrides(s, values) == []  # unchanged widgets change nothing
    assert knobs.edited(raw, [], label) == s


def test_a_cleared_optional_field_is_removed():
    raw, label = read_raw("mi355x-1p1d")
    raw["workload"]["traces"] = "somewhere"
    assert knobs.edited(raw, ["workload.traces="], label).workload.traces is None


def test_a_mistyped_list_is_named_by_validation():
    k = next(k for k in knobs.KNOBS if k.path == "prefill.stage_layers")
    raw, label = read_raw("mi355x-1p1d")
    with pytest.raises(ScenarioError, match="prefill.stage_layers"):
        knobs.edited(raw, [knobs.override_text(k.path, knobs.model_value(k, "20, x, 20"))], label)
