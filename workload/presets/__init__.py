"""Synthetic-session presets: package data, one JSON file per preset, and their loader.

A preset is every number of the synthetic session model (``kvpool.workload.synth.SynthParams``,
the model in ``synth``'s docstring): quantile tables (``{"probs": [...], "values": [...]}``) for
turns, prompt sizes, outputs, pauses and subagent sizes, and plain numbers for probabilities,
limits and the server-time fit. ``<name>.json`` in this folder holds preset ``name``; its
``name`` field is its file name.

Where the numbers come from: ``python -m kvpool.workload.fit`` (:mod:`kvpool.workload.fit`) fits
``kv-cache-tester`` to the 710 traces of ../shared/traces/kv-cache-tester and ``agentx-062126`` to
the published statistics of cc-traces-weka-062126 (``fit.AGENTX_TARGETS``), then writes these
files with :func:`write_preset`. The files are the record: the simulator's results depend on
every digit, so they change only by a refit on purpose. Floats are written with ``repr`` and read
back bit-identical.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The folder of the preset files.
PRESET_DIR = Path(__file__).parent

#: The names of the presets, sorted.
PRESETS: tuple[str, ...] = tuple(sorted(p.stem for p in PRESET_DIR.glob("*.json")))


def preset_fields(name: str) -> dict[str, Any]:
    """The stored fields of preset ``name``, freshly read (KeyError lists the presets)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    fields = json.loads((PRESET_DIR / f"{name}.json").read_text())
    if fields.get("name") != name:
        raise ValueError(f"{PRESET_DIR / f'{name}.json'}: field name is {fields.get('name')!r}, not {name!r}")
    return fields


def preset_text(fields: dict[str, Any]) -> str:
    """The file text of a preset's fields (what :func:`write_preset` writes, byte for byte)."""
    return json.dumps(fields, indent=1) + "\n"


def write_preset(fields: dict[str, Any], folder: Path = PRESET_DIR) -> Path:
    """Write ``<folder>/<fields["name"]>.json``; returns its path."""
    path = Path(folder) / f"{fields['name']}.json"
    path.write_text(preset_text(fields))
    return path
