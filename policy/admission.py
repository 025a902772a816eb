"""The KV admission gate in front of decode: token budgets and the waiting discipline.

Contract (the seed's four-server deployment):
    * Each decode instance has a token budget (seed: 10M tokens x 0.9). A request reserves
      ``input + output`` tokens on one decode instance when admitted and gives them back with
      ``release`` when it finishes.
    * Requests with more input than ``max_input_tokens`` (917,504), more output than
      ``max_output_tokens`` (131,072), or more tokens than one instance's budget are rejected at
      once with a reason (``check``, which is ``refusal`` over the gate's own budget).
    * ``refusal(config, input_tokens, output_tokens, budget_tokens)``: the one check of the caps and
      of the one-instance budget; the gate calls it, and so does a front end without a gate, with
      the KV of one decode instance as the budget.
    * ``arrive``: a request that fits is admitted at once on the decode instance with the most free
      tokens (``policy.routing.choose_decode``; ties: the lower index), whether or not others are
      waiting. One that fits nowhere waits, with one deadline: ``now_s + max_wait_s`` (30 s for
      replay, 900 s for AgentX). A wait bound of at most ``DEADLINE_SLACK_S`` is no wait: such a
      request is rejected at once with ``REJECT_TIMEOUT``.
    * ``release``: first fit in arrival order. After giving back a reservation, the gate offers the
      free budget to the waiting requests once each, in the order they arrived: a waiter is
      admitted when it fits the instance with the most free tokens at that point (on that
      instance); one that does not fit keeps its place. The pass stops when no instance has free
      tokens. ``release`` returns the admitted waiters with their decode instances, in that order.
    * ``expire``: the caller owns the clock and calls ``expire`` when a waiter's ``deadline_s``
      comes. A request still waiting then leaves the queue, rejected with ``REJECT_TIMEOUT``
      (``True``); one that a release admitted first (at the deadline too, if the release came
      first) is not waiting (``False``), so a deadline timer need not be cancelled on admission.
    * Request ids are any hashable values, unique among the admitted and the waiting requests.
    * ``try_admit`` is the budget primitive underneath: reserve on a given instance if the request
      fits there now, without looking at the queue.
    * ``Ungated(config, capacity_tokens)`` is admission without a gate, as a front end makes it
      (``kvpool serve``'s router and the simulator's admit step): ``admit`` refuses what
      ``refusal`` refuses with the smallest decode capacity as the budget, and otherwise admits at
      once on the instance with the most capacity left over the tokens (``input + output``) it
      admitted there and not yet released (``policy.routing.choose_decode``); it never waits.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from enum import Enum

from kvpool.policy.routing import choose_decode

DEADLINE_SLACK_S = 1e-6
"""A wait bound this short is no wait (the simulator's clock ulp is ~1e-9 s at 1e7 s)."""


class Verdict(str, Enum):
    ADMITTED = "admitted"
    WAIT = "wait"
    REJECT_INPUT = "reject_input_too_long"
    REJECT_OUTPUT = "reject_output_too_long"
    REJECT_BUDGET = "reject_larger_than_budget"
    REJECT_TIMEOUT = "reject_admission_timeout"


@dataclass(frozen=True, slots=True)
class Admission:
    """The gate's answer to an arrival.

    ``decode``: the instance reserved on (``ADMITTED`` only). ``deadline_s``: the moment the wait
    ends in ``REJECT_TIMEOUT`` unless a release admits it first (``WAIT`` only).
    """

    verdict: Verdict
    decode: int | None = None
    deadline_s: float | None = None


_REJECT_TIMEOUT = Admission(Verdict.REJECT_TIMEOUT)


@dataclass(frozen=True)
class GateConfig:
    """Limits of the gate."""

    tokens_per_decode: int = 10_000_000
    budget_fraction: float = 0.9
    max_input_tokens: int = 917_504
    max_output_tokens: int = 131_072
    max_wait_s: float = 900.0

    def __post_init__(self) -> None:
        if self.tokens_per_decode <= 0:
            raise ValueError(f"tokens_per_decode must be > 0, got {self.tokens_per_decode}")
        if not 0.0 < self.budget_fraction <= 1.0:
            raise ValueError(f"budget_fraction must be in (0, 1], got {self.budget_fraction}")
        if self.max_input_tokens <= 0 or self.max_output_tokens <= 0:
            raise ValueError("max_input_tokens and max_output_tokens must be > 0")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")

    @property
    def budget_tokens(self) -> int:
        return int(self.tokens_per_decode * self.budget_fraction)


def refusal(config: GateConfig, input_tokens: int, output_tokens: int, budget_tokens: int) -> Verdict | None:
    """Why a request can never be admitted (more input than ``config.max_input_tokens``, more output
    than ``config.max_output_tokens``, more tokens than ``budget_tokens``), or ``None``."""
    if input_tokens > config.max_input_tokens:
        return Verdict.REJECT_INPUT
    if output_tokens > config.max_output_tokens:
        return Verdict.REJECT_OUTPUT
    if input_tokens + output_tokens > budget_tokens:
        return Verdict.REJECT_BUDGET
    return None


class AdmissionGate:
    """Token budgets of the decode instances behind one gate, and its queue of waiting requests."""

    def __init__(self, config: GateConfig, decode_instances: int) -> None:
        if decode_instances <= 0:
            raise ValueError(f"decode_instances must be > 0, got {decode_instances}")
        self.config = config
        self.reserved = [0] * decode_instances
        self._held: dict[Hashable, tuple[int, int]] = {}  # request id -> (decode, tokens)
        self._waiting: dict[Hashable, int] = {}  # request id -> tokens it needs, in arrival order

    @property
    def waiting(self) -> int:
        """How many requests wait."""
        return len(self._waiting)

    def free_tokens(self, decode: int) -> int:
        return self.config.budget_tokens - self.reserved[decode]

    def check(self, input_tokens: int, output_tokens: int) -> Verdict | None:
        """A reason to reject outright, or ``None`` when the request could ever be admitted."""
        return refusal(self.config, input_tokens, output_tokens, self.config.budget_tokens)

    def arrive(self, request_id: Hashable, input_tokens: int, output_tokens: int, now_s: float) -> Admission:
        """Admit a new request now, queue it with a deadline, or reject it (see the module contract)."""
        self._check_new(request_id)
        bad = self.check(input_tokens, output_tokens)
        if bad is not None:
            return Admission(bad)
        need = input_tokens + output_tokens
        decode = choose_decode(self._free_list())
        if need <= self.free_tokens(decode):
            self._reserve(request_id, decode, need)
            return Admission(Verdict.ADMITTED, decode)
        wait_s = self.config.max_wait_s
        if wait_s <= DEADLINE_SLACK_S:
            return _REJECT_TIMEOUT
        self._waiting[request_id] = need
        return Admission(Verdict.WAIT, deadline_s=now_s + wait_s)

    def release(self, request_id: Hashable) -> list[tuple[Hashable, int]]:
        """Give back a finished request's reservation (unknown ids are an error) and admit waiters
        first fit in arrival order; returns ``(request id, decode instance)`` of each admitted."""
        try:
            decode, need = self._held.pop(request_id)
        except KeyError:
            raise ValueError(f"request {request_id!r} holds no reservation") from None
        self.reserved[decode] -= need
        waiting = self._waiting
        if not waiting:
            return []
        admitted: list[tuple[Hashable, int]] = []
        free = self._free_list()
        most = max(free)
        for wid, need in list(waiting.items()):
            if need > most:
                continue  # keeps its place
            decode = choose_decode(free)
            del waiting[wid]
            self._reserve(wid, decode, need)
            admitted.append((wid, decode))
            free[decode] = self.free_tokens(decode)
            most = max(free)
            if most <= 0:
                break
        return admitted

    def expire(self, request_id: Hashable) -> bool:
        """A waiter's deadline has come: ``True`` if it was still waiting (it leaves the queue,
        rejected with ``REJECT_TIMEOUT``), ``False`` if it is not waiting (a release admitted it)."""
        return self._waiting.pop(request_id, None) is not None

    def try_admit(self, request_id: Hashable, input_tokens: int, output_tokens: int, decode: int) -> Verdict:
        """Reserve on ``decode`` if it fits now (the queue is not consulted); ``WAIT`` otherwise
        (nothing is queued), or a rejection reason."""
        self._check_new(request_id)
        bad = self.check(input_tokens, output_tokens)
        if bad is not None:
            return bad
        need = input_tokens + output_tokens
        if need > self.free_tokens(decode):
            return Verdict.WAIT
        self._reserve(request_id, decode, need)
        return Verdict.ADMITTED

    def _check_new(self, request_id: Hashable) -> None:
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already admitted")
        if request_id in self._waiting:
            raise ValueError(f"request {request_id!r} is already waiting")

    def _free_list(self) -> list[int]:
        budget = self.config.budget_tokens
        return [budget - r for r in self.reserved]

    def _reserve(self, request_id: Hashable, decode: int, need: int) -> None:
        self.reserved[decode] += need
        self._held[request_id] = (decode, need)


class Ungated:
    """Admission without a gate (see the module contract): no queue, no wait."""

    def __init__(self, config: GateConfig, capacity_tokens: list[int]) -> None:
        if not capacity_tokens:
            raise ValueError("no decode instance to admit on")
        self.config = config
        self.capacity_tokens = list(capacity_tokens)
        self.budget_tokens = min(self.capacity_tokens)
        self.admitted_tokens = [0] * len(self.capacity_tokens)  # per decode instance, not yet released
        self._held: dict[Hashable, tuple[int, int]] = {}  # request id -> (decode, tokens)

    def admit(self, request_id: Hashable, input_tokens: int, output_tokens: int) -> Admission:
        """``ADMITTED`` on a decode instance, or the ``refusal`` verdict."""
        bad = refusal(self.config, input_tokens, output_tokens, self.budget_tokens)
        if bad is not None:
            return Admission(bad)
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already admitted")
        decode = choose_decode([cap - t for cap, t in zip(self.capacity_tokens, self.admitted_tokens)])
        need = input_tokens + output_tokens
        self.admitted_tokens[decode] += need
        self._held[request_id] = (decode, need)
        return Admission(Verdict.ADMITTED, decode)

    def release(self, request_id: Hashable) -> None:
        """Give back an admitted request's tokens (unknown ids are an error)."""
        try:
            decode, need = self._held.pop(request_id)
        except KeyError:
            raise ValueError(f"request {request_id!r} holds no reservation") from None
        self.admitted_tokens[decode] -= need
