"""The admit step: the KV admission gate in front of decode (``policy.admission``).

Contract: ``Admit(env, gate, decodes).arrive(rec, admitted, rejected)``: a request whose tokens
break the gate's caps is rejected at once (``rec.rejected`` names why); one that fits a decode
instance's budget now is admitted at once on the instance ``policy.routing.choose_decode`` picks
(``admitted(decode)``); otherwise it waits, in arrival order, until a ``release`` admits it or
its wait reaches ``gate.max_wait_s`` (rejected then: ``reject_admission_timeout``).
``release(key)`` gives back an admitted request's reservation and offers the freed budget to the
waiters first fit, in arrival order: each once per release; one that does not fit keeps its
place. A waiter admitted at its deadline's moment, before the deadline was handled, is admitted.

Timing: a waiter admitted by a release goes on two queue entries later at the release's moment,
and one whose deadline came is rejected one entry after it (the slots where a SimPy process
waiting on ``admitted | timeout(max_wait_s)`` would resume; ``sim.events``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.policy.admission import AdmissionGate, Verdict
from kvpool.policy.routing import choose_decode
from kvpool.sim.events import Call, call_later
from kvpool.sim.metrics import RequestRecord

_DEADLINE_SLACK_S = 1e-6  # a wait this close to its deadline has reached it (the clock's ulp is ~1e-9 s at 1e7 s)


class _Waiter:
    __slots__ = ("rec", "admitted", "rejected", "decode", "resuming")

    def __init__(self, rec: RequestRecord, admitted: Callable[[int], None], rejected: Callable[[], None]) -> None:
        self.rec = rec
        self.admitted = admitted
        self.rejected = rejected
        self.decode: int | None = None  # given by a release
        self.resuming = False  # its admission or its deadline is being handled


class Admit:
    def __init__(self, env, gate: AdmissionGate, decodes: int) -> None:
        self.env = env
        self.gate = gate
        self.decodes = decodes
        self.waiters: dict[object, _Waiter] = {}  # arrival order

    def arrive(self, rec: RequestRecord, admitted: Callable[[int], None], rejected: Callable[[], None]) -> None:
        gate = self.gate
        bad = gate.check(rec.in_tokens, rec.out_tokens)
        if bad is not None:
            rec.rejected = bad.value
            rejected()
            return
        decode = choose_decode([gate.free_tokens(i) for i in range(self.decodes)])
        if gate.try_admit(rec.key, rec.in_tokens, rec.out_tokens, decode) is Verdict.ADMITTED:
            admitted(decode)
            return
        wait_s = gate.config.max_wait_s
        if wait_s <= _DEADLINE_SLACK_S:
            rec.rejected = Verdict.REJECT_TIMEOUT.value
            rejected()
            return
        w = self.waiters[rec.key] = _Waiter(rec, admitted, rejected)
        call_later(self.env, wait_s, self._wake, w)  # the deadline

    def release(self, key) -> None:
        gate = self.gate
        gate.release(key)
        waiters = self.waiters
        if not waiters:
            return
        free = [gate.free_tokens(i) for i in range(self.decodes)]
        most = max(free)
        for wkey, w in list(waiters.items()):
            rec = w.rec
            if rec.in_tokens + rec.out_tokens > most:
                continue
            decode = choose_decode(free)
            if gate.try_admit(wkey, rec.in_tokens, rec.out_tokens, decode) is not Verdict.ADMITTED:
                continue
            del waiters[wkey]
            w.decode = decode
            call_later(self.env, 0.0, self._wake, w)
            free[decode] = gate.free_tokens(decode)
            most = max(free)
            if most <= 0:
                break

    def _wake(self, call: Call) -> None:
        """A waiter's admission or deadline: handled once, on the next queue entry."""
        w = call.value
        if not w.resuming:
            w.resuming = True
            call_later(self.env, 0.0, self._resume, w)

    def _resume(self, call: Call) -> None:
        w = call.value
        if w.decode is not None:
            w.admitted(w.decode)
            return
        del self.waiters[w.rec.key]
        w.rec.rejected = Verdict.REJECT_TIMEOUT.value
        w.rejected()
