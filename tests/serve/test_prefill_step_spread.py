"""The prefill engine's scheduler forms its steps with ``policy.prefill_steps``: four running
requests that fit one step go in one step, or with ``prefill.spread_requests`` (two stages) in
steps of their share over the stages, two, then one, then one. The scheduler is driven directly
(no stage processes): each step it sends is recorded and leaves stage 0 at once."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpool.backend.serve.prefill_scheduler import PrefillScheduler, SchedulerSettings, _Req
from kvpool.workload.records import RequestRecord


def steps_of_four_requests(spread: bool) -> list[list[str]]:
    settings = SchedulerSettings(max_batched_tokens=128, page_tokens=16, stage_layers=(2, 2), record_bytes=1152,
                                 max_write_bytes=1 << 20, spread_requests=spread)
    sched = PrefillScheduler(settings, blocks=None, naming=None, spec=None, sched_config=None, stage_endpoints=[],
                             stage_pids=[], stage_names=[], decode_ready=lambda instance: Path("."))
    sent: list[list[str]] = []
    sched._send_step = lambda step, tensors: sent.append([req.rid for req, _, _, _ in step.items])
    for k in range(4):
        rid = f"r{k}"
        sched.live[rid] = _Req(rid, tuple(range(20)), 0, "s", 0.0, lambda outcome: None, RequestRecord(rid),
                               state="running", alloc=SimpleNamespace(block_ids=[k, k + 4]), ranges=[[0, 20]])
    while True:
        scheduled = len(sent)
        sched._schedule_step()
        if len(sent) == scheduled:
            return sent
        sched.steps = sched.steps[-1:]   # the step before has left the pipeline
        sched.steps[0].stage = 1          # and this one has left stage 0


@pytest.mark.parametrize("spread, steps", [(False, [["r0", "r1", "r2", "r3"]]),
                                           (True, [["r0", "r1"], ["r2"], ["r3"]])])
def test_a_step_takes_the_running_requests_or_their_share_over_the_stages(spread, steps):
    assert steps_of_four_requests(spread) == steps
