"""``kvpool sim``: Run the simulator: single runs, sweeps over sessions or RPS, comparisons and capacity search."""

from __future__ import annotations

import typer

app = typer.Typer(help="Run the simulator: single runs, sweeps over sessions or RPS, comparisons and capacity search.", no_args_is_help=True)
