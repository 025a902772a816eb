"""Scenarios: the typed deployment model, TOML loading with ``--set`` overrides, derived figures."""

from kvpool.scenario.derive import summarize
from kvpool.scenario.load import ScenarioError, builtin_names, load_scenario, to_toml
from kvpool.scenario.model import Scenario

__all__ = ["Scenario", "ScenarioError", "builtin_names", "load_scenario", "summarize", "to_toml"]
