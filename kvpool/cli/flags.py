"""Strict reading of every number and path a ``kvpool`` command takes on its command line.

typer reads an ``int`` flag as pydantic's lax integer (``1.0``, `` 7``, ``+7`` and ``1_0`` become
1, 7, 7 and 10) and a ``float`` flag as Python's ``float`` (``1_0``, `` 2 ``); a path is any
string, the empty one and ``-`` included. ``strict(app)`` gives every ``int``, ``float`` and
``Path`` option and argument of every command of ``app`` (sub-apps included) a parser of this
module, so a mistake is one ``error:`` line naming the flag (exit 2) before the command runs. The
ranges stay with the fields the flags stand for (``kvpool.scenario.fields``) and with each command.

Contract:
    * ``parse_int(text)``: ASCII digits with an optional leading ``-`` (at most 30 digits), else
      ``ValueError`` saying what an integer is.
    * ``parse_float(text)``: a decimal number (``2``, ``-0.5``, ``.5``, ``1e-3``) or ``inf``/``nan``
      (refused by the field checks with their own words), else ``ValueError``.
    * ``parse_path(text)``: a ``Path``; no NUL byte. ``parse_output_path(text)``: the same, and neither
      empty nor ``-`` (standard output is no file name here). The flags read as output paths are
      ``OUTPUT_FLAGS``.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from kvpool.errors import printable

#: Flags naming a file or directory a command writes (or creates).
OUTPUT_FLAGS = frozenset({"--out", "--run-dir", "--work-dir", "--state-file"})

_INT = re.compile(r"-?[0-9]{1,30}")
_FLOAT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]{1,4})?|[-+]?(inf|infinity|nan)", re.IGNORECASE)


def _shown(text: str) -> str:
    return repr(printable(text[:40]) + ("..." if len(text) > 40 else ""))


def parse_int(text: Any) -> int:
    """``text`` as an integer: ASCII digits, an optional leading ``-``."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if not isinstance(text, str) or not _INT.fullmatch(text):
        raise ValueError(f"{_shown(str(text))} is not an integer (digits, an optional leading -, at most 30)")
    return int(text)


def parse_float(text: Any) -> float:
    """``text`` as a number: decimal or exponent notation (``inf``/``nan`` are left to the range checks)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    if not isinstance(text, str) or not _FLOAT.fullmatch(text):
        raise ValueError(f"{_shown(str(text))} is not a number (e.g. 2, 0.5, 1e-3)")
    return float(text)


def parse_path(text: Any) -> Path:
    """``text`` as a path; a NUL byte cannot be in one."""
    if isinstance(text, Path):
        text = str(text)
    if "\0" in text:
        raise ValueError(f"{_shown(text)} holds a NUL byte, which no path can")
    return Path(text)


def parse_output_path(text: Any) -> Path:
    """``text`` as a path a command writes: not empty, not ``-``, no NUL byte."""
    if isinstance(text, Path):
        text = str(text)
    if text == "":
        raise ValueError("an empty path; give a file or directory name")
    if text == "-":
        raise ValueError("'-' (standard output) is not a file name here; give a file or directory name (./- for one named '-')")
    return parse_path(text)


def _parser_for(annotation: Any, decls: tuple[str, ...]) -> Callable[[Any], Any] | None:
    args = [a for a in typing.get_args(annotation) if a is not type(None)] if typing.get_origin(annotation) in (
        typing.Union, getattr(__import__("types"), "UnionType", None)) else [annotation]
    if len(args) != 1:
        return None
    kind = args[0]
    if kind is int:
        return parse_int
    if kind is float:
        return parse_float
    if kind is Path:
        return parse_output_path if OUTPUT_FLAGS.intersection(decls) else parse_path
    return None


def strict(app: typer.Typer) -> typer.Typer:
    """Give every int, float and Path parameter of ``app``'s commands (sub-apps too) its strict parser."""
    for command in app.registered_commands:
        callback = command.callback
        if callback is None:
            continue
        hints = typing.get_type_hints(callback)
        for name, param in inspect.signature(callback).parameters.items():
            info = param.default
            if not isinstance(info, (typer.models.OptionInfo, typer.models.ArgumentInfo)) or info.parser is not None:
                continue
            parser = _parser_for(hints.get(name), tuple(getattr(info, "param_decls", None) or ()))
            if parser is not None:
                info.parser = parser
    for group in app.registered_groups:
        if group.typer_instance is not None:
            strict(group.typer_instance)
    return app
