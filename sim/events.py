"""Completing a SimPy event at once, without scheduling it.

``Event.succeed()`` puts the event on SimPy's queue, and its callbacks run when the loop pops it:
one more event per completion, at the same simulated time. ``fire(ev)`` marks ``ev`` succeeded and
runs its callbacks now, in order, from inside the caller; the callbacks see exactly what they
would see from the loop (``ev.ok``, ``ev.value``, ``ev.processed``). Only the order against
other events due at the same moment differs: the callbacks run before every event already queued
for now instead of after them.

Callers must be in a consistent state when they call ``fire`` (a callback may call back into
them, e.g. a resumed process starting a transfer on the link whose completion it awaited), and
must not call it from inside a SimPy process (a resumed process clears the active process).

``call_later(env, delay, fn, value)`` is ``env.timeout(delay, value).callbacks.append(fn)`` without
the event object: it puts a slim record on SimPy's queue, at the same time, priority and sequence
number a Timeout would take (so the order of simultaneous events is unchanged), and SimPy's loop
calls ``fn(record)`` with ``record._value == value``. Nothing may wait on it (no process yields it).
"""

from __future__ import annotations

from heapq import heappop, heappush

from simpy.events import NORMAL, PENDING, Event


def fire(ev: Event, value: object = None) -> None:
    """Succeed ``ev`` with ``value`` and run its callbacks now (see the module docstring)."""
    if ev._value is not PENDING:
        raise RuntimeError(f"{ev} has already been triggered")
    ev._ok = True
    ev._value = value
    callbacks, ev.callbacks = ev.callbacks, None
    for cb in callbacks:
        cb(ev)


class Call:
    """A scheduled callback: what ``Environment.step`` reads of an event (``callbacks``, ``_ok``)
    and the value the callback gets (``_value``)."""

    __slots__ = ("callbacks", "_ok", "_value")

    def __init__(self, fn, value: object = None) -> None:
        self.callbacks = [fn]
        self._ok = True
        self._value = value


def call_later(env, delay: float, fn, value: object = None) -> None:
    """Call ``fn(record)`` ``delay`` seconds from now, as a Timeout's callback would be (see the
    module docstring); ``delay`` must be >= 0."""
    if delay < 0:
        raise ValueError(f"negative delay {delay}")
    heappush(env._queue, (env._now + delay, NORMAL, next(env._eid), Call(fn, value)))


def run_all(env) -> None:
    """``env.run()`` with no ``until``: every event in time order until none is left, with
    ``Environment.step`` written into the loop (the same steps; a failed event that nobody
    defused raises as there). Not for models that stop the loop with ``StopSimulation``."""
    queue = env._queue
    while queue:
        env._now, _, _, event = heappop(queue)
        callbacks, event.callbacks = event.callbacks, None
        for callback in callbacks:
            callback(event)
        if not event._ok and not hasattr(event, "_defused"):
            exc = type(event._value)(*event._value.args)
            exc.__cause__ = event._value
            raise exc
