"""One request's state on its way through the steps (``sim.lifecycle``).

Contract: a ``Request`` is made when the request arrives and filled in as it goes: ``rec`` (its
``RequestRecord``, which the run returns) from the start; ``prefill``/``decode`` once routed;
``prompt`` and ``play`` (its ``sim.prompt`` values) and the lookup's results (``hits``,
``hit_entry``, ``lead``, ``last_insert``, ``in_dram``) once looked up. ``finished(d)`` is the
driver's, called once when the request is done or rejected.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvpool.policy.hits import HitResult
from kvpool.sim.gpucache import LogEntry
from kvpool.sim.instances import DecodeInstance, PrefillInstance
from kvpool.sim.prompt import PlayPrompts, Prompt
from kvpool.workload.records import RequestRecord


class Request:
    """See the module docstring."""

    __slots__ = ("d", "rec", "finished", "prefill", "decode", "prompt", "play", "hits", "hit_entry", "lead",
                 "last_insert", "in_dram")

    def __init__(self, d, rec: RequestRecord, finished: Callable[[object], None]) -> None:
        self.d = d  # the replay's Dispatch
        self.rec = rec
        self.finished = finished
        self.prefill: PrefillInstance | None = None
        self.decode: DecodeInstance | None = None
        self.prompt: Prompt | None = None
        self.play: PlayPrompts | None = None
        self.hits: HitResult | None = None
        self.hit_entry: LogEntry | None = None  # the GPU cache's log entry of the prompt's hit
        self.lead: LogEntry | None = None  # the thread's latest insert, when known to lead the prompt
        self.last_insert: tuple | None = None  # the thread's latest insert at the lookup (PlayPrompts.inserts)
        self.in_dram: np.ndarray | None = None  # with an SSD tier: per chunk, held by every rank in DRAM
