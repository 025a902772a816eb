"""A request's use of its prefill's GPU prefix cache: at the lookup, and the insert after compute.

Contract:
    * ``use(r, now)``: the number of leading blocks of ``r.prompt.gpu_ids`` the cache holds; they
      count as used now (``GPUPrefixCache.use``). Sets ``r.hit_entry`` (the use's log entry),
      ``r.last_insert`` (the thread's latest insert at this moment, ``PlayPrompts.inserts``) and
      ``r.lead``.
    * ``insert(r, now)``: the prompt's full blocks are held, used now (``GPUPrefixCache.insert``),
      and the insert becomes the thread's latest.

What the cache is told (it changes no result, only the work): a ``lead``, the thread's latest
insert on this prefill when it is a prefix of this prompt (known without comparing when this
prompt's ids were copied from that insert's request far enough, ``Prompt.source``/``copied``;
compared otherwise), so ``use`` reads only the blocks past it; and, at the insert, the entries
the new one makes stale: the request's own hit and, while it is still the thread's latest, the
lead (``prefixes``: prefixes by construction), or else the thread's latest insert on this
prefill (``replaces``: the cache compares). Every id is below ``Prompt.max_gpu_id``.
"""

from __future__ import annotations

from kvpool.sim.gpucache import same
from kvpool.sim.request import Request


def use(r: Request, now: float) -> int:
    p, prompt = r.prefill, r.prompt
    ids = prompt.gpu_ids
    last = r.last_insert = r.play.inserts.get(prompt.thread)
    lead = None
    if last is not None and last[0] == p.index and last[1] is not None:
        e = last[1]
        k = e.ids.size
        if k <= ids.size and ((last[2] == prompt.source and k <= prompt.copied) or same(e.ids, ids[:k])):
            lead = e
    r.lead = lead
    run, r.hit_entry = p.cache.use(ids, now, max_id=prompt.max_gpu_id, lead=lead)
    return run


def insert(r: Request, now: float) -> None:
    p, prompt = r.prefill, r.prompt
    bt = r.d.session.block_tokens
    inserts = r.play.inserts
    latest = inserts.get(prompt.thread)
    if latest is r.last_insert and r.lead is not None:
        entry = p.cache.insert(prompt.gpu_ids, now, bt, max_id=prompt.max_gpu_id, prefixes=(r.hit_entry, r.lead))
    else:
        entry = p.cache.insert(prompt.gpu_ids, now, bt, max_id=prompt.max_gpu_id, prefixes=(r.hit_entry,),
                               replaces=(latest[1],) if latest is not None and latest[0] == p.index else ())
    inserts[prompt.thread] = (p.index, entry, prompt.request)
