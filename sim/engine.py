"""The simulation of one load: a scenario's cluster (``sim.world``) serving a replay schedule
(``sim.driver``), one request at a time through ``sim.lifecycle``'s steps, in SimPy.

``Simulation(s, replay).run()`` returns the per-request records; the world's parts (``env``,
``pool``, ``prefills``, ``decodes``, ``keys``, ``net``, ``ssd_links``, ``timeline``, ``gate``)
stay readable after the run.
"""

from __future__ import annotations

import gc

from kvpool.scenario.model import Scenario
from kvpool.sim.cost import CostModel
from kvpool.sim.driver import drive
from kvpool.sim.events import run_all
from kvpool.sim.lifecycle import Lifecycle
from kvpool.sim.world import World
from kvpool.workload.records import RequestRecord


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

    def run(self) -> list[RequestRecord]:
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
            run_all(self.env)
        finally:
            if enabled:
                gc.enable()
        return self.records
