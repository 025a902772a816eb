"""Requests found by a campaign of bad and odd inputs against a running server. Bad bodies and
paths: each is a 4xx answer with an OpenAI error object (JSON) naming the problem, never a 500, and
the router goes on serving. An odd but valid one: a one-token prompt as the first request after a
start is answered, not failed after the hand-off timeout."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest
from router_testing import MODEL, routed

from kvpool.backend.serve import router as router_module

pytestmark = pytest.mark.timeout(60)


async def _post_raw(s, data: bytes, headers: dict | None = None):
    r = await s.client.post("/v1/completions", data=data, headers={"Content-Type": "application/json", **(headers or {})})
    return r.status, await r.text()


def _error(text: str) -> dict:
    err = json.loads(text)["error"]
    assert isinstance(err["message"], str) and err["message"]
    return err


async def _still_serves(s) -> None:
    status, r = await s.complete(prompt="hello", max_tokens=2)
    assert status == 200, r


@pytest.mark.parametrize("data", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000])
def test_json_nested_beyond_the_parsers_depth_is_a_400(data):
    async def body():
        async with routed() as s:
            status, text = await _post_raw(s, data)
            assert status == 400 and "not JSON" in _error(text)["message"]
            await _still_serves(s)
    asyncio.run(body())


def test_a_prompt_with_a_lone_surrogate_is_a_400_naming_prompt():
    async def body():
        async with routed() as s:
            data = ('{"model": "%s", "prompt": "ab\\ud800", "max_tokens": 2}' % MODEL).encode()
            status, text = await _post_raw(s, data)
            err = _error(text)
            assert status == 400 and err["param"] == "prompt" and "position 2" in err["message"]
            await _still_serves(s)
    asyncio.run(body())


def test_a_body_that_is_not_what_its_content_encoding_says_is_a_400():
    async def body():
        async with routed() as s:
            good = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
            status, text = await _post_raw(s, good, {"Content-Encoding": "gzip"})
            assert status == 400 and "Content-Encoding" in _error(text)["message"]
            status, text = await _post_raw(s, gzip.compress(good), {"Content-Encoding": "gzip"})
            assert status == 200, text
            await _still_serves(s)
    asyncio.run(body())


def test_a_body_over_the_limit_is_a_413_with_an_error_object():
    async def body():
        async with routed() as s:
            limit = s.router.app._client_max_size  # the limit the router gave aiohttp
            data = b'{"model": "%s", "prompt": "%s", "max_tokens": 1}' % (MODEL.encode(), b"a" * limit)
            status, text = await _post_raw(s, data)
            err = _error(text)
            assert status == 413 and str(limit) in err["message"]
            await _still_serves(s)
    asyncio.run(body())


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/", 404), ("GET", "/v1/chat/completions", 404), ("POST", "/v1/chat/completions", 404),
    ("GET", "/v1/completions", 405), ("DELETE", "/v1/completions", 405), ("POST", "/health", 405),
])
def test_unknown_paths_and_methods_answer_an_error_object(method, path, status):
    async def body():
        async with routed() as s:
            r = await s.client.request(method, path)
            err = _error(await r.text())
            assert r.status == status and err["code"] == status and path in err["message"]
            assert "/v1/completions" in err["message"]
    asyncio.run(body())


def test_a_body_that_stops_arriving_is_answered_408_after_the_body_timeout(monkeypatch):
    monkeypatch.setattr(router_module, "BODY_TIMEOUT_S", 0.5)

    async def body():
        async with routed() as s:
            reader, writer = await asyncio.open_connection(s.client.host, s.client.port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\":")
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
            rest = await asyncio.wait_for(reader.readexactly(length), 10)
            writer.close()
            assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head
            assert "0.5 s" in _error(rest.decode())["message"]
            await _still_serves(s)
    asyncio.run(body())


def test_a_decode_rank_without_tokens_of_the_first_request_still_asks_the_late_stage_for_it():
    """A one-token prompt under DCP 2 gives rank 1 nothing to receive, so its part of the request is
    complete at once; a stage that attaches only afterwards (the first request after a start) must
    still get the rank's WANT, or the stage waits out its whole hand-off timeout."""
    import time

    import torch
    import zmq

    from kvpool.backend.handoff import DecodeRank, StagePart, make_transport
    from kvpool.backend.handoff import messages as m
    from kvpool.policy.layout import HandoffPlan

    caches = [torch.zeros(4, 16, 1152, dtype=torch.uint8) for _ in range(2)]
    rank = DecodeRank(1, caches, make_transport("local"), stages=1, slots=2, slot_bytes=1 << 20)
    stage = zmq.Context.instance().socket(zmq.DEALER)
    try:
        plan = HandoffPlan(tokens=1, layers=2, record_bytes=1152, ranks=2)
        assert plan.writes(1) == []  # token 0 lives on rank 0
        nonce = rank.expect("r1", torch.tensor([0]), {0: StagePart(plan, 0)})
        stage.connect(rank.endpoint)
        stage.send(m.encode(m.Attach(0, "stage0")))
        got, deadline = [], time.monotonic() + 5
        while time.monotonic() < deadline and not any(isinstance(x, m.Want) for x in got):
            rank.poll(0.01)
            while stage.poll(0):
                got.append(m.decode(stage.recv()))
        assert m.Want("r1", nonce, 1) in got, got
    finally:
        stage.close(linger=0)
        rank.close()
