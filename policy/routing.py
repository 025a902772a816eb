"""Routing: which decode instance generates a request and which prefill instance computes it.

Contract:
    * ``routing_for(router, seed, prefill_instances, decode_instances) -> Routing`` is how both
      worlds build their routing (the simulator's ``sim.world`` and production's
      ``backend.serve.router``), from the scenario's ``routing.prefill``, ``seed`` and instance
      counts. Prefill instance ``i`` serves decode group ``policy.placement.prefill_group(i, D)``.
    * ``Routing.choose_prefill(decode, session, outstanding_tokens)``: a prefill instance of
      ``decode``'s group (every instance when the group has none), picked by that group's router
      over those instances' outstanding prompt tokens; ``outstanding_tokens`` covers every prefill
      instance and the answer is an index into it.
    * One router per decode group, each with its own ``random.Random`` seeded from
      ``random.Random(seed).random()`` in group order, so the same scenario makes the same choices
      in both worlds for the same sequence of calls.
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

from kvpool.policy.placement import prefill_group


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


class Routing:
    """Every routing decision of one deployment: the decode groups' prefill instances and their
    routers (see the module contract)."""

    def __init__(self, router: str, seed: int, prefill_groups: Sequence[int], decode_instances: int) -> None:
        if decode_instances <= 0:
            raise ValueError(f"decode_instances must be > 0, got {decode_instances}")
        if not prefill_groups:
            raise ValueError("no prefill instance to route to")
        self.prefill_instances = n = len(prefill_groups)
        #: per decode group: its prefill instances (every instance when the group has none)
        self.group_prefills = [[i for i, g in enumerate(prefill_groups) if g == d] or list(range(n))
                               for d in range(decode_instances)]
        rng = random.Random(seed)
        self.routers = [make_router(router, random.Random(rng.random())) for _ in range(decode_instances)]

    def choose_prefill(self, decode: int, session: str, outstanding_tokens: Sequence[int]) -> int:
        """The prefill instance (an index into ``outstanding_tokens``, one entry per instance) for a
        request of ``session`` generated on ``decode``: its group's router over the group's instances."""
        if len(outstanding_tokens) != self.prefill_instances:
            raise ValueError(f"outstanding_tokens: one per prefill instance ({self.prefill_instances}), "
                             f"got {len(outstanding_tokens)}")
        group = self.group_prefills[decode]
        return group[self.routers[decode].choose(session, [outstanding_tokens[i] for i in group])]


def routing_for(router: str, seed: int, prefill_instances: int, decode_instances: int) -> Routing:
    """The routing of a deployment of ``prefill_instances`` and ``decode_instances`` with prefill
    router ``router`` (a ``ROUTERS`` name) and ``seed``: what the simulator and production build."""
    groups = [prefill_group(i, decode_instances) for i in range(prefill_instances)]
    return Routing(router, seed, groups, decode_instances)
