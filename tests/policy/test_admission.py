"""policy.admission: the KV admission gate."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.policy.admission import AdmissionGate, GateConfig, Verdict


def gate(decodes=2, **kw):
    return AdmissionGate(GateConfig(**kw), decodes)


def test_seed_budget():
    assert GateConfig().budget_tokens == 9_000_000


def test_caps_reject_with_reason():
    g = gate()
    assert g.try_admit("a", 917_505, 1, 0) is Verdict.REJECT_INPUT
    assert g.try_admit("b", 1000, 131_073, 0) is Verdict.REJECT_OUTPUT
    assert g.try_admit("c", 917_504, 131_072, 0) is Verdict.ADMITTED


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


def test_wait_bound():
    g = gate(max_wait_s=30.0)
    assert not g.expired(30.0) and g.expired(30.01)


def test_release_unknown_and_double_admit_are_errors():
    g = gate()
    with pytest.raises(ValueError):
        g.release("nope")
    g.try_admit("a", 10, 10, 0)
    with pytest.raises(ValueError):
        g.try_admit("a", 10, 10, 1)


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
