"""The prefill GPU prefix cache of one prefill instance, at trace-block granularity.

Contract:
    * Entries are the workload's blocks (64 tokens for Weka traces, a multiple of the 16-token
      page), named by non-negative integer ids. The cache's memory is by the largest id it has
      seen (an array by id), so its caller numbers them densely per cache: each prefill's cache
      names only the blocks its prompts touched (``sim.gpuids``, through ``sim.prompt``).
    * ``hit_blocks(ids, now)``: the longest run of leading blocks held; those blocks count as used now.
    * ``insert(ids, now)``: after a prefill, the prompt's full blocks are held. When the cache
      exceeds its capacity, least recently used blocks go first, and among blocks used at the same
      moment the deepest ones (a prefix loses its tail first), until ``evict_fraction`` of the
      capacity is free; the blocks being inserted are never victims.
    * Ids come as an array (nothing known of them) or as ``Blocks``: the ids with what their
      maker knows (a bound, ``max_id``; ``lead``, an entry of this cache whose blocks lead the
      ids). ``use(blocks, now)`` is ``hit_blocks`` that returns the ``Use`` (its run and log
      entry). ``insert(what, now, block_tokens, earlier)`` takes the prompt's ``Use`` (or its
      ``Blocks``, or an array) and returns the insert's log entry: the use's entry and the lead
      are prefixes of the ids by construction, and ``earlier``, another entry of this cache, is
      compared. Those that are prefixes and older than ``now`` hold no live block any more;
      eviction skips them without looking at their blocks. What the caller knows changes no
      result, only the work: while its claims hold, a call decides as for the plain array.
    * Capacity is in tokens (``None``: unbounded, the trace-ceiling check); it holds
      ``capacity_tokens // block_tokens`` blocks of the first workload it sees.

Implementation: every use (a hit's leading run, an insert) is logged as ``(time, ids)`` in time
order; a block's live entry is the one whose time equals its last use. One array by block id
holds the last use, 0 for a block not held (never inserted or evicted; every moment is > 0, a use
at time 0 counting at the smallest positive float). Eviction consumes the log from its oldest end, so a pass
costs what it evicts plus the stale entries it reads, not a scan of the whole cache. Within one
moment, a block's depth is its position in its entry; a block logged twice at one moment counts
once, at its deepest (``first_occurrences`` after ordering by depth, in a ``Scratch`` that the
caches of one world share: its contents are never kept between calls).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

_ALL = np.logical_and.reduce
_EVICTED = 0.0  # the last use of a block not held (never inserted, or evicted): no moment, so a
# log entry's live blocks are those whose last use is the entry's moment, and a block is held
# exactly when its last use is a moment (> 0): one array says both, and fresh (zeroed) memory
# reads as not held. Moments are kept > 0: a use or insert at time 0 counts at _FIRST_MOMENT,
# the smallest positive float, which keeps every order and equality between moments.
_FIRST_MOMENT = 5e-324


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Element-wise equality of two arrays of one shape (bytes compared when the dtypes agree)."""
    if a.dtype == b.dtype:
        return a.tobytes() == b.tobytes()
    return bool(_ALL(a == b))


def first_occurrences(ids: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """Whether each position of ``ids`` is its id's first (``np.unique``'s first indices, in
    O(n) without a sort): each id's smallest position, kept in ``scratch`` (indexed by id,
    int32, left dirty). Without repeated ids (the usual case) one write and one read decide it."""
    at = np.arange(ids.size, dtype=np.int32)
    scratch[ids] = at  # without repeats every position reads its own mark back; a repeated id
    first = scratch[ids] == at  # reads one mark at two positions, so one of them differs
    if _ALL(first):
        return first
    scratch[ids] = ids.size  # repeats (rare): each id's smallest position, by np.minimum.at
    np.minimum.at(scratch, ids, at)
    return scratch[ids] == at


class Scratch:
    """An int32 array by id whose contents no caller keeps (``first_occurrences``' marks), grown
    on demand: one serves every cache of a world."""

    __slots__ = ("marks",)

    def __init__(self) -> None:
        self.marks = np.zeros(0, dtype=np.int32)

    def at_least(self, size: int) -> np.ndarray:
        """The array, ``size`` ids long at least."""
        if self.marks.size < size:
            self.marks = np.zeros(size, dtype=np.int32)
        return self.marks


class LogEntry:
    """One logged use: its moment, its blocks in use order, their depths (``None``: 0..n-1) and
    whether a later use of a superset made every block of it stale (``dead``)."""

    __slots__ = ("dead", "depth", "ids", "t")

    def __init__(self, t: float, ids: np.ndarray, depth: np.ndarray | None = None) -> None:
        self.t = t
        self.ids = ids
        self.depth = depth
        self.dead = False


class Blocks(NamedTuple):
    """A prompt's full blocks in one cache's names, in order, with what their maker knows of them:
    every id is at most ``max_id``, and ``lead`` (``None``: none known) is an entry of this cache
    whose blocks lead ``ids``."""

    ids: np.ndarray
    max_id: int
    lead: LogEntry | None = None


class Use(NamedTuple):
    """A use of ``blocks``: ``run``, its leading blocks held (they count as used then), and
    ``entry``, the use's log entry (``None``: nothing used, or the capacity is unbounded)."""

    blocks: Blocks
    run: int
    entry: LogEntry | None


def _blocks(ids: Blocks | np.ndarray) -> Blocks:
    """``ids`` as ``Blocks`` (an array: bounded by its largest id, no lead known)."""
    if type(ids) is Blocks:
        return ids
    return Blocks(ids, int(np.maximum.reduce(ids)) if ids.size else -1)


class GPUPrefixCache:
    def __init__(self, capacity_tokens: int | None, *, evict_fraction: float = 0.05, initial: int = 1 << 16,
                 scratch: Scratch | None = None) -> None:
        if capacity_tokens is not None and capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.capacity_blocks: int | None = None
        self.evict_fraction = evict_fraction
        self._last = np.zeros(initial, dtype=np.float64)  # last use by block id (_EVICTED: not held)
        self.blocks = 0
        self.evicted_blocks = 0
        self._log: deque[LogEntry] = deque()  # only kept when the capacity is bounded
        self._scratch = scratch or Scratch()  # by block id (see _oldest_moment)
        self._bounded = capacity_tokens is not None
        # the latest moment eviction has taken blocks from: a block last used later is held
        # (eviction takes moments oldest first, and only blocks whose last use is that moment)
        self._evicted_upto = -np.inf

    @property
    def held(self) -> np.ndarray:
        """Whether each block id is held (a fresh bool array by block id)."""
        return self._last > 0

    def _grow(self, max_id: int) -> None:
        n = len(self._last)
        if max_id < n:
            return
        last = np.zeros(max(max_id + 1, 4 * n), dtype=self._last.dtype)  # (zeros: _EVICTED)
        last[:n] = self._last
        self._last = last

    def hit_blocks(self, ids: Blocks | np.ndarray, now: float) -> int:
        """Leading blocks of ``ids`` held; they count as used now."""
        return self.use(ids, now).run

    def use(self, ids: Blocks | np.ndarray, now: float) -> Use:
        """``hit_blocks`` and the use's log entry. A lead newer than every moment eviction has
        taken blocks from has all its blocks held: only the blocks past it are looked at."""
        blocks = _blocks(ids)
        ids, lead = blocks.ids, blocks.lead
        if not ids.size:
            return Use(blocks, 0, None)
        if not now > 0:
            now = _FIRST_MOMENT
        self._grow(blocks.max_id)
        known = lead.ids.size if lead is not None and lead.t > self._evicted_upto else 0
        held = self._last[ids[known:] if known else ids] > 0
        run = known + int(held.size)  # every block held ...
        if held.size:
            first = int(held.argmin())  # ... unless this one, the first not held (0 when all are)
            if not held[first]:
                run = known + first
        entry = None
        if run:
            used = ids[:run]
            self._last[used] = now
            if self._bounded:
                entry = LogEntry(now, used)
                self._log.append(entry)
        return Use(blocks, run, entry)

    def insert(self, what: Use | Blocks | np.ndarray, now: float, block_tokens: int,
               earlier: LogEntry | None = None) -> LogEntry | None:
        """Hold the blocks (a prompt's full blocks, in order) as used now; evict if over capacity.
        Returns the insert's log entry (``None``: unbounded). ``what``: the prompt's ``Use``
        (its entry and its blocks' lead lead the ids), its ``Blocks`` (the lead does) or an
        array; ``earlier``: an entry of this cache that may lead the ids (compared)."""
        if type(what) is Use:
            blocks = what.blocks
            prefixes = (what.entry, blocks.lead)
        else:
            blocks = _blocks(what)
            prefixes = (blocks.lead,)
        ids = blocks.ids
        if not ids.size:
            return None
        if not now > 0:
            now = _FIRST_MOMENT
        if self.capacity_tokens is not None and self.capacity_blocks is None:
            self.capacity_blocks = self.capacity_tokens // block_tokens
        self._grow(blocks.max_id)
        if self.capacity_blocks is not None and ids.size > self.capacity_blocks:
            ids = ids[: self.capacity_blocks]
        known = 0  # leading blocks known to be held: a prefix newer than every evicted moment
        for old in prefixes:
            if old is not None and old.ids.size <= ids.size:
                if old.t > self._evicted_upto and old.ids.size > known:
                    known = old.ids.size
                if old.t < now and not old.dead:
                    old.dead = True  # every block of it was used again now: none is live there
        last = self._last
        rest = ids[known:] if known else ids
        self.blocks += rest.size - int(np.count_nonzero(last[rest] > 0))
        last[ids] = now  # held, used now
        entry = None
        if self._bounded:
            old = earlier
            if old is not None and old.t < now and old.ids.size <= ids.size and not old.dead \
                    and same(old.ids, ids[: old.ids.size]):
                old.dead = True  # as the prefixes above
            entry = LogEntry(now, ids)
            self._log.append(entry)
        if self.capacity_blocks is not None and self.blocks > self.capacity_blocks:
            self._evict(ids, now)
        return entry

    def _evict(self, protect: np.ndarray, now: float) -> None:
        cap = self.capacity_blocks or 0
        target = self.blocks - cap + int(cap * self.evict_fraction)
        log = self._log
        skipped: list[LogEntry] = []  # protected entries of `now`
        while target > 0 and log:
            e = log[0]
            if e.dead:  # stale as a whole: dropped unread (as _oldest_moment does)
                log.popleft()
                continue
            if e.t != now and (len(log) == 1 or log[1].t != e.t):
                target -= self._evict_entry(target)  # a moment of one entry (the usual one)
                continue
            ids, depth, t = self._oldest_moment()
            if t > self._evicted_upto:
                self._evicted_upto = t
            if t == now and protect.size:
                guard = np.zeros(self._last.size, dtype=bool)
                guard[protect] = True
                keep = guard[ids]
                if keep.any():
                    skipped.append(LogEntry(t, ids[keep][::-1].copy(), depth[keep][::-1].copy()))
                    ids, depth = ids[~keep], depth[~keep]
            if ids.size > target:  # the shallower rest goes back, in depth order
                log.appendleft(LogEntry(t, ids[target:][::-1].copy(), depth[target:][::-1].copy()))
                ids = ids[:target]
            self._last[ids] = _EVICTED  # not held
            self.blocks -= int(ids.size)
            self.evicted_blocks += int(ids.size)
            target -= int(ids.size)
        log.extend(skipped)

    def _evict_entry(self, target: int) -> int:
        """Evict up to ``target`` live blocks of the log's oldest entry, the only one of its
        moment, deepest first; returns how many. An entry lies in depth order, so the general
        path (``_oldest_moment``) would evict its live blocks from its end and put the shallower
        rest back as an entry in front: done here with slices of its live blocks."""
        log, last = self._log, self._last
        e = log.popleft()
        ids, depth = e.ids, e.depth
        live = last[ids] == e.t
        if not _ALL(live):
            pos = np.flatnonzero(live)
            ids, depth = ids[pos], (pos if depth is None else depth[pos])
        if e.t > self._evicted_upto:
            self._evicted_upto = e.t
        n = int(ids.size)
        if n > target:
            keep = n - target
            log.appendleft(LogEntry(e.t, ids[:keep], None if depth is None else depth[:keep]))
            ids = ids[keep:]
            n = target
        last[ids] = _EVICTED  # not held
        self.blocks -= n
        self.evicted_blocks += n
        return n

    def _oldest_moment(self) -> tuple[np.ndarray, np.ndarray, float]:
        """Pop the log's entries of its oldest moment: their live blocks, deepest first, with
        their depths, and the moment (entries marked dead are dropped unread)."""
        log = self._log
        while log[0].dead:
            log.popleft()
            if not log:
                return self._NONE + (0.0,)
        t = log[0].t
        entries = []
        while log and log[0].t == t:
            e = log.popleft()
            if not e.dead:
                entries.append(e)
        if len(entries) == 1:  # an entry lies in depth order: deepest first is its reverse
            e = entries[0]
            ids = e.ids
            live = self._last[ids] == t
            if _ALL(live):  # every block of it (the usual case): no gather needed
                return ids[::-1], np.arange(ids.size - 1, -1, -1) if e.depth is None else e.depth[::-1], t
            pos = np.flatnonzero(live)[::-1]
            return ids[pos], pos if e.depth is None else e.depth[pos], t
        ids = np.concatenate([e.ids for e in entries])
        depth = np.concatenate([np.arange(e.ids.size) if e.depth is None else e.depth for e in entries])
        live = self._last[ids] == t
        ids, depth = ids[live], depth[live]
        order = np.argsort(-depth, kind="stable")
        ids, depth = ids[order], depth[order]
        first = first_occurrences(ids, self._scratch.at_least(self._last.size))  # a block logged twice counts once
        if _ALL(first):
            return ids, depth, t
        return ids[first], depth[first], t

    _NONE = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
