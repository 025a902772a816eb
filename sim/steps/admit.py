"""The admit step: the KV admission gate in front of decode (``policy.admission``'s waiting discipline).

Contract: ``Admit(env, gate).arrive(rec, admitted, rejected)`` asks the gate
(``AdmissionGate.arrive``): admitted at once, ``admitted(decode)``; rejected at once,
``rejected()`` with ``rec.rejected`` naming why; or waiting, until a ``release`` admits it or its
deadline comes (``max_wait_s`` from its arrival), where ``AdmissionGate.expire`` rejects it
(``reject_admission_timeout``) unless a release admitted it first. ``release(key)`` gives back
a finished request's reservation; each waiter the gate admits then goes on with its decode
instance, in the gate's order.

Without the gate, ``Ungated(world)`` has the same interface and asks ``policy.admission.Ungated``
over the decode instances' KV capacities, as ``kvpool serve``'s router does without one: admitted
at once, or rejected at once (``rec.rejected`` naming why); ``release(key)`` gives an admitted
request's tokens back.

Timing: a waiter admitted by a release goes on two queue entries later at the release's moment,
and one whose deadline came is handled one entry after it (the slots where a SimPy process
waiting on ``admitted | timeout(max_wait_s)`` would resume; ``sim.events``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.policy import admission
from kvpool.policy.admission import AdmissionGate, Verdict
from kvpool.sim.events import Call, call_later
from kvpool.workload.records import RequestRecord


class _Waiter:
    __slots__ = ("rec", "admitted", "rejected", "decode", "resuming")

    def __init__(self, rec: RequestRecord, admitted: Callable[[int], None], rejected: Callable[[], None]) -> None:
        self.rec = rec
        self.admitted = admitted
        self.rejected = rejected
        self.decode: int | None = None  # given by a release
        self.resuming = False  # its admission or its deadline is being handled


class Admit:
    def __init__(self, env, gate: AdmissionGate) -> None:
        self.env = env
        self.gate = gate
        self.waiters: dict[object, _Waiter] = {}  # request key -> its wait

    def arrive(self, rec: RequestRecord, admitted: Callable[[int], None], rejected: Callable[[], None]) -> None:
        gate = self.gate
        admission = gate.arrive(rec.key, rec.in_tokens, rec.out_tokens, self.env.now)
        if admission.verdict is Verdict.ADMITTED:
            admitted(admission.decode)
        elif admission.verdict is Verdict.WAIT:
            w = self.waiters[rec.key] = _Waiter(rec, admitted, rejected)
            # the delay added to now as the gate adds it: the deadline is admission.deadline_s, bit for bit
            call_later(self.env, gate.config.max_wait_s, self._wake, w)
        else:
            rec.rejected = admission.verdict.value
            rejected()

    def release(self, key) -> None:
        for wkey, decode in self.gate.release(key):
            w = self.waiters.pop(wkey)
            w.decode = decode
            call_later(self.env, 0.0, self._wake, w)

    def _wake(self, call: Call) -> None:
        """A waiter's admission or deadline: handled once, on the next queue entry."""
        w = call.value
        if not w.resuming:
            w.resuming = True
            call_later(self.env, 0.0, self._resume, w)

    def _resume(self, call: Call) -> None:
        w = call.value
        key = w.rec.key
        if not self.gate.expire(key):  # a release admitted it (at the deadline too, if it came first)
            w.admitted(w.decode)
            return
        del self.waiters[key]
        w.rec.rejected = Verdict.REJECT_TIMEOUT.value
        w.rejected()


class Ungated:
    """The admit step without a gate (see the module docstring)."""

    def __init__(self, world) -> None:
        self.admission = admission.Ungated(world.gate_config, [d.capacity_tokens for d in world.decodes])

    def arrive(self, rec: RequestRecord, admitted: Callable[[int], None], rejected: Callable[[], None]) -> None:
        answer = self.admission.admit(rec.key, rec.in_tokens, rec.out_tokens)
        if answer.verdict is Verdict.ADMITTED:
            admitted(answer.decode)
        else:
            rec.rejected = answer.verdict.value
            rejected()

    def release(self, key) -> None:
        self.admission.release(key)
