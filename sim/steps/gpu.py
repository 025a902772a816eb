"""A request's use of its prefill's GPU prefix cache: at the lookup, and the insert after compute.

Contract:
    * ``use(r, now)``: the number of leading blocks of the prompt's cache blocks
      (``r.prompt.cache``) the cache holds; they count as used now (``GPUPrefixCache.use``).
      Sets ``r.gpu_use``.
    * ``insert(r, now)``: the prompt's full blocks are held, used now (``GPUPrefixCache.insert``
      of ``r.gpu_use``), and the insert becomes the thread's latest (``ThreadMemory.insert``).

What the cache is told changes no result, only the work: the prompt's ``Blocks`` bring their
bound and lead (``sim.prompt``), the use its own entry, and the thread's latest insert on this
prefill, when it is not the lead (an insert made since the prompt was built, or one that did not
lead it), comes as ``earlier`` (the cache compares it).
"""

from __future__ import annotations

from kvpool.sim.prompt import Insert
from kvpool.sim.request import Request


def use(r: Request, now: float) -> int:
    r.gpu_use = got = r.prefill.cache.use(r.prompt.cache, now)
    return got.run


def insert(r: Request, now: float) -> None:
    p, prompt = r.prefill, r.prompt
    mem = prompt.memory
    latest = mem.insert
    earlier = None
    if latest is not None and latest.prefill == p.index and latest.entry is not prompt.cache.lead:
        earlier = latest.entry
    entry = p.cache.insert(r.gpu_use, now, r.d.session.block_tokens, earlier)
    mem.insert = Insert(p.index, entry, prompt.request)
