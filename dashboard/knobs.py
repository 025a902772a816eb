"""The scenario knobs the dashboard edits, and the pure logic behind editing (no Streamlit here).

Contract:
    * ``KNOBS``: the fields the Scenario page shows, grouped (``Knob.group``); label, widget kind
      and help text (the model field's own description) come from ``kvpool.scenario.model``.
    * An edit is a set of ``section.field=value`` overrides, exactly the CLI's ``--set``:
      ``override_text(path, value)`` formats one, ``edited(raw, overrides, source)`` applies them
      with ``kvpool.scenario.load.apply_overrides`` and validates with ``validate``, so every
      problem is the same one-line ``ScenarioError`` message the CLI prints (naming the field).
    * ``field_errors(lines, path)`` picks the error lines that name ``path``, to show them next to
      that field's widget; ``parse_upload`` reads an uploaded TOML file.
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel

from kvpool.scenario.load import ScenarioError, apply_overrides, read_toml_bytes, validate
from kvpool.scenario.model import Scenario

Kind = Literal["int", "float", "bool", "choice", "text", "int_list", "optional_text"]


@dataclass(frozen=True)
class Knob:
    """One editable scenario field: ``path`` is ``section.field`` as in ``--set``."""

    group: str
    path: str
    label: str
    kind: Kind
    step: float | None = None

    def field(self):
        """The pydantic FieldInfo of this path (for help text and choices)."""
        cur: Any = Scenario
        parts = self.path.split(".")
        for part in parts[:-1]:
            cur = cur.model_fields[part].annotation
        return cur.model_fields[parts[-1]]

    @property
    def help(self) -> str:
        return f"`{self.path}`: {self.field().description or ''}"

    def choices(self) -> list[str]:
        if self.path == "workload.preset":
            from kvpool.workload.presets import PRESETS

            return list(PRESETS)
        return list(typing.get_args(self.field().annotation))


KNOBS: tuple[Knob, ...] = (
    Knob("Cluster", "cluster.servers", "Servers", "int"),
    Knob("Cluster", "cluster.gpus_per_server", "GPUs per server", "int"),
    Knob("Prefill / decode", "prefill.instances", "Prefill instances", "int"),
    Knob("Prefill / decode", "prefill.pp", "Prefill pipeline stages (PP)", "int"),
    Knob("Prefill / decode", "prefill.tp", "Prefill TP per stage", "int"),
    Knob("Prefill / decode", "prefill.stage_layers", "Layers per stage (comma-separated)", "int_list"),
    Knob("Prefill / decode", "prefill.gpu_mem_utilization", "Prefill HBM utilization", "float", 0.01),
    Knob("Prefill / decode", "decode.instances", "Decode instances", "int"),
    Knob("Prefill / decode", "decode.tp", "Decode TP", "int"),
    Knob("Prefill / decode", "decode.dcp", "Decode DCP", "int"),
    Knob("Prefill / decode", "decode.gpu_mem_utilization", "Decode HBM utilization", "float", 0.01),
    Knob("Pool", "pool.mode", "Pool mode", "choice"),
    Knob("Pool", "pool.parts", "Pool parts (one master each)", "int"),
    Knob("Pool", "pool.services_per_server", "Store services per server", "int"),
    Knob("Pool", "pool.gib_per_service", "GiB per Store service", "float", 16.0),
    Knob("Pool", "pool.chunk_tokens", "Chunk tokens", "int"),
    Knob("Pool", "pool.high_watermark", "Eviction high watermark", "float", 0.01),
    Knob("Pool", "pool.evict_ratio", "Eviction ratio per pass", "float", 0.01),
    Knob("Pool", "pool.eviction_policy", "Eviction order", "choice"),
    Knob("Pool", "pool.ssd.enabled", "SSD tier", "bool"),
    Knob("Pool", "pool.ssd.gib_per_server", "SSD GiB per server", "float", 256.0),
    Knob("Gate and network", "gate.enabled", "KV admission gate", "bool"),
    Knob("Gate and network", "gate.tokens_per_decode", "Gate token budget per decode", "int"),
    Knob("Gate and network", "gate.budget_fraction", "Gate usable budget fraction", "float", 0.01),
    Knob("Gate and network", "gpu.nic_gb_s", "NIC bandwidth (GB/s)", "float", 1.0),
    Knob("Gate and network", "gpu.nic_writes_per_s", "NIC small writes per second", "float", 1e5),
    Knob("Gate and network", "routing.prefill", "Prefill routing", "choice"),
    Knob("Model KV geometry", "model.layers", "Layers", "int"),
    Knob("Model KV geometry", "model.record_bytes", "KV record bytes per token per layer", "int"),
    Knob("Model KV geometry", "model.page_tokens", "GPU page tokens", "int"),
    Knob("Workload", "workload.mode", "Mode", "choice"),
    Knob("Workload", "workload.traces", "Trace file or directory (empty: synthetic)", "optional_text"),
    Knob("Workload", "workload.preset", "Synthetic preset", "choice"),
    Knob("Workload", "workload.synthetic_sessions", "Synthetic sessions", "int"),
    Knob("Workload", "workload.sessions", "AgentX sessions (lanes)", "int"),
    Knob("Workload", "workload.rps", "Replay requests per second", "float", 0.1),
    Knob("Workload", "workload.duration_s", "Measured window per load (s)", "float", 60.0),
    Knob("Workload", "workload.context_scale", "Prompt size scale of the synthetic sessions", "float", 0.1),
    Knob("Workload", "workload.shared_prefix_tokens", "Prompt prefix every session shares (tokens)", "int"),
)

GROUPS: tuple[str, ...] = tuple(dict.fromkeys(k.group for k in KNOBS))


def value_at(s: BaseModel, path: str) -> Any:
    """The value of ``section.field`` in a validated scenario (lists for tuples)."""
    cur: Any = s
    for part in path.split("."):
        cur = getattr(cur, part)
    return list(cur) if isinstance(cur, tuple) else cur


def widget_value(knob: Knob, value: Any) -> Any:
    """A model value as its widget shows it (lists as ``20, 20, 18``, ``None`` as empty text)."""
    if knob.kind == "int_list":
        return ", ".join(str(x) for x in value)
    if knob.kind == "optional_text":
        return value or ""
    if knob.kind == "float":
        return float(value)
    return value


def model_value(knob: Knob, shown: Any) -> Any:
    """A widget's value as the override value (the reverse of ``widget_value``).

    A list the user mistyped stays text, so validation names the field rather than this module.
    """
    if knob.kind == "int_list":
        parts = [p.strip() for p in str(shown).replace(";", ",").split(",") if p.strip()]
        try:
            return [int(p) for p in parts]
        except ValueError:
            return str(shown)
    if knob.kind == "optional_text":
        return str(shown).strip() or None
    return shown


def override_text(path: str, value: Any) -> str:
    """``section.field=value`` with the value as TOML (what ``parse_override`` reads back)."""
    text = tomli_w.dumps({"v": value}).strip()
    return f"{path}={text.removeprefix('v = ')}"


def knob_overrides(base: Scenario, values: dict[str, Any]) -> list[str]:
    """Overrides for the knobs whose value differs from ``base`` (``values``: path -> model value)."""
    out = []
    for knob in KNOBS:
        if knob.path not in values:
            continue
        new = values[knob.path]
        if new == value_at(base, knob.path):
            continue
        if new is None:  # an optional field cleared: TOML has no null, drop it instead
            out.append(f"{knob.path}=")
        else:
            out.append(override_text(knob.path, new))
    return out


def parse_override_lines(text: str) -> list[str]:
    """The advanced-overrides box: one ``section.field=value`` per line; blank and ``#`` lines skipped."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def edited(raw: dict, overrides: list[str], source: str) -> Scenario:
    """The scenario ``raw`` with ``overrides`` applied, validated; a ``ScenarioError`` otherwise.

    An override ``section.field=`` (empty value) removes an optional field (e.g. ``workload.traces``);
    TOML has no null.
    """
    keep = [o for o in overrides if o.partition("=")[2].strip() or "=" not in o]
    drop = [o.partition("=")[0].strip() for o in overrides if o not in keep]
    table = apply_overrides(raw, keep, source)
    for key in drop:
        *parents, last = key.split(".")
        node = table
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return validate(table, f"{source} (edited)" if overrides else source)


def error_lines(e: ScenarioError) -> list[str]:
    return [line for line in str(e).splitlines() if line.strip()]


def field_errors(lines: list[str], path: str) -> list[str]:
    """The error lines that name ``path`` (as ``path:`` or ``path (...)`` or ``path=``)."""
    pat = re.compile(rf"(?<![\w.]){re.escape(path)}(?![\w.])")
    return [line for line in lines if pat.search(line)]


def parse_upload(data: bytes, filename: str) -> tuple[dict, str]:
    """An uploaded TOML file as (raw table, source label); ``ScenarioError`` naming the file.

    The bytes are read as a scenario file is (``kvpool.scenario.load.read_toml_bytes``: size, UTF-8,
    TOML, nesting depth, integer width), then validated."""
    label = f"upload {filename}"
    raw = read_toml_bytes(data, label)
    validate(raw, label)
    return raw, label
