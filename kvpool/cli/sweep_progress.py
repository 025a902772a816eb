"""The progress bars of a sweep (``kvpool sim run``, ``kvpool sim compare``) on stderr.

Contract: ``SweepBars(console, description, loads, disable=)`` is a context manager showing one bar
for the loads finished and, under it, one bar per load in flight that moves with the load's
simulated time (``sim.engine.RunProgress``): the warm-up's requests (AgentX lanes: done, started,
and the simulated clock), then the simulated seconds of the measured window, then "finishing
requests in flight" while the requests still running at the window's end complete, and "done".
``sweep_callbacks(prefix, key)`` gives ``sim.run.sweep`` its ``on_progress`` and ``on_done`` for
loads labelled ``{prefix}{load} {key}`` (``56 sessions``, ``shared: 0.8 rps``); a load given twice
in one sweep shares one bar. Loads that report no progress of their own (Ray tasks) show only in
the bar of loads finished. ``disable``: no output at all and no reports asked for (the ``--json``
runs, whose stdout stays the document and whose stderr stays quiet). The bars are transient: they
vanish when the sweep ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from kvpool.sim.engine import RunProgress


def describe(p: RunProgress) -> tuple[float, float, str]:
    """A load's bar: (completed, total, text), e.g. ``(1234, 3600, "simulated 1,234 of 3,600 s")``."""
    if p.finished:
        return 1, 1, "done"
    if p.window_start_s is None:
        done = p.warmup_total - p.warmup_left
        return done, max(p.warmup_total, 1), (f"warm-up: {done:,}/{p.warmup_total:,} requests done, "
                                               f"{p.requests_started:,} started, {p.now_s:,.0f} s")
    if p.window_done_s < p.window_s:
        return p.window_done_s, p.window_s, f"simulated {p.window_done_s:,.0f} of {p.window_s:,.0f} s"
    return p.window_s, p.window_s, "finishing requests in flight"


class SweepBars:
    """See the module docstring."""

    def __init__(self, console: Console, description: str, loads: int, *, disable: bool) -> None:
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[text]}"),
                                 TimeElapsedColumn(), console=console, transient=True, disable=disable)
        self.loads = loads
        self.disabled = disable
        self.finished = 0
        self.total = self.progress.add_task(description, total=loads, text=self._loads_text())
        self.running: dict[str, TaskID] = {}

    def __enter__(self) -> SweepBars:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def _loads_text(self) -> str:
        return f"{self.finished}/{self.loads} loads"

    def sweep_callbacks(self, prefix: str, key: str) -> dict[str, Callable]:
        """``sim.run.sweep``'s ``on_progress`` and ``on_done`` (keyword arguments) for this sweep's loads."""
        def label(load: float) -> str:
            return f"{prefix}{load:g} {key}"

        callbacks = {"on_done": lambda load, _result: self.on_done(label(load))}
        if not self.disabled:  # no reports to show: worker processes need no queue for them
            callbacks["on_progress"] = lambda load, p: self.on_progress(label(load), p)
        return callbacks

    def on_progress(self, label: str, p: RunProgress) -> None:
        completed, total, text = describe(p)
        task = self.running.get(label)
        if task is None:
            self.running[label] = self.progress.add_task(f"  {label}", total=total, completed=completed, text=text)
        else:
            self.progress.update(task, completed=completed, total=total, text=text)

    def on_done(self, label: str) -> None:
        task = self.running.pop(label, None)
        if task is not None:
            self.progress.remove_task(task)
        self.finished += 1
        self.progress.update(self.total, completed=self.finished, text=self._loads_text())
