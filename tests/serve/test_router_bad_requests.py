"""Bad completion requests get a 4xx with an OpenAI error object naming the field, and reach no engine."""

from __future__ import annotations

import asyncio

import pytest
from router_testing import MODEL, metric, routed

pytestmark = pytest.mark.timeout(60)

# cpu-tiny: serve.vocab 512, gate.max_input_tokens 16384, gate.max_output_tokens 1024
CASES = [
    ({"prompt": [1], "max_tokens": 1, "temperature": 0.5}, 400, "temperature", "unknown field(s): temperature"),
    ({"prompt": [1, "a"], "max_tokens": 1}, 400, "prompt", "prompt[1]"),
    ({"prompt": [1, 2.5], "max_tokens": 1}, 400, "prompt", "prompt[1]"),
    ({"prompt": [True], "max_tokens": 1}, 400, "prompt", "prompt[0]"),
    ({"prompt": [512], "max_tokens": 1}, 400, "prompt", "[0, 511]"),
    ({"prompt": [-1], "max_tokens": 1}, 400, "prompt", "prompt[0]"),
    ({"prompt": [], "max_tokens": 1}, 400, "prompt", "non-empty"),
    ({"prompt": "", "max_tokens": 1}, 400, "prompt", "non-empty"),
    ({"prompt": ["a", "b"], "max_tokens": 1}, 400, "prompt", "one prompt per request"),
    ({"prompt": [[1, 2]], "max_tokens": 1}, 400, "prompt", "one prompt per request"),
    ({"prompt": [1], "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ({"prompt": [1]}, 400, "max_tokens", "required"),
    ({"prompt": [1], "max_tokens": "5"}, 400, "max_tokens", ">= 1"),
    ({"prompt": [1], "max_tokens": 1025}, 400, "max_tokens", "reject_output_too_long"),
    ({"prompt": [1], "max_tokens": 10**12}, 400, "max_tokens", "reject_output_too_long"),
    ({"prompt": [1] * 16385, "max_tokens": 1}, 400, "prompt", "reject_input_too_long"),
    ({"prompt": [1], "max_tokens": 1, "stop": ["\n"]}, 400, "stop", "not supported"),
    ({"prompt": [1], "max_tokens": 1, "stream": "yes"}, 400, "stream", "true or false"),
    ({"prompt": [1], "max_tokens": 1, "ignore_eos": 1}, 400, "ignore_eos", "true or false"),
    ({"prompt": [1], "max_tokens": 1, "user": 7}, 400, "user", "string"),
    ({"prompt": [1], "max_tokens": 1, "model": "gpt-4"}, 404, "model", "not served here"),
    ({"prompt": [1], "max_tokens": 1, "model": None}, 400, "model", "required"),
]


@pytest.mark.parametrize("body,status,param,words", CASES, ids=[c[3] for c in CASES])
def test_bad_request(body, status, param, words):
    async def run():
        async with routed() as s:
            body.setdefault("model", MODEL)
            r = await s.client.post("/v1/completions", json=body)
            assert r.status == status
            err = (await r.json())["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["param"] == param and words in err["message"] and err["code"] == status
            assert s.prefills[0].requests == [] and s.decodes[0].expected == {}
            assert s.router.gate.reserved == [0] and s.router.in_flight == 0

    asyncio.run(run())


def test_not_json_and_not_an_object():
    async def run():
        async with routed() as s:
            r = await s.client.post("/v1/completions", data=b"{nope", headers={"Content-Type": "application/json"})
            assert r.status == 400 and "not JSON" in (await r.json())["error"]["message"]
            r = await s.client.post("/v1/completions", json=[1, 2])
            assert r.status == 400 and "JSON object" in (await r.json())["error"]["message"]
            m = await (await s.client.get("/metrics")).text()
            assert metric(m, 'kvpool:requests_total{outcome="bad_request"}') == 2
            # the router still serves
            status, r = await s.complete(prompt=[1], max_tokens=2)
            assert status == 200

    asyncio.run(run())


def test_rejections_are_counted_by_verdict():
    async def run():
        async with routed() as s:
            await s.complete(prompt=[1], max_tokens=5000)
            await s.complete(prompt=[1], max_tokens=5000)
            m = await (await s.client.get("/metrics")).text()
            assert metric(m, 'kvpool:gate_rejected_total{reason="reject_output_too_long"}') == 2
            assert metric(m, 'kvpool:requests_total{outcome="rejected"}') == 2

    asyncio.run(run())
