"""A small OpenAI-compatible stand-in for the router, for the replay client's tests.

``StandIn`` answers ``POST /v1/completions`` (token-id prompts, ``stream: true``) with
the ``max_tokens`` tokens as server-sent events (``tokens_per_event`` a
event) after ``delay_s``, then a final event carrying ``usage`` and a
``kvpool`` record, then ``data: [DONE]``. Its record's token sources come from a prefix cache of
whole ``page_tokens`` pages keyed by the prompt's token prefix (``gpu_tokens`` the cached
prefix, ``computed_tokens`` the rest), so equal token prefixes show up as GPU hits. ``fault(n)``
picks what the n-th request (from 0) gets: ``None`` (a normal answer), ``"http500"``, ``"break"``
(the connection closes mid-stream), ``"nodone"`` (the stream ends cleanly without
``[DONE]``), ``"event_error"`` (an event with ``error``), ``"hang"`` (no answer for ``hang_s``) or ``"reject"`` (a
429 whose record has ``rejected`` set). Every request body and its headers are kept in
``requests``. ``serving(standin)`` runs it on 127.0.0.1, port 0, in a thread of its own and
yields its URL.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from aiohttp import web

EOS = 256


class StandIn:
    def __init__(self, *, delay_s: float = 0.01, vocab: int = 512, page_tokens: int = 16,
                 fault: Callable[[int], str | None] = lambda n: None, hang_s: float = 30.0,
                 tokens_per_event: int = 64):
        self.delay_s, self.vocab, self.page_tokens, self.fault, self.hang_s = delay_s, vocab, page_tokens, fault, hang_s
        self.tokens_per_event = tokens_per_event
        self.requests: list[tuple[dict, dict]] = []
        self.pages: set[bytes] = set()
        self.problems: list[str] = []  # malformed requests (a test asserts there are none)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "standin", "object": "model"}]})

    def _cached_tokens(self, prompt: list[int]) -> int:
        h = hashlib.sha256()
        hit, keys = 0, []
        full = len(prompt) // self.page_tokens
        for p in range(full):
            h.update(json.dumps(prompt[p * self.page_tokens:(p + 1) * self.page_tokens]).encode())
            keys.append(h.copy().digest())
        for k in keys:
            if k not in self.pages:
                break
            hit += self.page_tokens
        self.pages.update(keys)
        return hit

    def _check(self, body: dict) -> str | None:
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            return "prompt: expected a non-empty list of token ids"
        if any(not isinstance(t, int) or not 0 <= t < self.vocab or t == EOS for t in prompt):
            return "prompt: a token id out of range or the EOS id"
        if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
            return "max_tokens: expected an integer >= 1"
        if body.get("ignore_eos") is not True or body.get("stream") is not True:
            return "ignore_eos and stream must be true"
        return None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._completions(request)
        except ConnectionResetError:  # the client gave up (a test's timeout)
            return web.Response(status=499)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(self.requests)
        self.requests.append((body, {k.lower(): v for k, v in request.headers.items()}))
        problem = self._check(body)
        if problem:
            self.problems.append(problem)
            return web.json_response({"error": problem}, status=400)
        fault = self.fault(n)
        if fault == "http500":
            return web.json_response({"error": "decode instance 0 died (exit status -9)"}, status=500)
        if fault == "reject":
            return web.json_response({"error": "gate: prompt over the input cap",
                                      "kvpool": {"record": {"rejected": "input cap"}}}, status=429)
        if fault == "hang":
            await asyncio.sleep(self.hang_s)
        prompt = body["prompt"]
        await asyncio.sleep(self.delay_s)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        out = body["max_tokens"]
        for i in range(0, out, self.tokens_per_event):
            text = "a" * min(self.tokens_per_event, out - i)
            chunk = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if fault == "break":
                request.transport.close()
                return resp
            if fault in ("nodone", "event_error"):
                if fault == "event_error":
                    await resp.write(b'data: {"error": "decode rank 1 lost its hand-off"}\n\n')
                await resp.write_eof()
                return resp
        cached = self._cached_tokens(prompt)
        record = {"key": request.headers.get("x-request-id", ""), "arrival_s": 100.0, "prefill": 0, "decode": 0,
                  "gpu_tokens": cached, "pool_tokens": 0, "computed_tokens": len(prompt) - cached,
                  "prefill_start_s": 100.5, "prefill_end_s": 101.0, "restore_stage_s": [], "save_bytes": 1152 * len(prompt),
                  "handoff_bytes": 4608 * len(prompt), "handoff_writes": 3, "handoff_s": 0.001, "in_tokens": "ignored"}
        final = {"object": "text_completion", "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": out + 1 if fault == "bad_usage" else out,
                           "total_tokens": len(prompt) + out},
                 "kvpool": {"record": record}}
        await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@contextmanager
def serving(standin: StandIn) -> Iterator[str]:
    """Run ``standin`` on 127.0.0.1 (port 0) in a thread of its own; yields ``http://127.0.0.1:PORT``."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    async def up() -> None:
        runner = web.AppRunner(standin.app(), handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        holder["runner"] = runner
        holder["port"] = runner.addresses[0][1]

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(up())
        started.set()
        loop.run_forever()
        loop.run_until_complete(holder["runner"].cleanup())
        pending = asyncio.all_tasks(loop)
        for t in pending:
            t.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("the stand-in server did not start within 10 s")
    try:
        yield f"http://127.0.0.1:{holder['port']}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
