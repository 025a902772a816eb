"""The compute step: the prefill computes what no cache held, and its GPU cache keeps the prompt.

Contract: ``Compute(world)(r, then)`` queues ``r``'s computed tokens (after its reused ones, the
context) on its prefill instance (chunked prefill, ``PrefillInstance.compute``), stamping the
record's ``compute_queued_s`` and keeping the queued compute as ``r.compute_ev``. When they are
done: the record's ``compute_start_s`` (its first step) and ``prefill_end_s``, the instance's
outstanding tokens drop, its full pages are committed to the GPU prefix cache
(``sim.steps.pages``), and ``then()``. A request that failed meanwhile (``rec.error``) stops
there: the failure gave back what it held.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.sim.request import QUEUED, Request
from kvpool.sim.world import World


class Compute:
    def __init__(self, world: World) -> None:
        self.env = world.env

    def __call__(self, r: Request, then: Callable[[], None]) -> None:
        rec = r.rec
        rec.compute_queued_s = self.env.now
        r.stage = QUEUED
        done = r.compute_ev = r.prefill.compute(rec.computed_tokens, rec.in_tokens - rec.computed_tokens)
        done.callbacks.append(lambda e: self._computed(r, e.value, then))

    def _computed(self, r: Request, start_s: float | None, then: Callable[[], None]) -> None:
        now = self.env.now
        rec = r.rec
        if rec.error:
            return
        rec.compute_start_s = rec.compute_queued_s if start_s is None else start_s
        rec.prefill_end_s = now
        r.prefill.outstanding_tokens -= rec.in_tokens
        r.prefill.pages.commit(r)
        then()
