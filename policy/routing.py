"""Routing: which prefill instance computes a request and which decode instance generates it.

Contract:
    * ``power_of_two``: sample two distinct prefill instances uniformly with the caller's seeded
      RNG and pick the one with fewer outstanding tokens (ties: the lower index). With one
      instance, that one.
    * ``session_affinity``: a session's requests go to the instance its first request went to
      (while it is among the candidates), otherwise power-of-two picks and the choice is remembered.
    * ``choose_decode``: decode-aware choice, the instance with the most free KV tokens
      (ties: the lower index).
    * The RNG (``random.Random``) is passed in: no global ``random``, deterministic for a seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol


class PrefillRouter(Protocol):
    name: str

    def choose(self, session: str, outstanding_tokens: Sequence[int]) -> int:
        """Index of the prefill instance for a request of ``session``."""


def power_of_two(outstanding_tokens: Sequence[int], rng: random.Random) -> int:
    """Pick the less loaded of two randomly sampled instances."""
    n = len(outstanding_tokens)
    if n == 0:
        raise ValueError("no prefill instance to route to")
    if n == 1:
        return 0
    a, b = rng.sample(range(n), 2)
    la, lb = outstanding_tokens[a], outstanding_tokens[b]
    if la != lb:
        return a if la < lb else b
    return min(a, b)


class PowerOfTwoRouter:
    name = "power_of_two"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, session: str, outstanding_tokens: Sequence[int]) -> int:
        return power_of_two(outstanding_tokens, self.rng)


class SessionAffinityRouter:
    name = "session_affinity"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._home: dict[str, int] = {}

    def choose(self, session: str, outstanding_tokens: Sequence[int]) -> int:
        home = self._home.get(session)
        if home is not None and home < len(outstanding_tokens):
            return home
        pick = power_of_two(outstanding_tokens, self.rng)
        self._home[session] = pick
        return pick

    def forget(self, session: str) -> None:
        """Drop a finished session's home."""
        self._home.pop(session, None)


ROUTERS: dict[str, type] = {"power_of_two": PowerOfTwoRouter, "session_affinity": SessionAffinityRouter}


def make_router(name: str, rng: random.Random) -> PrefillRouter:
    """A prefill router by registry name; unknown names list the allowed ones."""
    try:
        return ROUTERS[name](rng)
    except KeyError:
        raise ValueError(f"unknown router {name!r}; allowed: {sorted(ROUTERS)}") from None


def choose_decode(free_kv_tokens: Sequence[int]) -> int:
    """Decode-aware choice: the instance with the most free KV tokens."""
    if not free_kv_tokens:
        raise ValueError("no decode instance to route to")
    best = 0
    for i, f in enumerate(free_kv_tokens):
        if f > free_kv_tokens[best]:
            best = i
    return best
