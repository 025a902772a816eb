"""The scenario model's fields as the one validation layer of every front end.

A value typed anywhere (a TOML file, a ``--set`` override, a CLI flag such as ``--duration`` or
``--sessions``, a dashboard input) is checked against the model field it stands for, with that
field's type (strict: no bool as a number, no string coerced), finiteness and range; the flags
have no bounds of their own.

Contract:
    * ``field_info(path)``: the pydantic ``FieldInfo`` of ``section.field`` (``KeyError`` if none).
    * ``allowed(info)``: the field's type and range in words, e.g. ``an integer, > 0 and <= 1024``
      (``docs/scenario.md`` and every error message use it).
    * ``check(path, value, label)``: the validated value, or a ``UserError`` of one line naming
      ``label`` (the flag or input the user typed), the value and what is allowed.
"""

from __future__ import annotations

import math
import typing
from functools import lru_cache
from typing import Annotated, Any

import annotated_types as at
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from kvpool.errors import UserError
from kvpool.scenario.model import PLAIN_TEXT, Scenario


def field_info(path: str) -> FieldInfo:
    """The ``FieldInfo`` of ``section.field`` (``seed``, ``workload.duration_s``, ``pool.ssd.enabled``)."""
    cur: Any = Scenario
    parts = path.split(".")
    for part in parts[:-1]:
        cur = cur.model_fields[part].annotation
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)):
            raise KeyError(path)
    return cur.model_fields[parts[-1]]


def _num(x: float) -> str:
    if isinstance(x, int) and abs(x) >= 1 << 20 and (x & (x - 1)) == 0:
        return f"2^{x.bit_length() - 1}"
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        x = int(x)
    return f"{x:,}".replace(",", "_") if isinstance(x, int) and abs(x) >= 100_000 else f"{x:g}"


def _bounds(metadata: list) -> list[str]:
    out = []
    flat: list = []
    for m in metadata:
        flat += m.metadata if isinstance(m, FieldInfo) else [m]
    for m in flat:
        for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            v = getattr(m, attr, None)
            if v is not None and isinstance(m, (at.Gt, at.Ge, at.Lt, at.Le, at.Interval)):
                out.append(f"{op} {_num(v)}")
        if isinstance(m, at.MinLen) and m.min_length > 0:
            out.append(f"at least {m.min_length} long")
        if isinstance(m, at.MaxLen):
            out.append(f"at most {m.max_length} long")
        if getattr(m, "pattern", None) == PLAIN_TEXT:
            out.append("without control characters")
    return out


def _kind(ann: Any) -> str:
    args = typing.get_args(ann)
    origin = typing.get_origin(ann)
    if origin is Annotated:
        inner = _kind(args[0])
        b = _bounds(list(args[1:]))
        return f"{inner} " + " and ".join(b) if b else inner
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"a list of ({_kind(args[0])})"
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        kinds = [_kind(a) for a in args if a is not type(None)]
        return " or ".join(kinds) + (" or absent" if type(None) in args else "")
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "a table"
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(
        ann, getattr(ann, "__name__", str(ann)))


def allowed(info: FieldInfo) -> str:
    """The field's type and range in words: ``a finite number, > 0 and <= 604_800``."""
    kind = _kind(info.annotation)
    bounds = _bounds(info.metadata)
    return f"{kind}, " + " and ".join(bounds) if bounds else kind


@lru_cache(maxsize=None)
def _adapter(path: str) -> TypeAdapter:
    info = field_info(path)
    return TypeAdapter(Annotated[info.annotation, info])


_OPS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def check(path: str, value: Any, label: str) -> Any:
    """``value`` validated as the field ``path``; a ``UserError`` naming ``label`` otherwise, e.g.
    ``--duration -1: must be > 0; allowed: a finite number, > 0 and <= 604_800 (workload.duration_s)``."""
    try:
        return _adapter(path).validate_python(value)
    except ValidationError as e:
        err = e.errors()[0]
        if isinstance(value, float) and not math.isfinite(value):
            why = "must be a finite number"
        elif err["type"] in _OPS:
            why = f"must be {_OPS[err['type']]} {_num(next(iter(err.get('ctx', {}).values()), 0))}"
        elif err["type"] == "finite_number":
            why = "must be a finite number"
        else:
            why = err["msg"].removeprefix("Value error, ")
        shown = f"{value:g}" if isinstance(value, float) and math.isfinite(value) else repr(value)
        raise UserError(f"{label} {shown}: {why}; allowed: {allowed(field_info(path))} ({path})") from None
