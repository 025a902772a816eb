"""The router's /v1/completions against stand-in engines: answers, streams, records, routing."""

from __future__ import annotations

import asyncio

import pytest
from router_testing import MODEL, TWO_PREFILLS, metric, routed
from standin_engines import EOS_TOKEN, Behaviour, expected_tokens

from kvpool.backend.serve import tokens as tok

pytestmark = pytest.mark.timeout(60)


def test_token_ids_prompt_answers_the_engines_tokens_with_usage_and_record():
    async def body():
        async with routed() as s:
            prompt = list(range(1, 41))
            status, r = await s.complete(prompt=prompt, max_tokens=5)
            assert status == 200, r
            want = expected_tokens(prompt, 5)
            choice = r["choices"][0]
            assert choice["token_ids"] == want
            assert choice["text"] == tok.decode(want)
            assert choice["finish_reason"] == "length"
            assert r["model"] == MODEL and r["object"] == "text_completion"
            assert r["usage"] == {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45,
                                  "prompt_tokens_details": {"cached_tokens": 0}}
            rec = r["kvpool"]["record"]
            assert rec["key"] == r["id"]
            assert (rec["prefill"], rec["decode"], rec["in_tokens"], rec["out_tokens"]) == (0, 0, 40, 5)
            assert rec["computed_tokens"] == 40 and rec["gpu_tokens"] == 0
            assert rec["handoff_bytes"] == 1152 * 40  # from prefill's record
            assert rec["handoff_s"] == 0.001  # from decode's last event
            assert 0 <= rec["arrival_s"] <= rec["prefill_start_s"] <= rec["first_token_s"] <= rec["end_s"]
            assert rec["ttft_s"] == pytest.approx(rec["first_token_s"] - rec["arrival_s"])
            # the prefill engine got the prompt and the decode instance the gate chose
            req = s.prefills[0].requests[0]
            assert list(req.token_ids) == prompt and req.decode_instance == 0 and req.request_id == r["id"]
            # a second request with the same prompt: its two whole leading pages are GPU tokens
            status, r2 = await s.complete(prompt=prompt, max_tokens=2)
            assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
            assert r2["kvpool"]["record"]["gpu_tokens"] == 32 and r2["id"] != r["id"]
            assert s.router.gate.reserved == [0]
            m = (await (await s.client.get("/metrics")).text())
            assert metric(m, 'kvpool:prompt_tokens_by_source_total{source="gpu"}') == 32
            assert metric(m, 'kvpool:prompt_tokens_by_source_total{source="computed"}') == 48
            assert metric(m, "kvpool:prompt_tokens_total") == 80
            assert metric(m, 'kvpool:requests_total{outcome="ok"}') == 2
            assert metric(m, "kvpool:gate_admitted_total") == 2
            assert metric(m, "kvpool:time_to_first_token_seconds_count") == 2
            assert metric(m, "kvpool:inter_token_latency_seconds_count") == 4 + 1

    asyncio.run(body())


def test_text_prompt_is_utf8_bytes_and_text_leaves_out_eos():
    async def body():
        async with routed(decode=Behaviour(eos_after=3)) as s:
            status, r = await s.complete(prompt="héllo", max_tokens=8)
            assert status == 200, r
            ids = list("héllo".encode())
            assert list(s.prefills[0].requests[0].token_ids) == ids
            got = r["choices"][0]["token_ids"]
            assert got == expected_tokens(ids, 3) + [EOS_TOKEN]
            assert r["choices"][0]["finish_reason"] == "stop"
            assert r["choices"][0]["text"] == tok.decode(got[:3])
            # ignore_eos: the output has max_tokens tokens
            status, r = await s.complete(prompt="héllo", max_tokens=8, ignore_eos=True)
            assert len(r["choices"][0]["token_ids"]) == 8 and r["choices"][0]["finish_reason"] == "length"

    asyncio.run(body())


def test_max_tokens_one_is_the_prefill_token_and_decode_frees_its_pages():
    async def body():
        async with routed() as s:
            status, r = await s.complete(prompt=[7, 8, 9], max_tokens=1)
            assert status == 200, r
            assert r["choices"][0]["token_ids"] == expected_tokens([7, 8, 9], 1)
            assert s.decodes[0].aborted == [r["id"]] and s.decodes[0].expected == {}

    asyncio.run(body())


def test_stream_sends_the_first_token_before_the_rest_then_usage_then_done():
    async def body():
        async with routed(decode=Behaviour(token_delay_s=0.15)) as s:
            prompt = [65, 66, 67]
            status, events, times = await s.stream(prompt=prompt, max_tokens=4)
            assert status == 200
            want = expected_tokens(prompt, 4)
            assert events[-1] == "[DONE]"
            chunks, final = events[:-2], events[-2]
            assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
            assert chunks[0]["choices"][0]["token_ids"] == want[:1]  # the prefill's token, alone
            assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want
            assert "".join(c["choices"][0]["text"] for c in chunks) == tok.decode(want)
            assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
            # the first chunk came before decode's three delayed tokens: the client measures its TTFT
            assert times[-1] - times[0] >= 0.4
            assert final["choices"] == [] and final["usage"]["completion_tokens"] == 4
            assert final["kvpool"]["record"]["out_tokens"] == 4

    asyncio.run(body())


def test_stream_splits_no_utf8_character():
    async def body():
        async with routed() as s:
            status, events, _ = await s.stream(prompt=[1], max_tokens=30, ignore_eos=True)
            chunks = events[:-2]
            ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
            assert "".join(c["choices"][0]["text"] for c in chunks) == tok.decode(ids)

    asyncio.run(body())


def test_engine_failure_is_a_502_naming_the_engine_and_frees_everything():
    async def body():
        async with routed(prefill=Behaviour(prefill_error="out of pages")) as s:
            status, r = await s.complete(prompt=[1, 2, 3], max_tokens=4)
            assert status == 502
            assert r["error"]["type"] == "engine_error"
            assert "prefill0" in r["error"]["message"] and "out of pages" in r["error"]["message"]
            assert s.decodes[0].aborted and s.decodes[0].expected == {}
            assert s.router.gate.reserved == [0] and s.router.in_flight == 0
            m = await (await s.client.get("/metrics")).text()
            assert metric(m, 'kvpool:requests_total{outcome="error"}') == 1

    asyncio.run(body())


def test_a_slow_engine_is_a_504_after_the_request_timeout():
    async def body():
        async with routed(["serve.request_timeout_s=0.3"], prefill=Behaviour(prefill_delay_s=5.0)) as s:
            t0 = asyncio.get_running_loop().time()
            status, r = await s.complete(prompt=[1, 2, 3], max_tokens=4)
            waited = asyncio.get_running_loop().time() - t0
            assert status == 504 and r["error"]["type"] == "timeout"
            assert "prefill0" in r["error"]["message"] and "request_timeout_s" in r["error"]["message"]
            assert 0.3 <= waited < 3.0
            assert s.decodes[0].aborted and s.router.gate.reserved == [0]

    asyncio.run(body())


def test_decode_gone_is_a_502_naming_decode():
    async def body():
        async with routed() as s:
            await s.runners[0].cleanup()  # decode0 stops listening
            status, r = await s.complete(prompt=[1, 2, 3], max_tokens=4)
            assert status == 502 and "decode0" in r["error"]["message"] and "/expect" in r["error"]["message"]
            assert s.router.gate.reserved == [0]
            h = await s.client.get("/health")
            assert h.status == 503
            assert (await h.json())["engines"]["prefill0"] == "ok"

    asyncio.run(body())


def test_models_and_health():
    async def body():
        async with routed() as s:
            r = await s.client.get("/v1/models")
            assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
            h = await s.client.get("/health")
            assert h.status == 200 and (await h.json())["engines"] == {"decode0": "ok", "prefill0": "ok"}

    asyncio.run(body())


def test_session_affinity_keeps_a_session_on_one_prefill():
    async def body():
        async with routed([*TWO_PREFILLS, "routing.prefill=session_affinity"]) as s:
            homes = {}
            for turn in range(3):
                for user in ("a", "b", "c", "d"):
                    status, r = await s.complete(prompt=[turn + 1], max_tokens=1, user=user)
                    homes.setdefault(user, set()).add(r["kvpool"]["record"]["prefill"])
                    assert r["kvpool"]["record"]["session"] == user
            assert all(len(h) == 1 for h in homes.values())
            # kvpool_session wins over user
            status, r = await s.complete(prompt=[5], max_tokens=1, user="a", kvpool_session="zz")
            assert r["kvpool"]["record"]["session"] == "zz"

    asyncio.run(body())


def test_the_session_header_names_the_session_unless_the_body_does():
    async def body():
        async with routed() as s:
            async def post(session: str, **fields) -> tuple[int, dict]:
                r = await s.client.post("/v1/completions", headers={"x-kvpool-session": session},
                                        json={"model": MODEL, "prompt": [5], "max_tokens": 1, **fields})
                return r.status, await r.json()

            status, r = await post("h1")
            assert status == 200 and r["kvpool"]["record"]["session"] == "h1"
            status, r = await post("h1", user="u1")
            assert status == 200 and r["kvpool"]["record"]["session"] == "u1"
            status, r = await post("h" * 257)
            assert status == 400 and r["error"]["param"] == "x-kvpool-session"

    asyncio.run(body())


def test_power_of_two_spreads_concurrent_requests_over_prefills():
    async def body():
        async with routed(TWO_PREFILLS, prefill=Behaviour(prefill_delay_s=0.2)) as s:
            results = await asyncio.gather(*(s.complete(prompt=[1] * 50, max_tokens=1) for _ in range(6)))
            used = {r["kvpool"]["record"]["prefill"] for _, r in results}
            assert used == {0, 1}  # the less loaded of two: the second goes where the first is not
            assert [len(p.requests) for p in s.prefills] == [3, 3]

    asyncio.run(body())


def test_a_decode_error_mid_stream_ends_the_stream_with_an_error_chunk():
    async def body():
        async with routed(decode=Behaviour(error_after=3)) as s:
            status, events, _ = await s.stream(prompt=[1, 2], max_tokens=10)
            assert status == 200  # the stream had begun
            assert "[DONE]" not in events
            assert [len(e["choices"][0]["token_ids"]) for e in events[:-1]] == [1, 1, 1]
            err = events[-1]["error"]
            assert err["type"] == "engine_error" and err["message"] == "decode0: POST /generate: rank 1 lost its hand-off"
            status, r = await s.complete(prompt=[1, 2], max_tokens=10)
            assert status == 502 and "rank 1 lost its hand-off" in r["error"]["message"]
            assert len(s.decodes[0].aborted) == 2 and s.router.gate.reserved == [0]

    asyncio.run(body())


@pytest.mark.parametrize("engine_status,status", [(413, 413), (503, 503), (504, 504), (409, 502), (400, 502)])
def test_an_engines_413_503_504_keep_their_status_others_are_502(engine_status, status):
    async def body():
        async with routed(prefill=Behaviour(prefill_error="why", prefill_status=engine_status)) as s:
            got, r = await s.complete(prompt=[1, 2, 3], max_tokens=4)
            assert got == status
            assert r["error"]["message"] == f"prefill0: POST /prefill answered HTTP {engine_status}: why"
            assert r["error"]["type"] == ("timeout" if status == 504 else "engine_error")
            assert s.router.gate.reserved == [0] and s.decodes[0].aborted

    asyncio.run(body())
