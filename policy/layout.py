"""PP -> DCP layout: which decode rank holds which token, the gather plan and the write plan.

Contract:
    * Decode context parallelism over ``ranks`` ranks puts token ``t`` on rank ``t mod ranks``
      (interleave 1, as ATOM's TP4 + DCP4 decode).
    * A prefill pipeline stage holds every token of its layers. To hand a request to decode it
      gathers, per decode rank, that rank's tokens into one contiguous staging buffer laid out
      layer-major (for each layer of the stage, the rank's tokens in order, one record each).
    * Each buffer is sent in writes of at most ``max_write_bytes`` (8 MiB in the seed); a write
      never splits a record. The naive alternative is one write per token per layer.
    * ``handoff_counts`` gives every rank's tokens and write count of one hand-off for several
      stage depths at once, by the plan's arithmetic (``rank_token_count``, ``write_step_bytes``)
      without building plans: what the simulator needs per request.
    * Seed example: 8,192 tokens x 20 layers x 576 B to 4 ranks = 163,840 naive writes of 576 B
      against 12 batched writes, 94,371,840 B in all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

MIB = 1 << 20
DEFAULT_MAX_WRITE_BYTES = 8 * MIB


def dcp_rank_of(token: int, ranks: int) -> int:
    """Decode rank holding ``token`` under DCP over ``ranks`` ranks."""
    if ranks <= 0:
        raise ValueError(f"ranks must be > 0, got {ranks}")
    return token % ranks


def rank_token_count(n_tokens: int, rank: int, ranks: int) -> int:
    """How many of tokens ``0 .. n_tokens-1`` live on ``rank``."""
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} out of range 0..{ranks - 1}")
    return max(0, (n_tokens - rank + ranks - 1) // ranks)


def write_step_bytes(record_bytes: int, max_write_bytes: int) -> int:
    """Bytes of every write of a staging buffer but its last: the most whole records that fit in
    ``max_write_bytes``."""
    return max_write_bytes // record_bytes * record_bytes


def _write_count(buffer_bytes: int, step_bytes: int) -> int:
    """Writes of a staging buffer of ``buffer_bytes`` sent ``step_bytes`` at a time."""
    return -(-buffer_bytes // step_bytes)


class HandoffCounts(NamedTuple):
    """Per decode rank of one hand-off: its tokens, and per stage depth (layers) its writes."""

    rank_tokens: list[int]
    rank_writes: dict[int, list[int]]  # layers -> writes of every rank


def handoff_counts(tokens: int, depths: Iterable[int], record_bytes: int, ranks: int,
                   max_write_bytes: int = DEFAULT_MAX_WRITE_BYTES, token_start: int = 0) -> HandoffCounts:
    """Every decode rank's tokens of a hand-off and, for each stage depth in ``depths`` (a stage's
    layers), every rank's writes: ``HandoffPlan(tokens, layers, ...)``'s ``rank_tokens(r)`` and
    ``rank_writes(r)`` for all depths at once, without building and validating plans (the
    simulator calls it for every request). Arguments must be valid ``HandoffPlan`` fields."""
    end = token_start + tokens
    rank_tokens = [rank_token_count(end, r, ranks) - rank_token_count(token_start, r, ranks) for r in range(ranks)]
    step = write_step_bytes(record_bytes, max_write_bytes)
    return HandoffCounts(rank_tokens, {layers: [_write_count(n * layers * record_bytes, step) for n in rank_tokens]
                                       for layers in depths})


@dataclass(frozen=True)
class Write:
    """One write of a staging buffer: ``nbytes`` starting at ``offset_bytes``."""

    rank: int
    offset_bytes: int
    nbytes: int


@dataclass(frozen=True)
class HandoffPlan:
    """Gather and write plan for one stage's share of a request, towards every decode rank.

    Attributes:
        tokens: tokens handed off (positions ``token_start .. token_start + tokens - 1``).
        token_start: absolute position of the first token (decides the DCP rank of each token).
        layers: layers of the prefill stage.
        record_bytes: bytes per token per layer.
        ranks: decode ranks (DCP size).
        max_write_bytes: write-size cap.
    """

    tokens: int
    layers: int
    record_bytes: int
    ranks: int
    max_write_bytes: int = DEFAULT_MAX_WRITE_BYTES
    token_start: int = 0

    def __post_init__(self) -> None:
        for name in ("tokens", "layers", "record_bytes", "ranks", "max_write_bytes", "token_start"):
            v = getattr(self, name)
            if v < 0 or (v == 0 and name in ("layers", "record_bytes", "ranks", "max_write_bytes")):
                raise ValueError(f"{name} must be {'> 0' if name != 'tokens' else '>= 0'}, got {v}")
        if self.max_write_bytes < self.record_bytes:
            raise ValueError(
                f"max_write_bytes {self.max_write_bytes} is smaller than one record ({self.record_bytes} B)"
            )

    def rank_tokens(self, rank: int) -> int:
        """Tokens of this hand-off bound for ``rank``."""
        end = self.token_start + self.tokens
        return rank_token_count(end, rank, self.ranks) - rank_token_count(self.token_start, rank, self.ranks)

    def rank_positions(self, rank: int) -> range:
        """Absolute token positions bound for ``rank``, in staging-buffer order."""
        first = self.token_start + ((rank - self.token_start) % self.ranks)
        return range(first, self.token_start + self.tokens, self.ranks)

    def buffer_bytes(self, rank: int) -> int:
        """Size of ``rank``'s staging buffer (layer-major: layers x rank tokens x record)."""
        return self.rank_tokens(rank) * self.layers * self.record_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes handed off by this stage to all ranks."""
        return self.tokens * self.layers * self.record_bytes

    @property
    def naive_writes(self) -> int:
        """Writes of a direct copy: one per token per layer."""
        return self.tokens * self.layers

    def writes(self, rank: int) -> list[Write]:
        """Writes of ``rank``'s buffer, each at most ``max_write_bytes`` and whole records."""
        size = self.buffer_bytes(rank)
        step = write_step_bytes(self.record_bytes, self.max_write_bytes)
        return [Write(rank, off, min(step, size - off)) for off in range(0, size, step)]

    def rank_writes(self, rank: int) -> int:
        """Number of writes of ``rank``'s buffer (``len(writes(rank))`` without building them)."""
        return _write_count(self.buffer_bytes(rank), write_step_bytes(self.record_bytes, self.max_write_bytes))

    def rank_plan(self) -> list[tuple[int, int]]:
        """``(tokens, writes)`` of every rank in one pass (``handoff_counts`` of this plan's depth)."""
        counts = handoff_counts(self.tokens, (self.layers,), self.record_bytes, self.ranks, self.max_write_bytes,
                                self.token_start)
        return list(zip(counts.rank_tokens, counts.rank_writes[self.layers]))

    def all_writes(self) -> list[Write]:
        """Every batched write, rank by rank."""
        return [w for r in range(self.ranks) for w in self.writes(r)]

    @property
    def batched_writes(self) -> int:
        """Number of batched writes over all ranks."""
        return sum(w for _, w in self.rank_plan())
