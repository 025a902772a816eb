"""``kvpool serve``: production mode, real prefill/decode workers on GPUs with the connector and
handoff. A command that is not built yet: it says so (one ``error:`` line, exit 2)."""

from __future__ import annotations

from kvpool.cli.common import UserError


def serve() -> None:
    """Production mode: drive real prefill/decode workers on GPUs with the connector and handoff.
    Not built yet: the command only says so."""
    raise UserError("kvpool serve (production mode) is not built yet; the pool itself runs with kvpool pool up")
