"""SimPy's event queue, used directly: the one module of the simulator that touches SimPy's internals.

The simulator schedules most of its work as plain callbacks instead of SimPy events and
processes; this module is where that happens, so it is the only one that reads or writes
SimPy's private state (``Environment._queue``, ``_eid``, ``_now``; ``Event._ok``, ``_value``;
the ``URGENT``/``NORMAL`` priorities). It is tested on the SimPy versions ``pyproject.toml``
allows (``tests/sim/test_events.py`` checks each helper against the SimPy code it stands for).

**The ordering rule.** SimPy's queue orders entries by (time, priority, sequence number), the
sequence number taken when an entry is pushed; events due at one moment run in that order. A
helper here either takes the queue slot a SimPy event would take, pushed at the moment that
event would be created (``call_later``: a ``Timeout``'s slot; ``start``: a new process's
``Initialize`` slot), or runs callbacks at once, inside its caller (``fire``: before every entry
already queued for now, where a queued ``succeed()`` would run them after those). A model keeps
the order of its simultaneous events when each callback is scheduled by the helper whose slot
matches the SimPy code it replaces.

    * ``call_later(env, delay, fn, value)``: ``env.timeout(delay, value).callbacks.append(fn)``
      without the event object: a slim record (``Call``) at the slot a Timeout would take; the
      loop calls ``fn(call)``, with ``call.value == value``. Nothing may wait on it.
      ``scheduler(env)`` is the same bound to one environment (for hot paths).
    * ``start(env, fn, value)``: ``fn(call)`` where ``env.process`` would start a process now
      (an urgent entry now, ahead of the normal ones due now).
    * ``fire(ev, value)``: ``ev`` succeeds and its callbacks run now, in order; they see what
      they would see from the loop (``ev.ok``, ``ev.value``, ``ev.processed``). Callers must be in
      a consistent state when they call it (a callback may call back into them) and must not call
      it from inside a SimPy process (a resumed process clears the active process).
    * ``run_all(env)``: ``env.run()`` with no ``until``, ``Environment.step`` written into the
      loop (a failed event that nobody defused raises as there). Not for models that stop the
      loop with ``StopSimulation``. ``run_all(env, report, every_entries)`` also calls ``report()``
      after each ``every_entries`` entries while entries remain (a progress display; one check per
      batch of entries, none per entry, and nothing pushed on the queue, so the run is the same).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from heapq import heappop, heappush

from simpy.events import NORMAL, PENDING, URGENT, Event


class Call:
    """A scheduled callback: what the loop reads of an event (``callbacks``, ``_ok``) and the
    ``value`` the callback reads."""

    __slots__ = ("callbacks", "_ok", "value")

    def __init__(self, fn: Callable[[Call], None], value: object = None) -> None:
        self.callbacks = [fn]
        self._ok = True
        self.value = value


def call_later(env, delay: float, fn: Callable[[Call], None], value: object = None) -> None:
    """Call ``fn(call)`` ``delay`` (>= 0) seconds from now, in a Timeout's queue slot."""
    if delay < 0:
        raise ValueError(f"negative delay {delay}")
    heappush(env._queue, (env._now + delay, NORMAL, next(env._eid), Call(fn, value)))


def scheduler(env) -> Callable[[float, Callable[[Call], None], object], None]:
    """``call_later`` bound to ``env`` (``later(delay, fn, value)``; ``delay`` >= 0 unchecked)."""
    queue, eid = env._queue, env._eid

    def later(delay: float, fn: Callable[[Call], None], value: object = None) -> None:
        heappush(queue, (env._now + delay, NORMAL, next(eid), Call(fn, value)))

    return later


def start(env, fn: Callable[[Call], None], value: object = None) -> None:
    """Call ``fn(call)`` now, in the queue slot of a process started now (its ``Initialize``)."""
    heappush(env._queue, (env._now, URGENT, next(env._eid), Call(fn, value)))


def fire(ev: Event, value: object = None) -> None:
    """Succeed ``ev`` with ``value`` and run its callbacks now (see the module docstring)."""
    if ev._value is not PENDING:
        raise RuntimeError(f"{ev} has already been triggered")
    ev._ok = True
    ev._value = value
    callbacks, ev.callbacks = ev.callbacks, None
    for cb in callbacks:
        cb(ev)


#: How many queue entries ``run_all`` runs between two ``report()`` calls (about 50 ms of a run).
REPORT_EVERY_ENTRIES = 5000


def run_all(env, report: Callable[[], None] | None = None, every_entries: int = REPORT_EVERY_ENTRIES) -> None:
    """``env.run()`` with no ``until``; with ``report``, ``report()`` after every ``every_entries``
    entries while entries remain (see the module docstring)."""
    if report is None:
        _run_entries(env, sys.maxsize)
        return
    while _run_entries(env, every_entries):
        report()


def _run_entries(env, n: int) -> bool:
    """Run at most ``n`` queue entries, as ``Environment.step`` does; whether entries remain."""
    queue = env._queue
    for _ in range(n):
        if not queue:
            return False
        env._now, _, _, event = heappop(queue)
        callbacks, event.callbacks = event.callbacks, None
        for callback in callbacks:
            callback(event)
        if not event._ok and not hasattr(event, "_defused"):
            exc = type(event._value)(*event._value.args)
            exc.__cause__ = event._value
            raise exc
    return bool(queue)
