"""sim.events.fire: an event completed at once behaves, for its waiters, as one succeeded through
SimPy's queue at the same moment."""

import pytest
import simpy

from kvpool.sim.events import fire
from kvpool.sim.links import FairLink


def _waiters(complete):
    """Two processes wait on one event that ``complete(env, ev)`` completes at t=3; returns
    what each saw (name, time, value) in order."""
    env = simpy.Environment()
    ev = env.event()
    log = []

    def waiter(name):
        value = yield ev
        log.append((name, env.now, value))

    env.process(waiter("a"))
    env.process(waiter("b"))
    env.timeout(3.0).callbacks.append(lambda _t: complete(ev))
    env.run()
    return log, ev


def test_fire_resumes_waiters_like_succeed():
    fired, ev = _waiters(lambda e: fire(e, 42))
    queued, _ = _waiters(lambda e: e.succeed(42))
    assert fired == queued == [("a", 3.0, 42), ("b", 3.0, 42)]
    assert ev.processed and ev.ok and ev.value == 42


def test_fire_twice_raises():
    env = simpy.Environment()
    ev = env.event()
    fire(ev)
    with pytest.raises(RuntimeError):
        fire(ev)


def test_a_completion_callback_may_start_a_transfer_on_the_same_link():
    """A transfer started from a completion's callback on the same link (chained transfers)
    ends when processor sharing says: the link's state is updated before callbacks run."""
    env = simpy.Environment()
    link = FairLink(env, 100.0)
    done = {}

    def chain():
        yield link.transfer(100)
        done["first"] = env.now
        yield link.transfer(100)  # started from the first one's completion
        done["second"] = env.now

    def other():
        yield env.timeout(0.5)
        yield link.transfer(150)  # shares with the first from 0.5 s, then with the second
        done["other"] = env.now

    env.process(chain())
    env.process(other())
    env.run()
    # 0-0.5: first alone (50 B). 0.5-1.5: both at 50 B/s -> first done at 1.5, other has 100 left.
    # 1.5-3.5: second and other at 50 B/s, both 100 B -> both done at 3.5.
    assert done == pytest.approx({"first": 1.5, "second": 3.5, "other": 3.5})


def test_call_later_runs_as_a_timeouts_callback_in_scheduling_order():
    """call_later takes a Timeout's place on the queue: the same moment, and among callbacks due
    at one moment the order they were scheduled in, interleaved with real Timeouts."""
    from kvpool.sim.events import call_later

    env = simpy.Environment()
    seen = []
    for i in range(6):
        if i % 2:
            call_later(env, 1.5 if i < 4 else 0.5, lambda ev, i=i: seen.append((env.now, i, ev.value)), value=i * 10)
        else:
            env.timeout(1.5 if i < 4 else 0.5, i * 10).callbacks.append(lambda ev, i=i: seen.append((env.now, i, ev.value)))
    env.run()
    assert seen == [(0.5, 4, 40), (0.5, 5, 50), (1.5, 0, 0), (1.5, 1, 10), (1.5, 2, 20), (1.5, 3, 30)]
    with pytest.raises(ValueError):
        call_later(env, -1.0, lambda ev: None)


def test_scheduler_is_call_later_bound_to_one_environment():
    """scheduler(env)'s calls interleave with call_later's and Timeouts' in scheduling order."""
    from kvpool.sim.events import call_later, scheduler

    env = simpy.Environment()
    later = scheduler(env)
    seen = []
    for i in range(6):
        note = lambda ev, i=i: seen.append((env.now, i, ev.value))  # noqa: E731
        [lambda: later(1.0, note, i), lambda: call_later(env, 1.0, note, i),
         lambda: env.timeout(1.0, i).callbacks.append(note)][i % 3]()
    env.run()
    assert seen == [(1.0, i, i) for i in range(6)]


def test_start_takes_a_new_processs_initialize_slot():
    """start(env, fn) runs where env.process would start a process at that moment: ahead of the
    normal events due now, after the urgent ones scheduled before it, interleaved with real
    process starts in scheduling order."""
    from kvpool.sim.events import start

    def model(use_start: bool) -> list:
        env = simpy.Environment()
        seen = []

        def begin(i):
            seen.append((env.now, "begin", i))

        def proc(i):
            begin(i)
            yield env.timeout(0)

        def at_one():
            yield env.timeout(1.0)
            env.timeout(0).callbacks.append(lambda _e: seen.append((env.now, "timeout")))
            for i in range(3):
                if use_start and i != 1:
                    start(env, lambda call: begin(call.value), i)
                else:
                    env.process(proc(i))
            seen.append((env.now, "caller"))

        env.process(at_one())
        env.run()
        return seen

    assert model(True) == model(False) == [(1.0, "caller"), (1.0, "begin", 0), (1.0, "begin", 1),
                                           (1.0, "begin", 2), (1.0, "timeout")]



def test_run_all_steps_as_env_run():
    """run_all processes the same events in the same order as env.run(), and a failed event
    nobody waits on crashes it the same way."""
    from kvpool.sim.events import call_later, run_all

    def model(env, seen):
        def proc(i):
            for k in range(3):
                yield env.timeout(0.5 * (i % 2) + k)
                seen.append((env.now, i, k))
                call_later(env, 0.25, lambda _e, i=i, k=k: seen.append((env.now, "call", i, k)))
        for i in range(4):
            env.process(proc(i))

    a, b = [], []
    env_a, env_b = simpy.Environment(), simpy.Environment()
    model(env_a, a)
    model(env_b, b)
    env_a.run()
    run_all(env_b)
    assert a == b and env_a.now == env_b.now
    env = simpy.Environment()
    env.event().fail(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        run_all(env)



def test_run_all_reports_after_every_batch_of_entries_and_runs_the_same():
    """With a report, run_all still runs every entry in env.run()'s order, and calls the report
    after each full batch of ``every_entries`` entries that leaves entries queued (never at the end)."""
    from kvpool.sim.events import call_later, run_all

    def model(env, seen):
        for i in range(10):
            call_later(env, float(i % 4), lambda _e, i=i: seen.append((env.now, i)))

    a, b, reports = [], [], []
    env_a, env_b = simpy.Environment(), simpy.Environment()
    model(env_a, a)
    model(env_b, b)
    env_a.run()
    run_all(env_b, lambda: reports.append((env_b.now, len(b))), every_entries=3)
    assert a == b and env_a.now == env_b.now
    assert [n for _, n in reports] == [3, 6, 9]  # 10 entries: batches end after 3, 6, 9; the 10th ends the run
    assert [t for t, _ in reports] == [b[2][0], b[5][0], b[8][0]]
