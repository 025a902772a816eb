"""policy.routing: power-of-two, session affinity, decode-aware choice, and the decode groups' routing."""

import random
from collections import Counter

import pytest

from kvpool.policy.placement import place
from kvpool.policy.routing import (
    SessionAffinityRouter,
    choose_decode,
    make_router,
    power_of_two,
    routing_for,
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


def test_routing_groups_are_the_placements_groups():
    """Prefill instance i serves decode group i mod D, as ``policy.placement.place`` assigns it."""
    r = routing_for("power_of_two", 7, 4, 2)
    assert r.group_prefills == [[0, 2], [1, 3]]
    lay = place(servers=3, gpus_per_server=4, numa_per_server=2, decode_instances=2, decode_gpus=2,
                prefill_instances=4, prefill_gpus=2)
    assert [[i for i, pl in enumerate(lay.prefill) if pl.group == g] for g in range(2)] == r.group_prefills


def test_a_decode_group_without_prefills_uses_every_instance():
    assert routing_for("power_of_two", 7, 1, 2).group_prefills == [[0], [0]]


def test_choose_prefill_stays_in_the_decode_group_and_prefers_the_less_loaded():
    r = routing_for("power_of_two", 3, 4, 2)
    picks = [r.choose_prefill(1, f"s{k}", [0, 50, 0, 10]) for k in range(50)]
    assert set(picks) == {3}  # group 1 is {1, 3}; instance 3 has fewer outstanding tokens
    picks = [r.choose_prefill(0, f"s{k}", [20, 0, 10, 0]) for k in range(50)]
    assert set(picks) == {2}  # group 0 is {0, 2}: the idle instances 1 and 3 are another group's


def test_session_affinity_holds_within_a_decode_group():
    r = routing_for("session_affinity", 5, 4, 2)
    load, homes = [0, 0, 0, 0], {}
    for s in ("a", "b", "c", "d", "e", "f"):
        homes[s] = r.choose_prefill(0, s, load)
        load[homes[s]] += 100
    assert set(homes.values()) == {0, 2}
    for s, home in homes.items():
        loaded = [1000 if i == home else 0 for i in range(4)]
        assert r.choose_prefill(0, s, loaded) == home


def test_the_same_arguments_make_the_same_choices_and_another_seed_others():
    def choices(seed: int) -> list[int]:
        r = routing_for("power_of_two", seed, 6, 2)
        return [r.choose_prefill(k % 2, "", [0] * 6) for k in range(40)]

    assert choices(11) == choices(11)
    assert choices(11) != choices(12)


def test_each_decode_group_draws_from_its_own_rng():
    """Group 1's choices do not depend on how many choices group 0 made before."""
    a, b = routing_for("power_of_two", 9, 6, 2), routing_for("power_of_two", 9, 6, 2)
    for _ in range(7):
        a.choose_prefill(0, "", [0] * 6)
    assert [a.choose_prefill(1, "", [0] * 6) for _ in range(20)] == [b.choose_prefill(1, "", [0] * 6) for _ in range(20)]


def test_routing_refuses_inputs_of_the_wrong_size():
    r = routing_for("power_of_two", 1, 4, 2)
    with pytest.raises(ValueError, match="one per prefill instance"):
        r.choose_prefill(0, "", [0, 0])
    with pytest.raises(ValueError, match="allowed"):
        routing_for("random", 1, 4, 2)
    with pytest.raises(ValueError):
        routing_for("power_of_two", 1, 0, 2)
