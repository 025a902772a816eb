"""Helpers shared by the CLI sub-apps: user errors (``kvpool.errors.UserError``) and scenario loading with ``--set``."""

from __future__ import annotations

import typer

from kvpool.errors import UserError, printable
from kvpool.scenario import Scenario, ScenarioError, load_scenario

__all__ = ["SET_HELP", "UserError", "load_or_exit"]


SET_HELP = "Override a scenario field, e.g. --set pool.gib_per_service=512 (repeatable)."


def load_or_exit(name_or_path: str, overrides: list[str] | None = None) -> Scenario:
    """Load a scenario, turning every problem into a clear message and exit status 2."""
    try:
        s = load_scenario(name_or_path, overrides or [])
    except ScenarioError as e:
        for line in str(e).split("\n"):
            typer.echo(f"error: {printable(line)}", err=True)
        raise typer.Exit(2) from None
    if s.cost.calibration is not None:  # a bad calibration file is the scenario's error, said before any run
        from kvpool.sim.calibration import CalibrationError, load_calibration

        try:
            load_calibration(s.cost.calibration)
        except CalibrationError as e:
            typer.echo(f"error: cost.calibration: {printable(str(e))}", err=True)
            raise typer.Exit(2) from None
    return s
