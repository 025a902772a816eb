"""The KV admission gate in front of decode.

Contract (the seed's four-server deployment):
    * Each decode instance has a token budget (seed: 10M tokens x 0.9). A request reserves
      ``input + output`` tokens on one decode instance when admitted and releases them on completion.
    * Requests with more input than ``max_input_tokens`` (917,504) or output than
      ``max_output_tokens`` (131,072) are rejected at once with a reason.
    * A request that does not fit waits; ``try_admit`` tells the caller whether it fits now, and
      ``expired`` whether its wait exceeded ``max_wait_s`` (30 s for replay, 900 s for AgentX),
      after which it is rejected. The caller owns the clock and the queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Verdict(str, Enum):
    ADMITTED = "admitted"
    WAIT = "wait"
    REJECT_INPUT = "reject_input_too_long"
    REJECT_OUTPUT = "reject_output_too_long"
    REJECT_BUDGET = "reject_larger_than_budget"
    REJECT_TIMEOUT = "reject_admission_timeout"


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


class AdmissionGate:
    """Token budgets of the decode instances behind one gate."""

    def __init__(self, config: GateConfig, decode_instances: int) -> None:
        if decode_instances <= 0:
            raise ValueError(f"decode_instances must be > 0, got {decode_instances}")
        self.config = config
        self.reserved = [0] * decode_instances
        self._held: dict[object, tuple[int, int]] = {}

    def free_tokens(self, decode: int) -> int:
        return self.config.budget_tokens - self.reserved[decode]

    def check(self, input_tokens: int, output_tokens: int) -> Verdict | None:
        """A reason to reject outright, or ``None`` when the request could ever be admitted."""
        c = self.config
        if input_tokens > c.max_input_tokens:
            return Verdict.REJECT_INPUT
        if output_tokens > c.max_output_tokens:
            return Verdict.REJECT_OUTPUT
        if input_tokens + output_tokens > c.budget_tokens:
            return Verdict.REJECT_BUDGET
        return None

    def try_admit(self, request_id: object, input_tokens: int, output_tokens: int, decode: int) -> Verdict:
        """Reserve on ``decode`` if it fits now; ``WAIT`` otherwise, or a rejection reason."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already admitted")
        bad = self.check(input_tokens, output_tokens)
        if bad is not None:
            return bad
        need = input_tokens + output_tokens
        if need > self.free_tokens(decode):
            return Verdict.WAIT
        self.reserved[decode] += need
        self._held[request_id] = (decode, need)
        return Verdict.ADMITTED

    def expired(self, waited_s: float) -> bool:
        """Whether a waiting request has waited past the gate's bound."""
        return waited_s > self.config.max_wait_s

    def release(self, request_id: object) -> None:
        """Give back a finished request's reservation (unknown ids are an error)."""
        try:
            decode, need = self._held.pop(request_id)
        except KeyError:
            raise ValueError(f"request {request_id!r} holds no reservation") from None
        self.reserved[decode] -= need
