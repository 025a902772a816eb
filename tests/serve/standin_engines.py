"""Stand-in engines for the router and supervisor tests: they speak ``backend/serve/protocol.py``
exactly (every message parsed with its strict ``from_json``) and compute nothing.

    decode engine    POST /expect, /generate (NDJSON ``TokenEvent`` lines), /abort; GET /health, /metrics
    prefill engine   POST /prefill -> ``PrefillResult``; GET /health, /metrics
    prefill stage    a TCP listener on 127.0.0.1 (its ready file's ``endpoint``), nothing else

Tokens: the first token is ``next_token(prompt[-1])``, each later one ``next_token`` of the one
before, so ``expected_tokens(prompt, n)`` is what a request must return. The prefill engine counts
a prompt's whole 16-token pages that an earlier prompt began with as GPU tokens, the rest computed.

Behaviour knobs (``Behaviour``; for processes: the JSON in ``STANDIN_BEHAVIOUR``, by worker name
or ``"*"``): ``token_delay_s`` between decode lines, ``prefill_delay_s``, ``prefill_error`` (an
HTTP ``prefill_status``, default 500, with that reason), ``eos_after`` (decode emits ``EOS_TOKEN`` after that many tokens),
``error_after`` (decode's stream ends with an error event after that many tokens),
``ignore_sigterm``, ``start_delay_s`` (before listening), ``exit_at_start`` (exit with that status before listening).

Run as a process: ``python standin_engines.py --plan PLAN --name NAME`` (the argv shape of
``plan.Worker.argv``); it writes its ready file once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from kvpool.backend.serve.plan import ServePlan, write_ready
from kvpool.backend.serve.tokens import EOS_TOKEN
from kvpool.backend.serve.protocol import (
    AbortRequest,
    ExpectRequest,
    GenerateRequest,
    Health,
    PrefillRequest,
    PrefillResult,
    ProtocolError,
    TokenEvent,
)

PAGE_TOKENS = 16


def next_token(t: int) -> int:
    return (t * 17 + 11) % 256


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    out = [next_token(prompt[-1])]
    while len(out) < n:
        out.append(next_token(out[-1]))
    return out


@dataclass
class Behaviour:
    token_delay_s: float = 0.0
    prefill_delay_s: float = 0.0
    prefill_error: str = ""
    eos_after: int = 0
    ignore_sigterm: bool = False
    exit_at_start: int = -1
    error_after: int = 0
    start_delay_s: float = 0.0
    prefill_status: int = 500


async def _metrics(_request: web.Request) -> web.Response:
    return web.Response(text="# a stand-in engine\n")


def _bad(e: Exception) -> web.Response:
    return web.json_response({"error": str(e)}, status=400)


@dataclass
class DecodeStandIn:
    instance: int
    behaviour: Behaviour = field(default_factory=Behaviour)
    expected: dict = field(default_factory=dict)  # request id -> ExpectRequest
    aborted: list = field(default_factory=list)
    generated: list = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/expect", self.expect)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort", self.abort)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", _metrics)
        return app

    async def expect(self, request: web.Request) -> web.Response:
        try:
            req = ExpectRequest.from_json(await request.json())
        except ProtocolError as e:
            return _bad(e)
        self.expected[req.request_id] = req
        return web.json_response({"request_id": req.request_id})

    async def abort(self, request: web.Request) -> web.Response:
        try:
            req = AbortRequest.from_json(await request.json())
        except ProtocolError as e:
            return _bad(e)
        self.expected.pop(req.request_id, None)
        self.aborted.append(req.request_id)
        return web.json_response({"request_id": req.request_id})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            req = GenerateRequest.from_json(await request.json())
        except ProtocolError as e:
            return _bad(e)
        if req.request_id not in self.expected:
            return web.json_response({"error": f"{req.request_id}: not expected"}, status=404)
        if req.descriptor.get("decode_instance") != self.instance:
            return web.json_response({"error": f"descriptor for decode {req.descriptor!r}"}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        t, sent, b = req.first_token, 1, self.behaviour
        reason = "length"
        try:
            while sent < req.max_tokens:
                await asyncio.sleep(b.token_delay_s)
                if req.request_id not in self.expected:
                    return resp  # aborted
                t = EOS_TOKEN if b.eos_after and sent >= b.eos_after and not req.ignore_eos else next_token(t)
                sent += 1
                if b.error_after and sent > b.error_after:
                    await resp.write((json.dumps(TokenEvent(done=True, error="rank 1 lost its hand-off").to_json()) + "\n").encode())
                    return resp
                await resp.write((json.dumps(TokenEvent(tokens=(t,)).to_json()) + "\n").encode())
                if t == EOS_TOKEN and not req.ignore_eos:
                    reason = "stop"
                    break
            last = TokenEvent(done=True, finish_reason=reason, record={"decode": self.instance, "handoff_s": 0.001})
            await resp.write((json.dumps(last.to_json()) + "\n").encode())
            await resp.write_eof()
        finally:
            self.expected.pop(req.request_id, None)
            self.generated.append(req.request_id)
        return resp

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response(Health("ok", "decode_engine", self.instance).to_json())


@dataclass
class PrefillStandIn:
    instance: int
    stages: int = 2
    behaviour: Behaviour = field(default_factory=Behaviour)
    seen: set = field(default_factory=set)  # page-aligned prefixes of earlier prompts
    requests: list = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/prefill", self.prefill)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", _metrics)
        return app

    async def prefill(self, request: web.Request) -> web.Response:
        try:
            req = PrefillRequest.from_json(await request.json())
        except ProtocolError as e:
            return _bad(e)
        self.requests.append(req)
        b = self.behaviour
        await asyncio.sleep(b.prefill_delay_s)
        if b.prefill_error:
            return web.json_response({"error": b.prefill_error}, status=b.prefill_status)
        ids = req.token_ids
        n = len(ids)
        gpu = 0
        for end in range(PAGE_TOKENS, n, PAGE_TOKENS):  # the last token is always computed
            if ids[:end] in self.seen:
                gpu = end
        for end in range(PAGE_TOKENS, n + 1, PAGE_TOKENS):
            self.seen.add(ids[:end])
        record = {"gpu_tokens": gpu, "pool_tokens": 0, "computed_tokens": n - gpu, "prefill_start_s": 0.0,
                  "prefill_end_s": b.prefill_delay_s, "handoff_bytes": 1152 * n, "key": "not-the-router's"}
        return web.json_response(PrefillResult(req.request_id, next_token(ids[-1]), record,
                                               {"decode_instance": req.decode_instance, "stages": self.stages}).to_json())

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response(Health("ok", "prefill_engine", self.instance).to_json())


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def _main(plan_path: str, name: str) -> None:
    plan = ServePlan.read(plan_path)
    w = plan.worker(name)
    knobs = json.loads(os.environ.get("STANDIN_BEHAVIOUR", "{}"))
    b = Behaviour(**{**knobs.get("*", {}), **knobs.get(name, {})})
    if b.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if b.exit_at_start >= 0:
        print(f"{name}: exiting with status {b.exit_at_start} as told", flush=True)
        raise SystemExit(b.exit_at_start)
    await asyncio.sleep(b.start_delay_s)
    ready = plan.ready_path(name)
    if w.role == "prefill_stage":
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        write_ready(ready, {"endpoint": f"tcp://127.0.0.1:{sock.getsockname()[1]}"})
    elif w.role == "decode_engine":
        _, url = await serve_app(DecodeStandIn(w.instance, b).app())
        write_ready(ready, {"url": url, "rank_endpoints": []})
    else:
        _, url = await serve_app(PrefillStandIn(w.instance, len(plan.stages_of(w.instance)), b).app())
        write_ready(ready, {"url": url})
    print(f"{name}: serving", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--name", required=True)
    a = ap.parse_args()
    asyncio.run(_main(a.plan, a.name))
