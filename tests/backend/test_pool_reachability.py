"""``Reachability``: a lost master is probed at most once per period, and calls are refused at once meanwhile."""

from __future__ import annotations

import threading

import pytest

from kvpool.backend.pool.reachability import Reachability


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_up_until_lost_then_refused_without_probing_until_the_period_passes():
    clock, probes = Clock(), []
    r = Reachability(lambda: probes.append(clock.t) or False, reprobe_every_s=1.0, clock=clock)
    assert r.usable() and r.up and r.down_since_s is None and probes == []
    r.lost("no answer (code -900)")
    assert not r.up and r.down_since_s == 100.0 and r.reason == "no answer (code -900)" and r.losses == 1
    clock.t = 100.9
    assert [r.usable() for _ in range(5)] == [False] * 5 and probes == []    # inside the period: no probe
    clock.t = 101.0
    assert not r.usable() and probes == [101.0]                              # one probe, it fails
    assert not r.usable() and probes == [101.0]                              # the next one a period later
    clock.t = 102.5
    assert not r.usable() and probes == [101.0, 102.5]
    assert r.down_since_s == 100.0 and r.losses == 1


def test_a_probe_that_connects_lets_the_call_through_and_an_answer_keeps_it_up():
    clock, answers = Clock(), [False, True]
    r = Reachability(lambda: answers.pop(0), reprobe_every_s=0.5, clock=clock)
    r.lost("x")
    clock.t += 0.5
    assert not r.usable()
    clock.t += 0.5
    assert r.usable() and r.up and r.reason == ""
    r.answered()
    assert r.usable() and r.up
    r.lost("again")                                                          # a second loss is counted
    assert not r.usable() and r.losses == 2


def test_lost_again_after_a_probe_restarts_the_period():
    clock = Clock()
    r = Reachability(lambda: True, reprobe_every_s=1.0, clock=clock)
    r.lost("x")
    clock.t += 1.0
    assert r.usable()                                                        # the probe connected
    r.lost("the call still got no answer")                                   # e.g. a hung master
    clock.t += 0.99
    assert not r.usable()
    clock.t += 0.01
    assert r.usable()


def test_callers_during_a_probe_wait_for_it_and_take_its_outcome():
    clock, entered, release = Clock(), threading.Event(), threading.Event()

    def slow_probe() -> bool:
        entered.set()
        release.wait(5.0)
        return True

    r = Reachability(slow_probe, reprobe_every_s=1.0, clock=clock)
    r.lost("x")
    clock.t += 1.0
    got: list[bool] = []
    first = threading.Thread(target=lambda: got.append(r.usable()))
    first.start()
    assert entered.wait(5.0)
    second = threading.Thread(target=lambda: got.append(r.usable()))
    second.start()
    second.join(0.2)
    assert second.is_alive() and got == []                                   # it waits for the probe
    release.set()
    first.join(5.0)
    second.join(5.0)
    assert got == [True, True] and r.probes == 1 and r.up


def test_a_failed_probe_answers_the_callers_that_waited_for_it():
    clock = Clock()
    r = Reachability(lambda: False, reprobe_every_s=1.0, clock=clock)
    r.lost("x")
    clock.t += 1.0
    results = []
    threads = [threading.Thread(target=lambda: results.append(r.usable())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5.0)
    assert results == [False] * 4 and r.probes == 1


def test_a_negative_period_is_refused():
    with pytest.raises(ValueError, match="reprobe_every_s"):
        Reachability(lambda: True, reprobe_every_s=-1.0)
