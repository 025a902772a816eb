"""Chunked prefill's step packing (``policy.prefill_steps.pack_step``), the rule the prefill
engine's scheduler and the simulator's prefill instance both run."""

from __future__ import annotations

import pytest

from kvpool.policy.prefill_steps import pack_step, step_requests


def test_requests_that_fit_are_taken_whole_in_admission_order():
    assert pack_step([100, 200, 300], 1000, 16) == [100, 200, 300]


def test_a_request_that_does_not_fit_gets_whole_pages_and_ends_the_step():
    # 1000 - 500 = 500 left: 31 pages (496) of the second; 4 tokens left, under a page
    assert pack_step([500, 700, 50], 1000, 16) == [500, 496]


def test_packing_stops_when_less_than_a_page_is_left():
    assert pack_step([990, 5], 1000, 16) == [990]       # 10 tokens left, under a page
    assert pack_step([984, 5], 1000, 16) == [984, 5]     # 16 left: a page's room


def test_a_step_smaller_than_a_page_takes_only_a_request_that_fits():
    assert pack_step([20], 10, 16) == []
    assert pack_step([8, 20], 10, 16) == [8]


def test_one_token_pages_fill_the_budget_exactly():
    # the simulator's fluid model: a step may end anywhere
    assert pack_step([700, 700], 1000, 1) == [700, 300]


def test_the_remaining_tokens_are_read_only_as_far_as_the_step_reaches():
    seen = []

    def remaining():
        for n in (600, 600, 600):
            seen.append(n)
            yield n

    assert pack_step(remaining(), 1000, 16) == [600, 400]
    assert len(seen) == 2


def test_a_page_size_below_one_is_refused():
    with pytest.raises(ValueError, match="page_tokens"):
        pack_step([10], 100, 0)


def test_a_step_takes_every_runnable_request_unless_spread():
    assert step_requests(7, 4, spread=False) == 7
    assert [step_requests(n, 4, spread=True) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert step_requests(3, 1, spread=True) == 3     # one stage: nothing to fill


def test_step_requests_refuses_a_pipeline_without_stages():
    with pytest.raises(ValueError, match="stages"):
        step_requests(3, 0, spread=True)
