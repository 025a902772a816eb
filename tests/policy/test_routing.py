"""policy.routing: power-of-two, session affinity, decode-aware choice."""

import random
from collections import Counter

import pytest

from kvpool.policy.routing import (
    SessionAffinityRouter,
    choose_decode,
    make_router,
    power_of_two,
)


def test_power_of_two_never_picks_the_most_loaded_of_three():
    rng = random.Random(1)
    picks = Counter(power_of_two([10, 0, 50], rng) for _ in range(300))
    assert picks[2] == 0 and picks[1] > picks[0] > 0


def test_power_of_two_is_deterministic_for_a_seed():
    a = [power_of_two([1, 2, 3, 4, 5, 6], random.Random(7)) for _ in range(5)]
    b = [power_of_two([1, 2, 3, 4, 5, 6], random.Random(7)) for _ in range(5)]
    assert a == b


def test_single_instance_and_empty():
    assert power_of_two([5], random.Random(0)) == 0
    with pytest.raises(ValueError):
        power_of_two([], random.Random(0))


def test_session_affinity_sticks():
    r = SessionAffinityRouter(random.Random(3))
    first = r.choose("s1", [0, 0, 0, 0])
    assert all(r.choose("s1", [100 if i == first else 0 for i in range(4)]) == first for _ in range(10))
    r.forget("s1")
    assert r.choose("s1", [100 if i == first else 0 for i in range(4)]) != first


def test_choose_decode_most_free():
    assert choose_decode([5, 9, 9, 1]) == 1
    with pytest.raises(ValueError):
        choose_decode([])


def test_unknown_router():
    with pytest.raises(ValueError, match="allowed"):
        make_router("random", random.Random(0))
