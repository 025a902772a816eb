"""policy.admission: the KV admission gate."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.policy.admission import DEADLINE_SLACK_S, Admission, AdmissionGate, GateConfig, Ungated, Verdict, refusal


def gate(decodes=2, **kw):
    return AdmissionGate(GateConfig(**kw), decodes)


def small(decodes=2, budget=1000, wait_s=30.0):
    """A gate of ``budget`` tokens per decode instance whose caps never bind."""
    return gate(decodes, tokens_per_decode=budget, budget_fraction=1.0, max_input_tokens=budget,
                max_output_tokens=budget, max_wait_s=wait_s)


def test_seed_budget():
    assert GateConfig().budget_tokens == 9_000_000


def test_caps_reject_with_reason():
    g = gate()
    assert g.try_admit("a", 917_505, 1, 0) is Verdict.REJECT_INPUT
    assert g.try_admit("b", 1000, 131_073, 0) is Verdict.REJECT_OUTPUT
    assert g.try_admit("c", 917_504, 131_072, 0) is Verdict.ADMITTED


def test_refusal_checks_the_caps_then_the_budget_it_is_given():
    c = GateConfig(tokens_per_decode=1000, budget_fraction=1.0, max_input_tokens=500, max_output_tokens=100)
    assert refusal(c, 501, 1, 10_000) is Verdict.REJECT_INPUT
    assert refusal(c, 10, 101, 10_000) is Verdict.REJECT_OUTPUT
    assert refusal(c, 450, 100, 500) is Verdict.REJECT_BUDGET
    assert refusal(c, 400, 100, 500) is None


def test_the_gates_check_is_refusal_over_its_own_budget():
    c = GateConfig(tokens_per_decode=1000, budget_fraction=0.5, max_input_tokens=800, max_output_tokens=100)
    g = AdmissionGate(c, 1)
    cases = [(801, 1), (10, 101), (450, 100), (400, 100)]
    assert [g.check(i, o) for i, o in cases] == [refusal(c, i, o, 500) for i, o in cases]
    assert [g.check(i, o) for i, o in cases] == [Verdict.REJECT_INPUT, Verdict.REJECT_OUTPUT, Verdict.REJECT_BUDGET, None]


def test_ungated_admission_refuses_as_refusal_does_and_picks_the_decode_with_most_left():
    c = GateConfig(tokens_per_decode=1000, budget_fraction=1.0, max_input_tokens=500, max_output_tokens=100)
    u = Ungated(c, [550, 800])
    assert u.admit("in", 501, 1) == Admission(Verdict.REJECT_INPUT)
    assert u.admit("out", 10, 101) == Admission(Verdict.REJECT_OUTPUT)
    assert u.admit("budget", 500, 100) == Admission(Verdict.REJECT_BUDGET)  # over the smaller capacity
    assert u.admit("a", 300, 100) == Admission(Verdict.ADMITTED, 1)  # 800 left against 550
    assert u.admit("b", 100, 50) == Admission(Verdict.ADMITTED, 0)  # 550 against 400
    assert u.admit("c", 100, 50) == Admission(Verdict.ADMITTED, 0)  # 400 and 400: the lower index
    assert u.admitted_tokens == [300, 400]
    u.release("a")
    assert u.admitted_tokens == [300, 0]
    with pytest.raises(ValueError, match="holds no reservation"):
        u.release("a")
    with pytest.raises(ValueError, match="already admitted"):
        u.admit("b", 1, 1)
    assert u.admit("d", 500, 50) == Admission(Verdict.ADMITTED, 1)
    assert u.admit("e", 500, 50) == Admission(Verdict.ADMITTED, 0)  # it never waits, fitting or not
    assert u.admitted_tokens == [850, 550]


def test_wait_then_admit_after_release():
    g = gate(decodes=1, tokens_per_decode=1000, budget_fraction=1.0, max_input_tokens=1000, max_output_tokens=1000)
    assert g.try_admit("a", 600, 100, 0) is Verdict.ADMITTED
    assert g.try_admit("b", 300, 100, 0) is Verdict.WAIT
    g.release("a")
    assert g.try_admit("b", 300, 100, 0) is Verdict.ADMITTED
    assert g.free_tokens(0) == 600


def test_larger_than_budget_rejected_not_waiting():
    g = gate(decodes=1, tokens_per_decode=1000, budget_fraction=0.5, max_input_tokens=10_000)
    assert g.try_admit("a", 600, 1, 0) is Verdict.REJECT_BUDGET


def test_release_unknown_and_double_admit_are_errors():
    g = gate()
    with pytest.raises(ValueError):
        g.release("nope")
    g.try_admit("a", 10, 10, 0)
    with pytest.raises(ValueError):
        g.try_admit("a", 10, 10, 1)
    with pytest.raises(ValueError):
        g.arrive("a", 10, 10, 0.0)


def test_a_waiting_id_cannot_arrive_again_or_be_released():
    g = small(decodes=1)
    assert g.arrive("a", 900, 100, 0.0).verdict is Verdict.ADMITTED
    assert g.arrive("b", 10, 10, 0.0).verdict is Verdict.WAIT
    with pytest.raises(ValueError):
        g.arrive("b", 10, 10, 1.0)
    with pytest.raises(ValueError):
        g.try_admit("b", 10, 10, 0)
    with pytest.raises(ValueError):
        g.release("b")  # waiting holds no reservation
    assert g.waiting == 1


# -- the waiting discipline ----------------------------------------------------------------------

def test_arrive_admits_on_the_instance_with_most_free_tokens_ties_to_the_lower_index():
    g = small(decodes=3)
    assert g.arrive("a", 100, 0, 0.0) == Admission(Verdict.ADMITTED, decode=0)  # all equal: the lowest
    assert g.arrive("b", 100, 0, 0.0) == Admission(Verdict.ADMITTED, decode=1)
    assert g.arrive("c", 300, 0, 0.0) == Admission(Verdict.ADMITTED, decode=2)
    assert g.arrive("d", 50, 0, 0.0) == Admission(Verdict.ADMITTED, decode=0)  # 900 free on 0 and 1
    assert g.reserved == [150, 100, 300]


def test_arrive_that_fits_nowhere_waits_until_its_deadline():
    g = small(decodes=2, wait_s=30.0)
    for i in range(2):
        assert g.arrive(("blocker", i), 800, 0, 0.0).verdict is Verdict.ADMITTED
    a = g.arrive("big", 300, 0, 500.002)
    assert a == Admission(Verdict.WAIT, deadline_s=500.002 + 30.0)
    assert g.waiting == 1 and g.reserved == [800, 800]


def test_caps_reject_at_arrival_without_queueing():
    g = small(decodes=1)
    assert g.arrive("a", 1000, 0, 0.0).verdict is Verdict.ADMITTED  # the gate is full
    assert g.arrive("in", 1001, 0, 0.0) == Admission(Verdict.REJECT_INPUT)
    assert g.arrive("out", 0, 1001, 0.0) == Admission(Verdict.REJECT_OUTPUT)
    assert g.arrive("sum", 600, 600, 0.0) == Admission(Verdict.REJECT_BUDGET)
    assert g.waiting == 0


@pytest.mark.parametrize("wait_s", [0.0, DEADLINE_SLACK_S])
def test_a_wait_bound_within_the_slack_rejects_at_once(wait_s):
    g = small(decodes=1, wait_s=wait_s)
    assert g.arrive("a", 1000, 0, 0.0).verdict is Verdict.ADMITTED
    assert g.arrive("b", 1, 0, 7.0) == Admission(Verdict.REJECT_TIMEOUT)
    assert g.waiting == 0
    assert g.release("a") == []  # b is not queued
    assert g.arrive("c", 1, 0, 8.0) == Admission(Verdict.ADMITTED, decode=0)


def test_a_wait_bound_just_over_the_slack_waits():
    g = small(decodes=1, wait_s=2 * DEADLINE_SLACK_S)
    g.arrive("a", 1000, 0, 0.0)
    assert g.arrive("b", 1, 0, 0.0).verdict is Verdict.WAIT


def test_a_new_request_that_fits_is_admitted_while_a_larger_one_waits():
    g = small(decodes=1)
    g.arrive("a", 600, 0, 0.0)
    assert g.arrive("big", 500, 0, 1.0).verdict is Verdict.WAIT
    assert g.arrive("small", 400, 0, 2.0) == Admission(Verdict.ADMITTED, decode=0)
    assert g.waiting == 1


def test_release_first_fit_a_waiter_that_does_not_fit_keeps_its_place():
    g = small(decodes=2, budget=900)
    g.arrive(("blocker", 0), 900, 0, 0.0)
    g.arrive(("blocker", 1), 900, 0, 0.0)
    for rid, need in ((1, 600), (2, 700), (3, 200), (4, 120)):
        assert g.arrive(rid, need, 0, float(rid)).verdict is Verdict.WAIT
    assert g.release(("blocker", 0)) == [(1, 0), (3, 0)]  # 2 does not fit the 300 left; 3 does
    assert g.waiting == 2 and g.free_tokens(0) == 100
    assert g.release(("blocker", 1)) == [(2, 1), (4, 1)]  # 2 first: it kept its place ahead of 4
    assert g.waiting == 0
    assert g.reserved == [800, 820]


def test_release_admits_several_waiters_while_the_freed_budget_lasts():
    g = small(decodes=2)
    g.arrive("a", 1000, 0, 0.0)
    g.arrive("b", 900, 0, 0.0)  # 100 left on decode 1
    for rid, need in (("w1", 300), ("w2", 300), ("w3", 300), ("w4", 200)):
        assert g.arrive(rid, need, 0, 1.0).verdict is Verdict.WAIT
    # decode 0 frees 1000: w1, w2, w3 take 900 of it; w4 fits neither the 100 left there nor on 1
    assert g.release("a") == [("w1", 0), ("w2", 0), ("w3", 0)]
    assert g.waiting == 1 and g.reserved == [900, 900]
    assert g.release("w1") == [("w4", 0)]
    assert g.waiting == 0 and g.reserved == [800, 900]


def test_release_offers_each_waiter_the_budget_once_in_arrival_order_not_by_size():
    g = small(decodes=1)
    g.arrive("a", 1000, 0, 0.0)
    assert g.arrive("w300", 300, 0, 1.0).verdict is Verdict.WAIT
    assert g.arrive("w800", 800, 0, 2.0).verdict is Verdict.WAIT
    # best fit would take w800 alone; first fit in arrival order takes w300, and w800 no longer fits
    assert g.release("a") == [("w300", 0)]
    assert g.waiting == 1


def test_expire_while_waiting_rejects_and_the_request_leaves_the_queue():
    g = small(decodes=1)
    g.arrive("a", 1000, 0, 0.0)
    deadline_s = g.arrive("b", 500, 0, 1.0).deadline_s
    assert deadline_s == 31.0
    assert g.expire("b") is True
    assert g.waiting == 0
    assert g.release("a") == []  # b is gone
    assert g.free_tokens(0) == 1000
    assert g.expire("b") is False  # once only


def test_expire_after_a_release_admitted_the_waiter_is_false_and_keeps_its_reservation():
    g = small(decodes=1)
    g.arrive("a", 1000, 0, 0.0)
    g.arrive("b", 500, 0, 1.0)
    assert g.release("a") == [("b", 0)]
    assert g.expire("b") is False
    assert g.reserved == [500]
    assert g.release("b") == []
    assert g.expire("b") is False  # after it finished too
    assert g.reserved == [0]


def test_a_released_waiter_id_may_arrive_again():
    g = small(decodes=1)
    g.arrive("a", 1000, 0, 0.0)
    g.arrive("b", 500, 0, 1.0)
    g.expire("b")
    assert g.arrive("b", 500, 0, 40.0).verdict is Verdict.WAIT


@given(st.lists(st.tuples(st.integers(1, 400), st.integers(1, 200), st.integers(0, 1), st.booleans()), max_size=60))
def test_reservations_never_exceed_budget(reqs):
    g = gate(decodes=2, tokens_per_decode=1000, budget_fraction=1.0)
    live = []
    for i, (inp, out, d, release_one) in enumerate(reqs):
        if g.try_admit(i, inp, out, d) is Verdict.ADMITTED:
            live.append(i)
        if release_one and live:
            g.release(live.pop(0))
        assert all(0 <= r <= 1000 for r in g.reserved)
    for i in live:
        g.release(i)
    assert g.reserved == [0, 0]


class _Reference:
    """The waiting discipline written plainly: a list of free tokens and a list of waiters."""

    def __init__(self, decodes: int, budget: int, wait_s: float) -> None:
        self.free = [budget] * decodes
        self.wait_s = wait_s
        self.held: dict[int, tuple[int, int]] = {}
        self.queue: list[tuple[int, int, float]] = []  # (id, need, deadline), arrival order

    def _best(self) -> int:
        return self.free.index(max(self.free))

    def arrive(self, rid: int, need: int, now_s: float) -> tuple:
        d = self._best()
        if need <= self.free[d]:
            self.free[d] -= need
            self.held[rid] = (d, need)
            return (Verdict.ADMITTED, d, None)
        self.queue.append((rid, need, now_s + self.wait_s))
        return (Verdict.WAIT, None, now_s + self.wait_s)

    def release(self, rid: int) -> list[tuple[int, int]]:
        d, need = self.held.pop(rid)
        self.free[d] += need
        out = []
        for entry in list(self.queue):
            wid, wneed, _ = entry
            best = self._best()
            if wneed <= self.free[best]:
                self.queue.remove(entry)
                self.free[best] -= wneed
                self.held[wid] = (best, wneed)
                out.append((wid, best))
        return out

    def due(self, now_s: float) -> list[int]:
        return [wid for wid, _, deadline_s in self.queue if deadline_s <= now_s]

    def expire(self, rid: int) -> bool:
        for entry in self.queue:
            if entry[0] == rid:
                self.queue.remove(entry)
                return True
        return False


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(0, 1100)),  # need; over 1000 is rejected by the caps
        st.tuples(st.just("release"), st.integers(0, 1_000)),  # which held request (modulo)
        st.tuples(st.just("tick"), st.floats(0.0, 20.0)),  # advance the clock; expire what is due
        st.tuples(st.just("expire_admitted"), st.integers(0, 1_000)),  # a stale timer of an admitted one
    ),
    max_size=80,
)


@settings(max_examples=300)
@given(decodes=st.integers(1, 3), ops=_ops)
def test_waiting_discipline_matches_the_reference_model(decodes, ops):
    budget, wait_s = 1000, 30.0
    g = small(decodes=decodes, budget=budget, wait_s=wait_s)
    ref = _Reference(decodes, budget, wait_s)
    now_s, next_id = 0.0, 0
    for op, arg in ops:
        if op == "arrive":
            rid, next_id = next_id, next_id + 1
            a = g.arrive(rid, arg, 0, now_s)
            if arg > budget:
                assert a == Admission(Verdict.REJECT_INPUT)
            else:
                assert (a.verdict, a.decode, a.deadline_s) == ref.arrive(rid, arg, now_s)
        elif op == "release" and ref.held:
            rid = sorted(ref.held)[arg % len(ref.held)]
            assert g.release(rid) == ref.release(rid)
        elif op == "tick":
            now_s += arg
            for rid in ref.due(now_s):
                assert g.expire(rid) is True and ref.expire(rid)
        elif op == "expire_admitted" and ref.held:
            assert g.expire(sorted(ref.held)[arg % len(ref.held)]) is False
        assert [budget - r for r in g.reserved] == ref.free
        assert g.waiting == len(ref.queue)
        # work conserving: no waiter fits the instance with the most room
        assert all(need > max(ref.free) for _, need, _ in ref.queue)
