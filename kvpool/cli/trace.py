"""``kvpool trace``: Agent-session traces: stats, synthetic generation, conversion."""

from __future__ import annotations

import typer

app = typer.Typer(help="Agent-session traces: stats, synthetic generation, conversion.", no_args_is_help=True)
