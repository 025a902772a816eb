"""Whether a pool's master answers, as one client last saw it: a lost master costs later calls nothing.

Contract (``Reachability``, thread-safe):
    * It starts **up**. ``lost(reason)`` marks it **down** (a call got no answer: the master is
      dead, hung or unreachable); ``answered()`` marks it up again.
    * ``usable()`` is asked before every pool call. Up: ``True``. Down: ``False`` at once, except
      that at most once per ``reprobe_every_s`` one caller runs ``probe()`` (itself bounded, e.g. a
      TCP connect with a timeout); a probe that succeeds marks it up and lets that call through
      (the call itself then decides: no answer marks it down again). Callers that come while one
      probes wait for that probe and take its outcome (no second probe). So while the master
      stays lost, a call costs at most one probe, and one probe runs per ``reprobe_every_s``.
    * ``down_since_s`` (monotonic seconds, ``None`` while up), ``reason`` and ``losses`` (how
      often it went down) describe it for metrics and health answers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: Default pause between probes of a lost master, s.
REPROBE_EVERY_S = 1.0


class Reachability:
    """See the module docstring.

    Args:
        probe: ``probe() -> bool``, bounded in time: whether the master looks reachable again.
        reprobe_every_s: least time between two probes while down.
        clock: monotonic seconds.
    """

    def __init__(self, probe: Callable[[], bool], reprobe_every_s: float = REPROBE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if reprobe_every_s < 0:
            raise ValueError(f"reprobe_every_s must be >= 0, got {reprobe_every_s}")
        self._probe = probe
        self.reprobe_every_s = reprobe_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()  # held by the one caller that probes
        self._down_since_s: float | None = None
        self._next_probe_s = 0.0
        self.reason = ""
        self.losses = 0
        self.probes = 0

    @property
    def up(self) -> bool:
        with self._lock:
            return self._down_since_s is None

    @property
    def down_since_s(self) -> float | None:
        with self._lock:
            return self._down_since_s

    def lost(self, reason: str) -> None:
        """A call got no answer: down from now (the first probe after ``reprobe_every_s``)."""
        with self._lock:
            if self._down_since_s is None:
                self._down_since_s = self._clock()
                self.losses += 1
            self.reason = reason
            self._next_probe_s = self._clock() + self.reprobe_every_s

    def answered(self) -> None:
        """A call got an answer: up."""
        with self._lock:
            self._down_since_s = None
            self.reason = ""

    def usable(self) -> bool:
        """Whether a pool call should be made now (see the module docstring)."""
        with self._lock:
            if self._down_since_s is None:
                return True
            if self._clock() < self._next_probe_s and not self._probe_lock.locked():
                return False
        with self._probe_lock:  # one probe at a time; a caller that waited takes its outcome
            with self._lock:
                if self._down_since_s is None:
                    return True
                if self._clock() < self._next_probe_s:
                    return False
                self.probes += 1
            ok = False
            try:
                ok = bool(self._probe())
            finally:
                with self._lock:
                    if ok:
                        self._down_since_s = None
                        self.reason = ""
                    else:
                        self._next_probe_s = self._clock() + self.reprobe_every_s
            return ok


__all__ = ["REPROBE_EVERY_S", "Reachability"]
