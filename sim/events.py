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
"""

from __future__ import annotations

from simpy.events import PENDING, Event


def fire(ev: Event, value: object = None) -> None:
    """Succeed ``ev`` with ``value`` and run its callbacks now (see the module docstring)."""
    if ev._value is not PENDING:
        raise RuntimeError(f"{ev} has already been triggered")
    ev._ok = True
    ev._value = value
    callbacks, ev.callbacks = ev.callbacks, None
    for cb in callbacks:
        cb(ev)
