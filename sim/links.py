"""Links shared fairly by concurrent transfers (processor sharing), for SimPy.

Contract:
    * A ``FairLink`` has a bandwidth (bytes/s), a latency (s) and a message rate (writes/s).
    * ``transfer(nbytes, writes)`` returns an event that succeeds when the transfer is done: the
      transfer's bytes plus the posting cost of its writes (each write costs ``1 / writes_per_s``
      of link time) plus the latency (charged as link time too: microseconds against transfers of
      milliseconds, and it saves an event per transfer) drain at ``bandwidth / n`` while ``n``
      transfers are active (equal shares, recomputed at every arrival and departure).
    * ``bytes_moved`` and ``busy_s`` accumulate for metrics. Zero-byte transfers succeed at once.

Implementation: no process per link. One wake-up event is pending at a time, at or before the next
completion; an arrival schedules an earlier one only if it would finish first (a wake-up that
comes early just recomputes), and wake-ups made stale that way are ignored by a version counter.
"""

from __future__ import annotations

import simpy

_EPS_BYTES = 1e-6


class FairLink:
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
        self._active: list[list] = []  # [remaining_virtual_bytes, event]
        self._last = env.now
        self._version = 0
        self._wake_at = float("inf")

    @property
    def active(self) -> int:
        return len(self._active)

    def transfer(self, nbytes: int, writes: int = 1) -> simpy.Event:
        """An event that succeeds when ``nbytes`` in ``writes`` writes have crossed the link."""
        env = self.env
        done = env.event()
        if nbytes <= 0:
            done.succeed()
            return done
        self.bytes_moved += int(nbytes)
        post_s = writes / self.writes_per_s if writes and self.writes_per_s != float("inf") else 0.0
        self._start(float(nbytes) + (post_s + self.latency_s) * self.bytes_per_s, done)
        return done

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last
        if dt > 0 and self._active:
            share = self.bytes_per_s * dt / len(self._active)
            for a in self._active:
                a[0] -= share
            self.busy_s += dt
        self._last = now

    def _start(self, work: float, done: simpy.Event) -> None:
        self._advance()
        self._active.append([work, done])
        # everyone slows down, so only this transfer can finish before the pending wake-up
        if self.env.now + work * len(self._active) / self.bytes_per_s < self._wake_at:
            self._reschedule()

    def _reschedule(self) -> None:
        self._version += 1
        if not self._active:
            self._wake_at = float("inf")
            return
        n = len(self._active)
        wait = max(0.0, min(a[0] for a in self._active) * n / self.bytes_per_s)
        version = self._version
        self._wake_at = self.env.now + wait
        self.env.timeout(wait).callbacks.append(lambda _ev: self._wake(version))

    def _wake(self, version: int) -> None:
        if version != self._version:
            return
        self._wake_at = float("inf")
        self._advance()
        eps = _EPS_BYTES * max(1.0, self.bytes_per_s * 1e-9)
        still = []
        for a in self._active:
            if a[0] <= eps:
                a[1].succeed()
            else:
                still.append(a)
        if len(still) == len(self._active):
            # an early wake-up (arrivals slowed everyone) or float rounding: finish what is due
            smallest = min(still, key=lambda a: a[0])
            if smallest[0] * len(still) / self.bytes_per_s <= 1e-12:
                still.remove(smallest)
                smallest[1].succeed()
        self._active = still
        self._reschedule()
