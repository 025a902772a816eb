"""sim.links.FairLink: processor sharing, posting cost, exact completion times."""

import pytest
import simpy

from kvpool.sim.events import fire
from kvpool.sim.links import FairLink


def finish_times(transfers, **kw):
    """transfers: (start_s, nbytes, writes); returns completion times."""
    env = simpy.Environment()
    link = FairLink(env, 100.0, **kw)
    done = {}

    def go(i, start, nbytes, writes):
        yield env.timeout(start)
        yield link.transfer(nbytes, writes)
        done[i] = env.now

    for i, t in enumerate(transfers):
        env.process(go(i, *t))
    env.run()
    return [done[i] for i in range(len(transfers))], link


def test_single_transfer_takes_bytes_over_bandwidth():
    (t,), link = finish_times([(0.0, 500, 0)])
    assert t == pytest.approx(5.0) and link.bytes_moved == 500


def test_two_equal_transfers_share_the_link():
    times, _ = finish_times([(0.0, 100, 0), (0.0, 100, 0)])
    assert times == pytest.approx([2.0, 2.0])


def test_late_arrival_slows_the_first_and_small_one_finishes_first():
    # A: 300 B at t=0; B: 50 B at t=1. 0-1: A alone (100 B). 1-2: 50 B/s each, B done at 2.
    # A has 150 B left at 2, alone again: done at 3.5.
    times, _ = finish_times([(0.0, 300, 0), (1.0, 50, 0)])
    assert times == pytest.approx([3.5, 2.0])


def test_posting_cost_and_latency_take_link_time():
    (t,), _ = finish_times([(0.0, 100, 10)], writes_per_s=10.0, latency_s=0.5)
    assert t == pytest.approx(1.0 + 1.0 + 0.5)


def test_zero_bytes_is_immediate():
    (t,), _ = finish_times([(2.0, 0, 5)])
    assert t == 2.0


def _reference_ps(transfers, bw):
    """Processor sharing stated directly: between consecutive arrivals/departures every active
    transfer gets bw / n; returns completion times."""
    left = {i: float(nb) for i, (_, nb, _) in enumerate(transfers)}
    arrivals = sorted((t, i) for i, (t, _, _) in enumerate(transfers))
    active, done, now = set(), {}, 0.0
    while len(done) < len(transfers):
        next_arrival = arrivals[0][0] if arrivals else float("inf")
        if active:
            n = len(active)
            first = min(active, key=lambda i: left[i])
            finish = now + left[first] * n / bw
        else:
            finish = float("inf")
        t = min(next_arrival, finish)
        if active:
            for i in active:
                left[i] -= bw * (t - now) / len(active)
        now = t
        if finish <= next_arrival:
            for i in [i for i in active if left[i] <= 1e-9]:
                active.discard(i)
                done[i] = now
        else:
            _, i = arrivals.pop(0)
            active.add(i)
    return [done[i] for i in range(len(transfers))]


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20).map(float), st.integers(1, 900), st.just(0)), min_size=1, max_size=12))
def test_matches_processor_sharing_stated_directly(transfers):
    times, link = finish_times(transfers)
    assert times == pytest.approx(_reference_ps(transfers, 100.0), rel=1e-9, abs=1e-6)
    assert link.bytes_moved == sum(nb for _, nb, _ in transfers)


@settings(max_examples=60, deadline=None)
def join(env: simpy.Environment, events: list[simpy.Event]) -> simpy.Event:
    """The reference Join replaced: an event that succeeds (``sim.events.fire``, at once) when the
    last of ``events`` has; a single event is returned as it is, none succeed through the queue."""
    if len(events) == 1:
        return events[0]
    done = env.event()
    left = [0]

    def one(_e) -> None:
        left[0] -= 1
        if not left[0]:
            fire(done)

    for ev in events:
        if ev.callbacks is not None:  # not processed yet
            left[0] += 1
            ev.callbacks.append(one)
    if not left[0]:
        done.succeed()
    return done


@given(st.lists(st.tuples(st.floats(0.0, 5.0), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 400)),
                                                        min_size=1, max_size=4)), min_size=1, max_size=12))
def test_join_completes_as_a_join_of_transfer_events(groups):
    """Groups of transfers (on three links, empty ones included) finish as one: with links.Join,
    at the moment and in the order a join over the transfers' events finishes them, and
    the links carry the same traffic (a finished group starts a transfer on its first link)."""
    from kvpool.sim.links import Join

    def run(use_join):
        env = simpy.Environment()
        links = [FairLink(env, 100.0, writes_per_s=50.0, name=str(i)) for i in range(3)]
        order = []

        def group(i, start, members):
            yield env.timeout(start)
            if use_join:
                j = Join(env)
                for link, nbytes in members:
                    links[link].transfer(nbytes, 1, j)
                j.close()
                yield j.done
            else:
                yield join(env, [links[link].transfer(nbytes, 1) for link, nbytes in members])
            order.append((i, env.now))
            links[members[0][0]].transfer(50, 1)

        for i, (start, members) in enumerate(groups):
            env.process(group(i, start, members))
        env.run()
        return order, [link.bytes_moved for link in links]

    assert run(True) == run(False)


def test_join_with_a_callback_and_empty_transfers():
    from kvpool.sim.links import Join

    env = simpy.Environment()
    link = FairLink(env, 100.0)
    seen = []
    j = Join(env, lambda: seen.append(env.now))
    link.transfer(0, 1, j)
    assert j.left == 1 and not seen  # an empty transfer completes through the queue
    env.run()
    assert seen == [0.0]
