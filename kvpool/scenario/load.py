"""Load scenarios from TOML (a file or a built-in name), apply ``--set`` overrides, report errors.

Every user mistake becomes a ``ScenarioError`` whose message names the file, the field, the value
and what is allowed, on one line per problem; the CLI prints it without a traceback.
"""

from __future__ import annotations

import copy
import re
import tomllib
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel, ValidationError

from kvpool.errors import UserError, printable
from kvpool.outputs import check_path_length
from kvpool.scenario.model import Scenario


class ScenarioError(ValueError):
    """A scenario (file, name or override) that cannot be used; the message is for the user."""


def builtin_names() -> list[str]:
    """Names of the built-in scenarios (``scenarios/*.toml``)."""
    root = resources.files("kvpool.scenarios")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


MAX_SCENARIO_BYTES = 1 << 20   # a scenario file is a few KiB
MAX_OVERRIDE_CHARS = 4096      # one --set value
MAX_INT_BITS = 64              # wider than every bound of the model
_WIDE_INT = "an integer wider than 64 bits; every field's bound is smaller (docs/scenario.md)"


MAX_DEPTH = 16                 # tables and arrays in one another; the model has 4 levels


def _path(path: str, k: Any) -> str:
    return f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k)


def _wide_int_at(value: Any) -> str | None:
    """The path of the first integer in a parsed TOML value wider than ``MAX_INT_BITS`` (in any
    notation: decimal, hex, octal, binary), else ``None``. Such an integer is refused before anything
    prints it (its decimal form may exceed Python's conversion limit). ``value`` is at most
    ``MAX_DEPTH`` levels deep (``_too_deep_at``)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, int) and not isinstance(v, bool):
            if v.bit_length() > MAX_INT_BITS:
                return path
            continue
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        stack.extend(reversed([(_path(path, k), x) for k, x in items]))
    return None


def _too_deep_at(value: Any) -> str | None:
    """The path of the first table or array nested more than ``MAX_DEPTH`` levels deep, else ``None``
    (walked without recursion, so any depth is safe)."""
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        path, v, depth = stack.pop()
        if not isinstance(v, (dict, list)):
            continue
        if depth >= MAX_DEPTH:
            return path
        items = v.items() if isinstance(v, dict) else enumerate(v)
        stack.extend((_path(path, k), x, depth + 1) for k, x in items)
    return None


def _integer_limit(e: ValueError) -> bool:
    """Whether ``e`` is Python's refusal to convert an integer of too many digits."""
    return "integer string conversion" in str(e)


def _line_shown(text: str, message: str) -> str:
    """``: 'LINE'`` for the line a TOML error names ``(at line N, ...)``, so a key given twice is named."""
    m = re.search(r"\(at line (\d+),", message)
    lines = text.splitlines()
    if m is None or not 1 <= int(m.group(1)) <= len(lines):
        return ""
    return f": {_short(lines[int(m.group(1)) - 1].strip())}"


def _read_toml(text: str, source: str) -> dict:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{source}: not valid TOML: {e}{_line_shown(text, str(e))}") from None
    except ValueError as e:
        if _integer_limit(e):
            raise ScenarioError(f"{source}: {_WIDE_INT}") from None
        raise ScenarioError(f"{source}: not a usable TOML document: {type(e).__name__}: {str(e)[:200]}") from None
    except RecursionError:
        raise ScenarioError(f"{source}: not a usable TOML document: nested too deeply") from None
    deep = _too_deep_at(raw)
    if deep is not None:
        shown = deep if len(deep) <= 80 else deep[:60] + f"... ({len(deep)} characters)"
        raise ScenarioError(f"{source}: {shown}: tables and arrays nested more than {MAX_DEPTH} levels deep; "
                            "a scenario has 4 (docs/scenario.md)")
    where = _wide_int_at(raw)
    if where is not None:
        raise ScenarioError(f"{source}: {where}: {_WIDE_INT}")
    return raw


def read_toml_bytes(data: bytes, source: str) -> dict:
    """The raw table of a scenario file's bytes: UTF-8 (a leading byte-order mark is skipped), at most
    ``MAX_SCENARIO_BYTES``, valid TOML, at most ``MAX_DEPTH`` levels deep, no integer wider than
    ``MAX_INT_BITS``; a ``ScenarioError`` naming ``source`` otherwise."""
    if len(data) > MAX_SCENARIO_BYTES:
        raise ScenarioError(f"{source}: larger than {MAX_SCENARIO_BYTES} bytes; a scenario file is a few KiB")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ScenarioError(f"{source}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                            "a scenario is TOML in UTF-8") from None
    return _read_toml(text, source)


def read_raw(name_or_path: str | Path) -> tuple[dict, str]:
    """The raw TOML table of a built-in name or a file, and a label naming where it came from."""
    p = Path(name_or_path)
    try:
        check_path_length(p, "scenario")
    except UserError as e:
        raise ScenarioError(str(e)) from None
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            label = printable(str(p))
            raise ScenarioError(f"{label}: no such scenario file" if not p.exists() else f"{label}: not a regular file")
        try:
            if p.stat().st_size > MAX_SCENARIO_BYTES:
                raise ScenarioError(f"{printable(str(p))}: larger than {MAX_SCENARIO_BYTES} bytes; a scenario file is a few KiB")
            with p.open("rb") as fh:
                data = fh.read(MAX_SCENARIO_BYTES + 1)
        except OSError as e:
            raise ScenarioError(f"{printable(str(p))}: cannot read: {e.strerror or e}") from None
        label = printable(str(p))
        return read_toml_bytes(data, label), label
    name = str(name_or_path)
    if name not in builtin_names():
        raise ScenarioError(
            f"{_short(name)} is neither a scenario file nor a built-in scenario; built-in: {', '.join(builtin_names())}"
        )
    text = resources.files("kvpool.scenarios").joinpath(f"{name}.toml").read_text(encoding="utf-8")
    return _read_toml(text, f"scenarios/{name}.toml"), f"scenarios/{name}.toml"


def _allowed(model: type[BaseModel], path: list[str]) -> str:
    """The fields allowed at ``path`` (for an unknown-field message)."""
    cur: Any = model
    for part in path:
        f = getattr(cur, "model_fields", {}).get(part)
        if f is None:
            break
        ann = f.annotation
        cur = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if cur is None:
            return ""
    if cur is None or not hasattr(cur, "model_fields"):
        return ""
    return ", ".join(cur.model_fields)


def _field_help(model: type[BaseModel], loc: tuple) -> str:
    cur: Any = model
    for part in loc:
        if not isinstance(part, str) or cur is None:
            return ""
        f = cur.model_fields.get(part)
        if f is None:
            return ""
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cur = ann
        else:
            from kvpool.scenario.fields import allowed

            return "; ".join(x for x in (f.description, "allowed: " + allowed(f)) if x)
    return ""


def format_validation_error(err: ValidationError, source: str, raw: Mapping) -> str:
    """One line per problem: ``source: field: value V: message``."""
    lines = []
    for e in err.errors():
        loc = tuple(x for x in e["loc"])
        field = ".".join(str(x) for x in loc) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            parent = [str(x) for x in loc[:-1] if isinstance(x, str)]
            allowed = _allowed(Scenario, parent)
            lines.append(f"{source}: {field}: unknown field" + (f"; allowed: {allowed}" if allowed else ""))
            continue
        if e["type"] == "missing":
            lines.append(f"{source}: {field}: required field is missing")
            continue
        if e["type"] == "string_pattern_mismatch":
            msg = "has a control character (a newline, a tab, an escape): it is one line of plain text"
        value = e.get("input")
        shown = "" if isinstance(value, (dict, list)) or not loc else f" value {_short(value)}:"
        if not loc:  # a check across fields names them itself
            lines.append(f"{source}: {msg}")
            continue
        hint = _field_help(Scenario, loc)
        lines.append(f"{source}: {field}:{shown} {msg}" + (f" ({hint})" if hint else ""))
    return "\n".join(lines)


def _short(value: Any) -> str:
    """A value for a one-line message: its repr (control characters escaped), cut when long."""
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def parse_override(text: str) -> tuple[list[str], Any]:
    """``section.field=value`` -> (path, value). The value is read as TOML, else as a string.

    A value longer than ``MAX_OVERRIDE_CHARS`` is refused before it is parsed, one holding an integer
    wider than ``MAX_INT_BITS`` (in any notation) once it is."""
    if "=" not in text:
        raise ScenarioError(f"--set {_short(text)}: expected section.field=value")
    key, _, val = text.partition("=")
    path = [p for p in key.strip().split(".")]
    if not all(path):
        raise ScenarioError(f"--set {_short(text)}: empty field name in {key!r}")
    val = val.strip()
    if len(val) > MAX_OVERRIDE_CHARS:
        raise ScenarioError(f"--set {key.strip()}: value of {len(val)} characters; at most {MAX_OVERRIDE_CHARS}")
    try:
        value = tomllib.loads(f"v = {val}")["v"]
    except ValueError as e:  # TOMLDecodeError included
        if _integer_limit(e):
            raise ScenarioError(f"--set {key.strip()}: {_WIDE_INT}") from None
        value = val
    except RecursionError:
        value = val
    if _too_deep_at(value) is not None:
        raise ScenarioError(f"--set {key.strip()}: arrays or tables nested more than {MAX_DEPTH} levels deep")
    if _wide_int_at(value) is not None:
        raise ScenarioError(f"--set {key.strip()}: {_WIDE_INT}")
    return path, value


def apply_overrides(raw: dict, overrides: Iterable[str], source: str) -> dict:
    """A copy of ``raw`` with each ``section.field=value`` applied; unknown fields are errors."""
    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        # Check the path against the model, so a typo names what is allowed.
        cur_model: Any = Scenario
        for i, part in enumerate(path):
            fields = getattr(cur_model, "model_fields", None)
            if fields is None or part not in fields:
                where = ".".join(path[:i]) or "top level"
                allowed = ", ".join(fields) if fields else "(no sub-fields)"
                raise ScenarioError(f"--set {text!r}: {where} has no field {part!r}; allowed: {allowed}")
            ann = fields[part].annotation
            cur_model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ScenarioError(f"--set {text!r}: {part} is not a section in {source}")
        node[path[-1]] = value
    return out


def validate(raw: dict, source: str) -> Scenario:
    """A ``Scenario`` from a raw table, or a ``ScenarioError`` naming every bad field."""
    try:
        return Scenario.model_validate(raw)
    except ValidationError as e:
        raise ScenarioError(format_validation_error(e, source, raw)) from None


def load_scenario(name_or_path: str | Path, overrides: Iterable[str] = ()) -> Scenario:
    """Load a built-in scenario by name or a TOML file, with ``--set`` overrides applied."""
    raw, source = read_raw(name_or_path)
    overrides = list(overrides)
    if overrides:
        raw = apply_overrides(raw, overrides, source)
        shown = [o if o.isprintable() and len(o) <= 200 else _short(o) for o in overrides]
        source = f"{source} (with --set {' '.join(shown)})"
    return validate(raw, source)


def to_toml(scenario: Scenario) -> str:
    """The scenario as TOML (round-trips through ``load_scenario``)."""
    data = scenario.model_dump(mode="json", exclude_none=True)
    return tomli_w.dumps(data)
