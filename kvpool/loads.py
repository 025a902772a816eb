"""Parsing a list of loads typed by a user (``--sessions 56,72,96`` in the CLI, the dashboard's
load field).

Contract: ``parse_loads(text, flag, integer, field)`` turns ``"56,72,96"`` into ``[56, 72, 96]``
(ints when ``integer``, else floats); ``None`` gives ``[]``. Each value is written in ASCII digits
without ``_`` separators (Python's ``int`` would take ``١٢`` or ``1_0``) and must be a finite number
> 0 and, when ``field`` names a scenario field (``workload.sessions``, ``workload.rps``), valid
for that field (its type and bounds, ``kvpool.scenario.fields``). At most ``MAX_LOADS`` values.
Anything else raises ``kvpool.errors.UserError`` naming ``flag``, the text and what is allowed.
"""

from __future__ import annotations

import math

from kvpool.errors import UserError

MAX_LOADS = 64
_MAX_TEXT = 2048


def parse_loads(text: str | None, flag: str, integer: bool, field: str | None = None) -> list[float]:
    """``56,72,96`` -> [56, 72, 96]; every value positive, finite and within ``field``'s bounds."""
    if text is None:
        return []
    example = "56,72,96,112" if integer else "0.6,0.8,1.0"
    if len(text) > _MAX_TEXT:
        raise UserError(f"{flag}: a list of {len(text)} characters; give at most {MAX_LOADS} loads, e.g. {example}")
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > MAX_LOADS:
        raise UserError(f"{flag}: {len(parts)} loads; at most {MAX_LOADS}")
    out = []
    for part in parts:
        try:
            if integer and len(part.lstrip("+-")) > 18 or not part.isascii() or "_" in part:
                raise ValueError(part)  # int()/float() take other scripts' digits and 1_000; a flag does not
            v = int(part) if integer else float(part)
        except ValueError:
            shown = part if len(part) <= 40 else part[:30] + "..."
            raise UserError(f"{flag} {text!r}: {shown!r} is not a{'n integer' if integer else ' number'}; "
                            f"give a comma-separated list such as {example}") from None
        if not math.isfinite(v):
            raise UserError(f"{flag} {text!r}: every value must be a finite number, got {part}")
        if v <= 0:
            raise UserError(f"{flag} {text!r}: every value must be > 0, got {part}")
        if field is not None:
            from kvpool.scenario.fields import check

            check(field, v, flag)
        out.append(v)
    return out
