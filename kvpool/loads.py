"""Parsing a list of loads typed by a user (``--sessions 56,72,96`` in the CLI, the dashboard's
load field).

Contract: ``parse_loads(text, flag, integer)`` turns ``"56,72,96"`` into ``[56, 72, 96]`` (ints when
``integer``, else floats); ``None`` gives ``[]``. A value that is not a number, or not > 0, raises
``kvpool.errors.UserError`` naming ``flag``, the text and an example of a valid list.
"""

from __future__ import annotations

from kvpool.errors import UserError


def parse_loads(text: str | None, flag: str, integer: bool) -> list[float]:
    """``56,72,96`` -> [56, 72, 96]; every value positive."""
    if text is None:
        return []
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            v = int(part) if integer else float(part)
        except ValueError:
            raise UserError(f"{flag} {text!r}: {part!r} is not a{'n integer' if integer else ' number'}; "
                            f"give a comma-separated list such as {'56,72,96,112' if integer else '0.6,0.8,1.0'}") from None
        if v <= 0:
            raise UserError(f"{flag} {text!r}: every value must be > 0, got {part}")
        out.append(v)
    return out
