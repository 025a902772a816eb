"""``kvpool pool``: Start and inspect a real Mooncake Store pool on 127.0.0.1 (master + store services)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Start and inspect a real Mooncake Store pool on 127.0.0.1 (master + store services).", no_args_is_help=True)
