"""The synthetic presets as package data: the stored numbers, their exact round trip through
``SynthParams``, and the writer the fit uses."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from kvpool.workload import presets
from kvpool.workload.fit import write_presets
from kvpool.workload.presets import PRESET_DIR, PRESETS, preset_fields
from kvpool.workload.synth import QTable, SynthParams, preset_params

#: sha256 of ``json.dumps({name: fields}, sort_keys=True)`` over every preset: the fitted numbers
#: the simulator's fingerprint (bench/sim_fingerprint.py) is recorded with. Floats are compared by
#: their repr and 3 differs from 3.0, so any changed digit or type changes it. A refit changes it
#: on purpose, together with the fingerprint.
PRESETS_SHA256 = "67222a36f16671e47bba91b46eeff8df5292a747794f79cdca4c410905daa066"


def test_the_presets_are_the_two_fitted_ones():
    assert PRESETS == ("agentx-062126", "kv-cache-tester")


def test_stored_numbers_are_the_fitted_numbers():
    text = json.dumps({name: preset_fields(name) for name in PRESETS}, sort_keys=True)
    assert hashlib.sha256(text.encode()).hexdigest() == PRESETS_SHA256


@pytest.mark.parametrize("name", PRESETS)
def test_every_field_round_trips_exactly(name):
    fields = preset_fields(name)
    p = preset_params(name)
    assert [f.name for f in dataclasses.fields(SynthParams)] == list(fields)
    for f in dataclasses.fields(SynthParams):
        value, stored = getattr(p, f.name), fields[f.name]
        if isinstance(value, QTable):
            assert value.probs == tuple(stored["probs"]) and value.values == tuple(stored["values"]), f.name
            assert all(type(x) is float for x in value.probs + value.values), f.name
        elif isinstance(value, tuple):
            assert value == tuple(stored), f.name
        else:
            assert value == stored and type(value) is type(stored), f.name


def test_the_fits_writer_reproduces_the_stored_files_byte_for_byte(tmp_path):
    written = write_presets({name: preset_params(name) for name in PRESETS}, tmp_path)
    assert sorted(p.name for p in written) == sorted(p.name for p in PRESET_DIR.glob("*.json"))
    for path in written:
        assert path.read_bytes() == (PRESET_DIR / path.name).read_bytes(), path.name


def test_an_unknown_preset_names_the_known_ones():
    with pytest.raises(KeyError, match="unknown preset 'agentx'; presets: agentx-062126, kv-cache-tester"):
        preset_params("agentx")


def test_a_file_whose_name_field_differs_from_its_file_name_is_refused(tmp_path, monkeypatch):
    fields = preset_fields("kv-cache-tester")
    (tmp_path / "mine.json").write_text(presets.preset_text(fields))
    monkeypatch.setattr(presets, "PRESET_DIR", tmp_path)
    monkeypatch.setattr(presets, "PRESETS", ("mine",))
    with pytest.raises(ValueError, match="mine.json: field name is 'kv-cache-tester', not 'mine'"):
        preset_fields("mine")
