"""One routing in both worlds: for the same stream of requests (session, outstanding prompt tokens per
prefill instance, free KV per decode instance), the simulator's route step (``sim.lifecycle.Lifecycle.route``
on a ``sim.world.World``, after its admit step without a gate, ``sim.steps.admit.Ungated``) and the
production router's (``Router._admit`` without a gate, then ``Router._route``) pick the same decode and
prefill instances, in a scenario of 2 decode instances and 4 prefill instances in 2 groups, with the
serve-sized capacities (``cost.kv_capacity = "serve"``) in both."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from kvpool.backend.serve.router import Completion, Engines, Router
from kvpool.scenario import load_scenario
from kvpool.scenario.derive import decode_kv_capacity_tokens, serve_decode_kv_tokens
from kvpool.sim.lifecycle import Lifecycle
from kvpool.sim.request import Request
from kvpool.sim.world import World
from kvpool.workload.records import RequestRecord

#: cpu-tiny as 2 decode instances and 4 prefill instances (groups {0, 2} and {1, 3}), no gate: the
#: decode instance is the routing's own choice in both worlds
TWO_GROUPS = ["decode.instances=2", "prefill.instances=4", "cluster.servers=3", "gate.enabled=false",
              'cost.kv_capacity="serve"']
SESSIONS = [f"s{k}" for k in range(8)]


def recorded_stream(seed: int, n: int, decode_kv_tokens: int) -> list[tuple[str, list[int], list[int], int]]:
    """``n`` requests: (session, outstanding prompt tokens per prefill instance, free KV tokens per decode
    instance, prompt tokens); ties in both lists are frequent."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        outstanding = [rng.choice((0, 0, 100, 200, 300)) for _ in range(4)]
        free = [rng.choice((decode_kv_tokens, decode_kv_tokens // 2, 1000)) for _ in range(2)]
        out.append((rng.choice(SESSIONS), outstanding, free, rng.randint(1, 500)))
    return out


def simulator_choices(s, stream) -> list[tuple[int, int]]:
    world = World(s)
    life = Lifecycle(world)
    life.lookup = lambda r: None  # the route step alone: what comes after it is not under test
    out = []
    for k, (session, outstanding, free, n_in) in enumerate(stream):
        for p, tokens in zip(world.prefills, outstanding, strict=True):
            p.outstanding_tokens = tokens
        life.admit_step.admission.admitted_tokens = [d.capacity_tokens - tokens for d, tokens in zip(world.decodes, free,
                                                                                             strict=True)]
        rec = RequestRecord(key=k, session=session, in_tokens=n_in, out_tokens=1)
        dispatch = SimpleNamespace(scope="", session=SimpleNamespace(id=session))
        r = Request(dispatch, rec, lambda _d: None)
        life.admit_step.arrive(rec, lambda decode, r=r: life.route(r, decode), lambda: None)
        out.append((rec.decode, rec.prefill))
    return out


def router_choices(s, stream) -> list[tuple[int, int]]:
    nowhere = "http://127.0.0.1:9"  # never called: routing posts nothing
    router = Router(s, Engines(prefill=tuple((f"prefill{i}", nowhere) for i in range(s.prefill.instances)),
                               decode=tuple((f"decode{j}", nowhere) for j in range(s.decode.instances))))
    cap = serve_decode_kv_tokens(s)

    async def run() -> list[tuple[int, int]]:
        out = []
        for k, (session, outstanding, free, n_in) in enumerate(stream):
            router.prefill_outstanding[:] = outstanding
            router.ungated.admitted_tokens[:] = [cap - f for f in free]
            c = Completion(prompt_ids=(1,) * n_in, max_tokens=1, ignore_eos=True, stream=False, session=session)
            decode = await router._admit(f"cmpl-{k}", c)
            out.append((decode, router._route(decode, c)))
            router._held.clear()
        return out

    return asyncio.run(run())


@pytest.mark.parametrize("router_name", ["power_of_two", "session_affinity"])
def test_the_simulator_and_the_router_route_a_recorded_stream_alike(router_name):
    s = load_scenario("cpu-tiny", [*TWO_GROUPS, f"routing.prefill={router_name}"])
    assert decode_kv_capacity_tokens(s) == serve_decode_kv_tokens(s)  # the simulator's decode KV is production's
    stream = recorded_stream(3, 200, serve_decode_kv_tokens(s))
    sim = simulator_choices(s, stream)
    real = router_choices(s, stream)
    assert sim == real
    assert {d for d, _ in sim} == {0, 1} and {p for _, p in sim} == {0, 1, 2, 3}
    assert all(p % 2 == d for d, p in sim)  # a prefill instance of the decode instance's group
