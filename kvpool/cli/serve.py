"""``kvpool serve``: Production mode: drive real prefill/decode workers on GPUs with the connector and handoff."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="Production mode: drive real prefill/decode workers on GPUs with the connector and handoff. "
    "Not built yet: this group has no commands.",
    no_args_is_help=True,
)
