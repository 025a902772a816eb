"""Links shared fairly by concurrent transfers (processor sharing), for SimPy.

Contract:
    * A ``FairLink`` has a bandwidth (bytes/s), a latency (s) and a message rate (writes/s).
    * ``transfer(nbytes, writes)`` returns an event that succeeds when the transfer is done: the
      transfer's bytes plus the posting cost of its writes (each write costs ``1 / writes_per_s``
      of link time) plus the latency (charged as link time too: microseconds against transfers of
      milliseconds, and it saves an event per transfer) drain at ``bandwidth / n`` while ``n``
      transfers are active (equal shares, recomputed at every arrival and departure).
    * ``bytes_moved`` and ``busy_s`` accumulate for metrics. Zero-byte transfers succeed at once.

Implementation (generalized processor sharing with a virtual clock): the link's virtual clock
counts the bytes each active transfer has received; it advances at ``bandwidth / n``. A transfer
arriving at virtual time ``v`` with ``w`` bytes of work finishes when the clock reaches ``v + w``,
so the active transfers sit in a heap by that tag and every arrival or departure costs O(log n).
One wake-up event is pending at a time, at or before the next completion; an arrival schedules an
earlier one only if it would finish first (a wake-up that comes early just recomputes), and
wake-ups made stale that way are ignored by a version counter. The clock restarts at 0 whenever
the link is idle, which keeps the tags small against float rounding. A wake-up completes its due
transfers itself (``sim.events.fire``: their callbacks run inside the wake-up, after the link's
state is updated), so a transfer costs its wake-up and no completion event.
"""

from __future__ import annotations

from heapq import heappop, heappush

import simpy
from simpy.events import Event

from kvpool.sim.events import call_later, fire, scheduler

_INF = float("inf")
_EPS_S = 1e-9  # completions this close are due now (float rounding; keeps every wait > 0)
# ... or this close relative to the clock: past ~1e7 s a float clock no longer resolves 1e-9 s, and a
# wake-up ``now + wait`` that rounds to ``now`` would repeat forever (4 ulps of the clock)
_REL_EPS = 4 * 2.0**-52


class Join:
    """Several transfers (on any links) completing as one, without an event per transfer: pass
    it as ``transfer(..., join=)``; when the last of them completes, ``fn()`` is called, or
    ``done`` (a SimPy event) completes, at once (``sim.events.fire``), at the moment and in the
    callback slot of the last transfer's completion. It behaves as an event that succeeds when
    every transfer's event has (``tests/sim/test_links.py`` checks it against one). ``close()``
    after adding them: with none (every transfer empty), ``done`` succeeds through SimPy's queue
    (``succeed()``), as such an event does."""

    __slots__ = ("left", "fn", "done")

    def __init__(self, env: simpy.Environment, fn=None) -> None:
        self.left = 0
        self.fn = fn
        self.done = None if fn is not None else Event(env)

    def one(self, _ev=None) -> None:
        """One transfer done."""
        self.left -= 1
        if not self.left:
            if self.fn is not None:
                self.fn()
            else:
                fire(self.done)

    def close(self) -> None:
        if not self.left and self.done is not None:
            self.done.succeed()


class FairLink:
    __slots__ = ("_active", "_last", "_latency_bytes", "_later", "_seq", "_version", "_virtual", "_wake_at",
                 "_wake_cb", "_write_bytes", "busy_s", "bytes_moved", "bytes_per_s", "env", "latency_s", "name",
                 "writes_per_s")

    def __init__(
        self,
        env: simpy.Environment,
        bytes_per_s: float,
        *,
        latency_s: float = 0.0,
        writes_per_s: float = float("inf"),
        name: str = "",
    ) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"link {name!r}: bandwidth must be > 0, got {bytes_per_s}")
        self.env = env
        self.bytes_per_s = float(bytes_per_s)
        self.latency_s = float(latency_s)
        self.writes_per_s = float(writes_per_s)
        self.name = name
        self.bytes_moved = 0
        self.busy_s = 0.0
        self._write_bytes = self.bytes_per_s / self.writes_per_s if self.writes_per_s != float("inf") else 0.0
        self._latency_bytes = self.latency_s * self.bytes_per_s
        self._active: list[tuple[float, int, Join]] = []  # (virtual finish, seq, the transfer's join)
        self._seq = 0
        self._virtual = 0.0
        self._last = env.now
        self._version = 0
        self._wake_at = _INF
        self._wake_cb = self._wake  # bound once: a wake-up is scheduled per completion
        self._later = scheduler(env)  # a wake-up takes a Timeout's queue slot (sim.events)

    @property
    def active(self) -> int:
        return len(self._active)

    def transfer(self, nbytes: int, writes: int = 1, join: Join | None = None) -> simpy.Event | None:
        """An event that succeeds when ``nbytes`` in ``writes`` writes have crossed the link;
        with ``join``, no event: the join counts it (``None`` is returned)."""
        own = join is None
        if own:  # the transfer's own event: a join of this one transfer
            join = Join(self.env)
            if nbytes <= 0:
                join.done.succeed()
                return join.done
        join.left += 1
        if nbytes <= 0:  # counted down through SimPy's queue, as an empty transfer's event succeeds
            call_later(self.env, 0.0, join.one)
            return None
        self.bytes_moved += int(nbytes)
        bps = self.bytes_per_s
        work = float(nbytes) + writes * self._write_bytes + self._latency_bytes
        active = self._active
        now = self.env.now
        n = len(active)
        if n:
            dt = now - self._last  # advance the virtual clock to now
            if dt > 0:
                self._virtual += bps * dt / n
                self.busy_s += dt
        self._last = now
        self._seq = seq = self._seq + 1
        virtual = self._virtual
        heappush(active, (virtual + work, seq, join))
        n += 1
        # everyone slows down, so only this transfer can finish before the pending wake-up
        if now + work * n / bps < self._wake_at:
            self._version = version = self._version + 1
            wait = (active[0][0] - virtual) * n / bps
            if not wait > 0.0:
                wait = 0.0
            self._wake_at = now + wait
            self._later(wait, self._wake_cb, version)
        return join.done if own else None

    def _wake(self, ev) -> None:
        version = self._version
        if ev.value != version:  # a later reschedule superseded this wake-up
            return
        active = self._active
        now = self._wake_at  # a current wake-up runs at the moment it was set for
        n = len(active)
        bps = self.bytes_per_s
        if n:
            dt = now - self._last  # advance the virtual clock to now
            if dt > 0:
                self._virtual += bps * dt / n
                self.busy_s += dt
        self._last = now
        virtual = self._virtual
        due = virtual + max(_EPS_S, now * _REL_EPS) * bps / n
        first = None  # the completed transfers: the first, then any others (rare)
        more = None
        while active and active[0][0] <= due:  # none when an arrival made this wake-up early
            if first is None:
                first = heappop(active)[2]
            elif more is None:
                more = [heappop(active)[2]]
            else:
                more.append(heappop(active)[2])
        # the next wake-up (none when idle)
        self._version = version = version + 1
        if active:
            wait = (active[0][0] - virtual) * len(active) / bps
            if not wait > 0.0:
                wait = 0.0
            self._wake_at = now + wait
            self._later(wait, self._wake_cb, version)
        else:
            self._wake_at = _INF
            self._virtual = 0.0
        # completed now, not queued, once the link's state is consistent: callbacks may start
        # transfers on this link
        if first is not None:
            first.one()
            if more is not None:
                for join in more:
                    join.one()
