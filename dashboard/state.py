"""The dashboard's session state: the scenario being edited, shared by every page.

The state is a base scenario (a built-in or an uploaded TOML, as a raw table and a label) plus
edits: knob values (``section.field`` -> value) and free-form ``section.field=value`` lines. The
current scenario is the base with those overrides applied and validated
(``kvpool.dashboard.knobs.edited``), so the Run, Compare and Plan pages all see the same one.
Functions here touch ``st.session_state`` only when called.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import streamlit as st

from kvpool.dashboard import data, knobs
from kvpool.scenario import Scenario, ScenarioError, to_toml

DEFAULT_SCENARIO = "mi355x-1p1d"

BASE_RAW = "base_raw"
BASE_LABEL = "base_label"
BASE_CHOICE = "base_choice"  # the built-in name, or "" for an upload
EDITS = "edits"  # path -> model value
ADVANCED = "advanced_overrides"


@dataclass(frozen=True)
class Current:
    """The scenario the pages work on: ``scenario`` is None when the edits do not validate."""

    scenario: Scenario | None
    errors: list[str]
    overrides: list[str]
    label: str

    @property
    def toml(self) -> str:
        return to_toml(self.scenario) if self.scenario is not None else ""


def base_id() -> str:
    """A short id of the base scenario (widget keys carry it, so a new base resets the knobs)."""
    raw = st.session_state[BASE_RAW]
    return hashlib.blake2b(json.dumps(raw, sort_keys=True, default=str).encode(), digest_size=6).hexdigest()


def ensure_base() -> None:
    if BASE_RAW not in st.session_state:
        set_base(*data.builtin(DEFAULT_SCENARIO), choice=DEFAULT_SCENARIO)


def set_base(raw: dict, label: str, choice: str = "") -> None:
    """Start editing a new base scenario; previous edits are dropped."""
    st.session_state[BASE_RAW] = raw
    st.session_state[BASE_LABEL] = label
    st.session_state[BASE_CHOICE] = choice
    st.session_state[EDITS] = {}
    st.session_state[ADVANCED] = ""


def base_scenario() -> Scenario:
    ensure_base()
    return knobs.edited(st.session_state[BASE_RAW], [], st.session_state[BASE_LABEL])


def current() -> Current:
    """The base with the knob edits and the advanced overrides applied."""
    ensure_base()
    label = st.session_state[BASE_LABEL]
    overrides: list[str] = []
    try:
        base = base_scenario()
        overrides = knobs.knob_overrides(base, st.session_state.get(EDITS, {}))
        overrides += knobs.parse_override_lines(st.session_state.get(ADVANCED, ""))
        return Current(knobs.edited(st.session_state[BASE_RAW], overrides, label), [], overrides, label)
    except ScenarioError as e:
        return Current(None, knobs.error_lines(e), overrides, label)
