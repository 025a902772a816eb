"""Request faults of the simulated cluster (the scenario's ``[faults]``): hangs, timeouts and failed transfers.

Contract:
    * ``Faults(s)`` reads ``s.faults``; ``enabled`` is False when no fault can happen, and then
      the lifecycle asks it nothing (a run without faults schedules exactly what it would without
      this module).
    * Every draw is ``draw(key, salt)``: a uniform number in [0, 1) that is a pure function of the
      scenario's seed, the request's key and what is drawn (``HANG``, ``RESTORE``, ``SAVE``), so a
      request's fate does not depend on the order events happen in, and equal inputs give equal runs.
    * ``hangs(key, pool_miss)``: whether a request hangs after its lookup (``hang_prob_on_pool_miss``
      for a pool miss, ``hang_prob_other`` for any other); ``restore_fails(key)``, ``save_fails(key)``:
      whether its restore or its save fails once the transfer is done.
    * ``timeout_s`` (``None``: none) and ``hang_s`` are the scenario's.
"""

from __future__ import annotations

from kvpool.scenario.model import Scenario

HANG, RESTORE, SAVE = 1, 2, 3

_MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit value of a 64-bit input."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class Faults:
    """See the module docstring."""

    def __init__(self, s: Scenario) -> None:
        f = s.faults
        self.enabled = f.enabled
        self.timeout_s = f.request_timeout_s
        self.hang_s = f.hang_s
        self.p_hang_miss = f.hang_prob_on_pool_miss
        self.p_hang_other = f.hang_prob_other
        self.p_restore = f.restore_fail_prob
        self.p_save = f.save_fail_prob
        self._seed = _mix64(s.seed)

    def draw(self, key: int, salt: int) -> float:
        """A uniform number in [0, 1), a pure function of (seed, key, salt)."""
        return (_mix64(self._seed ^ _mix64((int(key) << 2 | salt) & _MASK)) >> 11) * (1.0 / (1 << 53))

    def hangs(self, key: int, pool_miss: bool) -> bool:
        p = self.p_hang_miss if pool_miss else self.p_hang_other
        return p > 0 and self.draw(key, HANG) < p

    def restore_fails(self, key: int) -> bool:
        return self.p_restore > 0 and self.draw(key, RESTORE) < self.p_restore

    def save_fails(self, key: int) -> bool:
        return self.p_save > 0 and self.draw(key, SAVE) < self.p_save
