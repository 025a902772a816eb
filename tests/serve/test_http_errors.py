"""Malformed HTTP against the router on a real socket (127.0.0.1): every answer aiohttp gives
before any route (a request line, a header or framing it cannot parse, no such path) is a 4xx
with the router's error object, never aiohttp's plain text, and the router goes on serving. The
engines' own servers are checked the same way in test_decode_engine and test_prefill_engine."""

from __future__ import annotations

import asyncio

import pytest
from raw_http import MALFORMED, check_errors, exchange
from router_testing import routed

pytestmark = pytest.mark.timeout(60)


def test_malformed_http_gets_the_routers_error_object_and_the_router_serves_on():
    async def body():
        async with routed() as s:
            url = str(s.client.make_url("/"))
            for what, data in MALFORMED.items():
                errors = check_errors(await exchange(url, data))
                for status, err in errors:
                    assert 400 <= status < 500, (what, status, err)
                    assert isinstance(err, dict) and err["code"] == status, (what, err)
                    assert err["type"] in ("invalid_request_error", "not_found") and err["message"], (what, err)
                    assert "\n" not in err["message"] and len(err["message"]) <= 300, (what, err)
            status, r = await s.complete(prompt="hello", max_tokens=2)
            assert status == 200, r
    asyncio.run(body())
