"""``kvpool dashboard``: Start the Streamlit capacity-planning dashboard on 127.0.0.1."""

from __future__ import annotations

import typer

app = typer.Typer(help="Start the Streamlit capacity-planning dashboard on 127.0.0.1.", no_args_is_help=True)
