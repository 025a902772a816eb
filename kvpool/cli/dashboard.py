"""``kvpool dashboard``: start the Streamlit capacity-planning dashboard on 127.0.0.1 (a command, no sub-commands)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from kvpool.cli.common import UserError

ADDRESS = "127.0.0.1"  # the dashboard binds loopback only (design.md: servers bind to 127.0.0.1)


def app_file() -> Path:
    """The dashboard's Streamlit entry script inside the installed package."""
    import kvpool.dashboard

    return Path(kvpool.dashboard.__file__).with_name("app.py")


def streamlit_command(port: int) -> list[str]:
    """The ``streamlit run`` command line: headless, on 127.0.0.1:``port``, no usage statistics."""
    return [
        sys.executable, "-m", "streamlit", "run", str(app_file()),
        "--server.address", ADDRESS,
        "--server.port", str(port),
        "--server.headless", "true",
        "--browser.gatherUsageStats", "false",
        "--server.fileWatcherType", "none",
        "--global.developmentMode", "false",
        "--client.toolbarMode", "viewer",
    ]


def dashboard(
    port: int = typer.Option(8501, "--port", help="TCP port on 127.0.0.1 to serve the dashboard on."),
) -> None:
    """Start the Streamlit capacity-planning dashboard (Scenario, Run, Compare, Plan pages) at
    http://127.0.0.1:PORT; Ctrl-C stops it."""
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port}: must be 1..65535")
    try:
        import streamlit  # noqa: F401
    except ImportError:
        raise UserError("the dashboard needs Streamlit: run scripts/setup.sh dashboard (or pip install 'kvpool[dashboard]')") from None
    typer.echo(f"kvpool dashboard: http://{ADDRESS}:{port} (Ctrl-C stops it)", err=True)
    cmd = streamlit_command(port)
    # Become the Streamlit server (no child left behind when this process is signalled).
    os.execve(cmd[0], cmd, {**os.environ, "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"})
