"""Every number and output path on the command line is read strictly (``kvpool.cli.flags``): an
integer flag given ``1.0``, ``+7``, `` 7`` or ``1_0``, a number flag given ``1_0`` or ``1,5``, and an
output path given as empty or ``-`` are one ``error:`` line naming the flag, exit status 2, for
every command that takes one (found by walking the app, so a new flag is covered)."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import pytest
import typer
from test_fuzz_inputs import cli

from kvpool.cli import app
from kvpool.cli.flags import OUTPUT_FLAGS, parse_float, parse_int, parse_output_path


def _options(t: typer.Typer, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str, object]]:
    out = []
    for c in t.registered_commands:
        hints = typing.get_type_hints(c.callback)
        for name, p in inspect.signature(c.callback).parameters.items():
            if isinstance(p.default, typer.models.OptionInfo):
                kind = [a for a in typing.get_args(hints[name]) if a is not type(None)] or [hints[name]]
                out.append((path + (c.name or c.callback.__name__,), p.default.param_decls[0], kind[0]))
    for g in t.registered_groups:
        out += _options(g.typer_instance, path + (g.name,))
    return out


OPTIONS = _options(app)
CASES = ([(cmd, flag, v) for cmd, flag, kind in OPTIONS if kind is int for v in ("1.0", "+7", " 7", "1_0", "0x10")]
         + [(cmd, flag, v) for cmd, flag, kind in OPTIONS if kind is float for v in ("1_0", "1,5", " 2", "2s")]
         + [(cmd, flag, v) for cmd, flag, kind in OPTIONS if kind is Path and flag in OUTPUT_FLAGS for v in ("", "-")])


def test_the_walk_finds_the_flags_of_every_kind():
    flags = {(" ".join(cmd), flag) for cmd, flag, _ in CASES}
    assert {("sim run", "--seed"), ("trace synth", "--seed"), ("sim run", "--duration"), ("sim run", "--out"),
            ("trace synth", "--out"), ("trace convert", "--out"), ("serve", "--run-dir"), ("pool up", "--state-file"),
            ("replay", "--out"), ("calibrate", "--out"), ("pool status", "--timeout-s")} <= flags


@pytest.mark.parametrize("cmd, flag, value", CASES, ids=[f"{' '.join(c)} {f}={v!r}" for c, f, v in CASES])
def test_a_loose_number_or_an_output_that_is_no_file_is_one_error_naming_the_flag(tmp_path, monkeypatch, cmd, flag, value):
    monkeypatch.chdir(tmp_path)
    code, out, err, _ = cli(*cmd, flag, value)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], (code, err)
    assert "Value error" not in lines[0] and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_the_strict_readers_take_what_they_should():
    assert parse_int("-12") == -12 and parse_int("007") == 7
    assert parse_float("1e-3") == 1e-3 and parse_float(".5") == 0.5 and parse_float("-2") == -2.0
    assert parse_float("inf") == float("inf")  # left to the field checks, which name the field
    assert parse_output_path("./-") == Path("-") and parse_output_path("out") == Path("out")
    for bad in ("1" * 31, "٣", "1e3"):
        with pytest.raises(ValueError):
            parse_int(bad)
    with pytest.raises(ValueError, match="NUL"):
        parse_output_path("a\0b")
