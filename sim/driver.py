"""The replay driver: a replay schedule (``workload.replay``'s interface) fed into SimPy time.

Contract: ``drive(env, replay, serve)`` calls ``replay.start`` now, ``replay.finished`` as each
request completes and ``replay.poll`` when the newest ``Wake.next_due_s`` comes; every Wake's
ready dispatches start at once, each as ``serve(d, finished)`` in the queue slot of a process
started now (``sim.events.start``), and ``serve`` calls ``finished(d)`` once ``d`` is done. One
timer is pending at a time: a Wake that moves the due time makes it stale (ignored by a version
counter), one that keeps it adds no event. Everything is a callback; no driver process.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.sim.events import Call, call_later, start


def drive(env, replay, serve: Callable[[object, Callable[[object], None]], None]) -> None:
    timer = [0, None]  # version, due time of the pending timer (None: none)

    def finished(d) -> None:
        handle(replay.finished(d.key, env.now))

    def begin(call: Call) -> None:
        serve(call.value, finished)

    def handle(w) -> None:
        for d in w.ready:
            start(env, begin, d)
        due = None if w.done else w.next_due_s
        if due != timer[1]:
            timer[0] += 1
            timer[1] = due
            if due is not None:
                call_later(env, max(0.0, due - env.now), on_timer, timer[0])

    def on_timer(call: Call) -> None:
        if call.value == timer[0]:  # not superseded by a later Wake
            timer[1] = None
            handle(replay.poll(env.now))

    handle(replay.start(env.now))
