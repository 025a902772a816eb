"""The simulation of one load: a scenario's cluster (``sim.world``) serving a replay schedule
(``sim.driver``), one request at a time through ``sim.lifecycle``'s steps, in SimPy.

``Simulation(s, replay).run()`` returns the per-request records; the world's parts (``env``,
``pool``, ``prefills``, ``decodes``, ``keys``, ``net``, ``ssd_links``, ``timeline``, ``gate``)
stay readable after the run.

``run(on_progress=f)`` also calls ``f(RunProgress)`` as simulated time advances: once at the
start, every ``sim.events.REPORT_EVERY_ENTRIES`` queue entries (some 20 times a CPU second, never
per event) and once at the end (``finished``, ``now_s`` the run's end). The callback only reads;
the run and its records are the same with or without it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.scenario.model import Scenario
from kvpool.sim.cost import CostModel
from kvpool.sim.driver import drive
from kvpool.sim.events import run_all
from kvpool.sim.lifecycle import Lifecycle
from kvpool.sim.world import World
from kvpool.workload.records import RequestRecord


@dataclass(frozen=True)
class RunProgress:
    """Where one simulation stands, for a progress display.

    A run has three parts: the warm-up (AgentX lanes: ``warmup_left`` of ``warmup_total`` primer
    and warm-up requests still to finish; production replay has none), the measured window (from
    ``window_start_s``, None until it opens, for ``window_s`` simulated seconds) and the drain
    (requests in flight at the window's end finish; nothing new starts). ``finished``: the run is
    over and ``now_s`` is its end. ``requests_started``: requests the cluster took in so far (all
    kinds); it moves even while the clock stands still (a warm-up of many lanes starts every
    lane's first requests at time 0).
    """

    now_s: float
    requests_started: int
    warmup_left: int
    warmup_total: int
    window_start_s: float | None
    window_s: float
    finished: bool = False

    @property
    def window_done_s(self) -> float:
        """Simulated seconds of the measured window so far: 0 before it opens, ``window_s`` once it closed."""
        if self.window_start_s is None:
            return 0.0
        return min(max(self.now_s - self.window_start_s, 0.0), self.window_s)


class Simulation:
    """One scenario, one replay schedule; ``run()`` returns the per-request records."""

    def __init__(self, s: Scenario, replay, *, cost: CostModel | None = None, unbounded: bool = False) -> None:
        """``replay``: an AgentXReplay or ProductionReplay (workload.replay's driver interface).
        ``unbounded``: infinite GPU caches and pool (the trace-ceiling check)."""
        self.s = s
        self.replay = replay
        self.world = w = World(s, cost=cost, unbounded=unbounded)
        self.lifecycle = Lifecycle(w)
        self.records = self.lifecycle.records
        self.env, self.cost, self.spec, self.keys = w.env, w.cost, w.spec, w.keys
        self.pool, self.prefills, self.decodes, self.gate = w.pool, w.prefills, w.decodes, w.gate
        self.net, self.ssd_links, self.timeline, self.gpus = w.net, w.ssd_links, w.timeline, w.gpus

    def run(self, on_progress: Callable[[RunProgress], None] | None = None) -> list[RequestRecord]:
        """Simulate until nothing is left to do; the records (see the module docstring for ``on_progress``)."""
        # The cyclic collector is off while the model runs (unless the caller turned it off): a run
        # leaves no cyclic garbage to speak of (14 objects after the one-server hour, the four-server
        # and the replay points alike; peak RSS the same), and its collections cost 2-3 % of the
        # hour (young generations) plus a full scan of the workload (~0.2 s) when the replay's
        # first plays set one off.
        enabled = gc.isenabled()
        if enabled:
            gc.disable()
        try:
            drive(self.env, self.replay, self.lifecycle.serve)
            if on_progress is None:
                run_all(self.env)
            else:
                warmup_total = self.replay.warmup_left  # every first play's primers and warm-up, set by start
                on_progress(self.progress(warmup_total))
                run_all(self.env, lambda: on_progress(self.progress(warmup_total)))
                on_progress(self.progress(warmup_total, finished=True))
        finally:
            if enabled:
                gc.enable()
        return self.records

    def progress(self, warmup_total: int, finished: bool = False) -> RunProgress:
        """The run's ``RunProgress`` now (the replay's ``window_start_s``, ``duration_s``, ``warmup_left``)."""
        r = self.replay
        return RunProgress(now_s=self.env.now, requests_started=len(self.records), warmup_left=r.warmup_left,
                           warmup_total=warmup_total, window_start_s=r.window_start_s, window_s=r.duration_s,
                           finished=finished)
