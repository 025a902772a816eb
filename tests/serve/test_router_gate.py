"""The admission gate in the router: a request that does not fit waits, is admitted by a release, or is
rejected at its deadline."""

from __future__ import annotations

import asyncio

import pytest
from router_testing import metric, routed
from standin_engines import Behaviour

pytestmark = pytest.mark.timeout(60)

#: one decode instance admitting 100 tokens: two requests of 60 + 20 tokens do not fit together
SMALL_GATE = ["gate.tokens_per_decode=100", "gate.budget_fraction=1.0"]
SLOW = Behaviour(token_delay_s=0.05)  # a 20-token request takes about 1 s


async def _until(cond, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


def test_a_waiting_request_is_admitted_when_the_first_releases():
    async def body():
        async with routed([*SMALL_GATE, "gate.max_wait_s=30"], decode=SLOW) as s:
            a = asyncio.create_task(s.complete(prompt=[1] * 60, max_tokens=20))
            await _until(lambda: s.router.gate.reserved == [80])
            b = asyncio.create_task(s.complete(prompt=[2] * 60, max_tokens=20))
            await _until(lambda: s.router.gate.waiting == 1)
            m = await (await s.client.get("/metrics")).text()
            assert metric(m, "kvpool:gate_waiting") == 1
            assert len(s.prefills[0].requests) == 1  # b reached no engine while it waited
            (sa, ra), (sb, rb) = await a, await b
            assert sa == sb == 200, (ra, rb)
            rec_a, rec_b = ra["kvpool"]["record"], rb["kvpool"]["record"]
            assert rec_b["arrival_s"] < rec_a["end_s"] <= rec_b["prefill_start_s"] <= rec_b["first_token_s"]
            assert len(rb["choices"][0]["token_ids"]) == 20
            m = await (await s.client.get("/metrics")).text()
            assert metric(m, "kvpool:gate_waiting") == 0
            assert metric(m, "kvpool:gate_admitted_total") == 2
            assert s.router.gate.reserved == [0] and s.router.gate.waiting == 0

    asyncio.run(body())


def test_a_waiting_request_is_rejected_after_max_wait_s():
    async def body():
        async with routed([*SMALL_GATE, "gate.max_wait_s=0.3"], decode=SLOW) as s:
            loop = asyncio.get_running_loop()
            a = asyncio.create_task(s.complete(prompt=[1] * 60, max_tokens=20))
            await _until(lambda: s.router.gate.reserved == [80])
            t0 = loop.time()
            sb, rb = await s.complete(prompt=[2] * 60, max_tokens=20)
            waited = loop.time() - t0
            assert sb == 429
            assert rb["error"]["type"] == "reject_admission_timeout" and "gate.max_wait_s = 0.3" in rb["error"]["message"]
            assert waited >= 0.3
            assert s.router.gate.reserved == [80] and not a.done()  # rejected while a still held the budget
            sa, ra = await a
            assert sa == 200
            m = await (await s.client.get("/metrics")).text()
            assert metric(m, 'kvpool:gate_rejected_total{reason="reject_admission_timeout"}') == 1
            assert metric(m, "kvpool:gate_waiting") == 0
            # with the budget back, a new request is admitted at once
            sc, rc = await s.complete(prompt=[3] * 60, max_tokens=2)
            assert sc == 200 and s.router.gate.reserved == [0]

    asyncio.run(body())


def test_larger_than_the_budget_is_rejected_at_once():
    async def body():
        async with routed(SMALL_GATE) as s:
            status, r = await s.complete(prompt=[1] * 90, max_tokens=20)
            assert status == 400 and r["error"]["type"] == "reject_larger_than_budget"

    asyncio.run(body())


def test_without_a_gate_requests_go_to_the_decode_with_most_room():
    async def body():
        async with routed(["gate.enabled=false"]) as s:
            status, r = await s.complete(prompt=[1] * 10, max_tokens=3)
            assert status == 200 and r["kvpool"]["record"]["decode"] == 0
            assert s.router.gate is None and s.router.ungated.admitted_tokens == [0]
            status, r = await s.complete(prompt=[1], max_tokens=2000)  # the caps still hold
            assert status == 400 and r["error"]["type"] == "reject_output_too_long"

    asyncio.run(body())


def test_cut_after_the_drain_answers_running_and_waiting_requests_503():
    async def body():
        async with routed([*SMALL_GATE, "gate.max_wait_s=30", "serve.drain_s=0.2"], decode=SLOW) as s:
            a = asyncio.create_task(s.complete(prompt=[1] * 60, max_tokens=20))
            await _until(lambda: s.router.gate.reserved == [80])
            b = asyncio.create_task(s.complete(prompt=[2] * 60, max_tokens=20))
            await _until(lambda: s.router.gate.waiting == 1)
            assert not await s.router.drain(0.2)
            status, r = await s.complete(prompt=[3], max_tokens=1)
            assert status == 503 and "shutting down" in r["error"]["message"]
            s.router.cut_in_flight()
            for task in (a, b):
                status, r = await task
                assert status == 503 and r["error"]["type"] == "unavailable"
                assert "serve.drain_s = 0.2 s" in r["error"]["message"]
            assert s.router.in_flight == 0 and s.router.gate.reserved == [0] and s.router.gate.waiting == 0
            assert s.decodes[0].aborted  # the running one was aborted on decode

    asyncio.run(body())


def test_a_client_leaving_while_it_waits_leaves_the_queue_and_one_leaving_mid_run_is_aborted():
    async def body():
        async with routed([*SMALL_GATE, "gate.max_wait_s=30"], decode=SLOW) as s:
            a = asyncio.create_task(s.complete(prompt=[1] * 60, max_tokens=20))
            await _until(lambda: s.router.gate.reserved == [80])
            b = asyncio.create_task(s.complete(prompt=[2] * 60, max_tokens=20))
            await _until(lambda: s.router.gate.waiting == 1)
            b.cancel()  # its connection closes
            await _until(lambda: s.router.gate.waiting == 0)
            assert s.router.in_flight == 1 and len(s.prefills[0].requests) == 1
            a.cancel()
            await _until(lambda: s.router.in_flight == 0)
            assert s.router.gate.reserved == [0] and len(s.decodes[0].aborted) == 1
            m = await (await s.client.get("/metrics")).text()
            assert metric(m, 'kvpool:requests_total{outcome="cancelled"}') == 2

    asyncio.run(body())
