"""The compute step: the prefill computes what no cache held, and its GPU cache keeps the prompt.

Contract: ``Compute(world)(r, then)`` queues ``r``'s computed tokens (after its reused ones, the
context) on its prefill instance (chunked prefill, ``PrefillInstance.compute``). When they are
done: the record's ``prefill_end_s``, the instance's outstanding tokens drop, the prompt's full
blocks are inserted in the GPU cache (used now; ``GPUPrefixCache.insert``), the insert is kept
as the thread's latest (``PlayPrompts.inserts``), and ``then()``.

The insert names the log entries it makes stale, so eviction skips them unread: the request's
own hit and, when it is still the thread's latest, the insert the lookup found leading the
prompt (both prefixes by construction); otherwise the thread's latest insert on this prefill,
which the cache compares.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.sim.request import Request
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
        p, prompt, rec = r.prefill, r.prompt, r.rec
        rec.prefill_end_s = now
        p.outstanding_tokens -= rec.in_tokens
        bt = r.d.session.block_tokens
        inserts = r.play.inserts
        latest = inserts.get(prompt.thread)
        if latest is r.last_insert and r.lead is not None:
            entry = p.cache.insert(prompt.gpu_ids, now, bt, max_id=prompt.max_gpu_id, prefixes=(r.hit_entry, r.lead))
        else:
            entry = p.cache.insert(prompt.gpu_ids, now, bt, max_id=prompt.max_gpu_id, prefixes=(r.hit_entry,),
                                   replaces=(latest[1],) if latest is not None and latest[0] == p.index else ())
        inserts[prompt.thread] = (p.index, entry, prompt.request)
        then()
