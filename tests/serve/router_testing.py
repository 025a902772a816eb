"""The router in this process in front of in-process stand-in engines (``standin_engines``), on loopback."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp.test_utils import TestClient, TestServer
from standin_engines import Behaviour, DecodeStandIn, PrefillStandIn, serve_app

from kvpool.backend.serve.router import RUNNER_OPTIONS, Engines, Router, serve_runner
from kvpool.scenario import load_scenario

MODEL = "refmodel-tiny"  # model.name of cpu-tiny
#: cpu-tiny with two prefill instances (for routing tests)
TWO_PREFILLS = ["prefill.instances=2", "cluster.gpus_per_server=6", "cluster.numa_per_server=3"]


class RouterTestServer(TestServer):
    """aiohttp's test server on the runner ``kvpool serve`` uses (``router.serve_runner``)."""

    async def _make_runner(self, **kwargs):
        return serve_runner(self.app, **kwargs)


@dataclass
class Setup:
    client: TestClient
    router: Router
    decodes: list[DecodeStandIn]
    prefills: list[PrefillStandIn]
    runners: list

    async def complete(self, **body) -> tuple[int, dict]:
        body.setdefault("model", MODEL)
        r = await self.client.post("/v1/completions", json=body)
        return r.status, await r.json()

    async def stream(self, **body) -> tuple[int, list, list[float]]:
        """Status, the SSE ``data:`` payloads (JSON, or the string ``[DONE]``), the time each arrived."""
        body.setdefault("model", MODEL)
        body["stream"] = True
        loop = asyncio.get_running_loop()
        r = await self.client.post("/v1/completions", json=body)
        if r.status != 200:
            return r.status, [await r.json()], [loop.time()]
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events, times = [], []
        async for raw in r.content:
            line = raw.decode().rstrip("\n")
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            times.append(loop.time())
        return r.status, events, times


@asynccontextmanager
async def routed(overrides: list[str] | None = None, decode: Behaviour | None = None, prefill: Behaviour | None = None):
    """Stand-in engines for cpu-tiny (with ``overrides``) and a router in front of them."""
    s = load_scenario("cpu-tiny", overrides or [])
    decodes = [DecodeStandIn(j, decode or Behaviour()) for j in range(s.decode.instances)]
    prefills = [PrefillStandIn(i, s.prefill.pp, prefill or Behaviour()) for i in range(s.prefill.instances)]
    runners, durls, purls = [], [], []
    for d in decodes:
        runner, url = await serve_app(d.app())
        runners.append(runner)
        durls.append((f"decode{d.instance}", url))
    for p in prefills:
        runner, url = await serve_app(p.app())
        runners.append(runner)
        purls.append((f"prefill{p.instance}", url))
    router = Router(s, Engines(prefill=tuple(purls), decode=tuple(durls)))
    client = TestClient(RouterTestServer(router.app, host="127.0.0.1", **RUNNER_OPTIONS))
    await client.start_server()
    try:
        yield Setup(client, router, decodes, prefills, runners)
    finally:
        await client.close()
        for runner in runners:
            await runner.cleanup()


def metric(text: str, name: str) -> float:
    """The value of one sample line ``name`` (with its labels) of a Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no sample {name} in the metrics")
