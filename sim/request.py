"""One request's state on its way through the steps (``sim.lifecycle``).

Contract: a ``Request`` is made when the request arrives and filled in as it goes: ``rec`` (its
``RequestRecord``, which the run returns) from the start; ``prefill``/``decode`` once routed;
``prompt`` (its ``sim.prompt.Prompt``) and the lookup's results (``hits``, ``in_dram``, and
``prefill_request``: its ``policy.prefill_request.PrefillRequest``, which the restore, compute,
save and hand-off report to) once looked up; ``pages`` (``sim.steps.pages``: its pages on its
prefill, held from its admission there until its hand-off and save end) once admitted there;
``stage`` (``QUEUED``: its compute is queued on the prefill, as ``compute_ev``; ``COMPUTED``: its
hand-off is under way; ``DECODING``: it waits for or runs on its decode instance, whose first-token
event is ``first_ev``), which is what a failure has to give back (``sim.lifecycle``). ``finished(d)`` is the driver's, called once when the request is done,
rejected or failed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvpool.policy.hits import HitResult
from kvpool.policy.pagecache import PageAllocation
from kvpool.policy.prefill_request import PrefillRequest
from kvpool.sim.instances import DecodeInstance, PrefillInstance
from kvpool.sim.prompt import Prompt
from kvpool.workload.records import RequestRecord


#: ``Request.stage``: before its compute is queued; compute queued; hand-off under way; at decode
ROUTING, QUEUED, COMPUTED, DECODING = 0, 1, 2, 3


class Request:
    """See the module docstring."""

    __slots__ = ("d", "rec", "finished", "prefill", "decode", "prompt", "hits", "in_dram", "stage",
                 "compute_ev", "first_ev", "pages", "prefill_request")

    def __init__(self, d, rec: RequestRecord, finished: Callable[[object], None]) -> None:
        self.d = d  # the replay's Dispatch
        self.rec = rec
        self.finished = finished
        self.prefill: PrefillInstance | None = None
        self.decode: DecodeInstance | None = None
        self.prompt: Prompt | None = None
        self.hits: HitResult | None = None
        self.in_dram: np.ndarray | None = None  # with an SSD tier: per chunk, held by every rank in DRAM
        self.stage = ROUTING
        self.compute_ev = None  # its compute's done event while queued on the prefill
        self.first_ev = None  # its first token's event once it went to decode
        self.pages: PageAllocation | None = None  # its pages on its prefill, once admitted there
        self.prefill_request: PrefillRequest | None = None  # its prefill lifecycle, once looked up
