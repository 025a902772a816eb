"""The compute step: the prefill computes what no cache held, and its GPU cache keeps the prompt.

Contract: ``Compute(world)(r, then)`` queues ``r``'s computed tokens (after its reused ones, the
context) on its prefill instance (chunked prefill, ``PrefillInstance.compute``). When they are
done: the record's ``prefill_end_s``, the instance's outstanding tokens drop, the prompt's full
blocks are held by the GPU cache, used now (``sim.steps.gpu.insert``), and ``then()``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.sim.request import Request
from kvpool.sim.steps import gpu
from kvpool.sim.world import World


class Compute:
    def __init__(self, world: World) -> None:
        self.env = world.env

    def __call__(self, r: Request, then: Callable[[], None]) -> None:
        rec = r.rec
        done = r.prefill.compute(rec.computed_tokens, rec.in_tokens - rec.computed_tokens)
        done.callbacks.append(lambda _e: self._computed(r, then))

    def _computed(self, r: Request, then: Callable[[], None]) -> None:
        now = self.env.now
        rec = r.rec
        rec.prefill_end_s = now
        r.prefill.outstanding_tokens -= rec.in_tokens
        gpu.insert(r, now)
        then()
