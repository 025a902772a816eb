"""A small OpenAI-compatible completions server that speaks the router's client protocol, for client tests.

It serves what ``kvpool serve``'s router serves to clients, with a stand-in model instead of the
engines: ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``.

Requests (the fields a client such as AIPerf sends; any other field is a 400 naming it, as the
router answers): ``model`` (string), ``prompt`` (text, read as UTF-8 bytes = token ids 0-255, or a
list of token ids), ``max_tokens`` (1..``MAX_OUTPUT_TOKENS``, default ``DEFAULT_MAX_TOKENS``),
``stream`` (bool), ``stream_options`` (``{"include_usage": bool}``), ``ignore_eos`` (bool).

The model: ``standin_tokens(prompt_ids, n)``, a deterministic function of the whole prompt (token
ids of lowercase letters from a SHA-256 chain), so a client's answers can be checked. It emits no
EOS, so every answer has ``max_tokens`` tokens and ``finish_reason`` ``"length"``.

Answers: ``stream=false``: one ``text_completion`` object with ``usage``. ``stream=true``:
server-sent events, one ``text_completion`` chunk per token (``TOKEN_INTERVAL_S`` apart, so a
client measures a first-token time and inter-token gaps), the last with ``finish_reason``, then a
``usage`` chunk (no choices) when ``stream_options.include_usage``, then ``data: [DONE]``.

``StandinServer`` runs it on 127.0.0.1, port 0, on a thread of the test process, and records every
request it answered (``served``: prompt ids and token count), or refused (``refused``: reasons).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

MODEL_NAME = "refmodel-tiny"
DEFAULT_MAX_TOKENS = 16
MAX_OUTPUT_TOKENS = 1024
TOKEN_INTERVAL_S = 0.002
START_WAIT_S = 10.0

_FIELDS = {"model", "prompt", "max_tokens", "stream", "stream_options", "ignore_eos"}


def standin_tokens(prompt_ids: list[int], n_tokens: int) -> list[int]:
    """The stand-in model's answer: ``n_tokens`` ids of lowercase letters, fixed by the whole prompt."""
    digest = hashlib.sha256(bytes(t % 256 for t in prompt_ids) + len(prompt_ids).to_bytes(8, "little")).digest()
    out: list[int] = []
    while len(out) < n_tokens:
        out.extend(ord("a") + b % 26 for b in digest)
        digest = hashlib.sha256(digest).digest()
    return out[:n_tokens]


def decode_text(ids: list[int]) -> str:
    """Token ids to text as the router writes it: bytes < 256 as UTF-8 (errors replaced), others omitted."""
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


class BadRequest(ValueError):
    pass


@dataclass(frozen=True)
class Completion:
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool


def parse_completion(body: object) -> Completion:
    """Check a ``/v1/completions`` body; ``BadRequest`` names the field."""
    if not isinstance(body, dict):
        raise BadRequest("body: expected a JSON object")
    unknown = set(body) - _FIELDS
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(_FIELDS))}")
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        ids = list(prompt.encode("utf-8"))
    elif isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 512 for t in prompt):
        ids = list(prompt)
    else:
        raise BadRequest("prompt: expected a non-empty string or a non-empty list of token ids in [0, 511]")
    n = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if type(n) is not int or not 1 <= n <= MAX_OUTPUT_TOKENS:
        raise BadRequest(f"max_tokens: expected an integer in [1, {MAX_OUTPUT_TOKENS}], got {n!r}")
    for name in ("stream", "ignore_eos"):
        if not isinstance(body.get(name, False), bool):
            raise BadRequest(f"{name}: expected true or false")
    if not isinstance(body.get("model", ""), str):
        raise BadRequest("model: expected a string")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or set(opts) - {"include_usage"} or not isinstance(opts.get("include_usage", False), bool):
        raise BadRequest('stream_options: expected {"include_usage": true|false}')
    return Completion(ids, n, bool(body.get("stream", False)), bool(opts.get("include_usage", False)))


@dataclass
class StandinServer:
    """The stand-in on 127.0.0.1 (see module contract); ``with StandinServer() as s: s.url``."""

    url: str = ""
    served: list[tuple[list[int], int]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="openai-standin", daemon=True)
        self._runner: web.AppRunner | None = None
        self._created = int(time.time())

    def __enter__(self) -> StandinServer:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(START_WAIT_S)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(START_WAIT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_WAIT_S)

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL_NAME, "object": "model", "created": self._created, "owned_by": "kvpool"}]})

    def _chunk(self, rid: str, text: str, finish: str | None) -> dict:
        return {"id": rid, "object": "text_completion", "created": self._created, "model": MODEL_NAME,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            c = parse_completion(await request.json())
        except (BadRequest, json.JSONDecodeError) as e:
            self.refused.append(str(e))
            return web.json_response({"error": {"message": str(e), "type": "invalid_request_error"}}, status=400)
        rid = f"cmpl-{len(self.served) + len(self.refused)}"
        tokens = standin_tokens(c.prompt_ids, c.max_tokens)
        usage = {"prompt_tokens": len(c.prompt_ids), "completion_tokens": len(tokens),
                 "total_tokens": len(c.prompt_ids) + len(tokens)}
        self.served.append((c.prompt_ids, len(tokens)))
        if not c.stream:
            body = self._chunk(rid, decode_text(tokens), "length")
            return web.json_response({**body, "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for i, t in enumerate(tokens):
            await asyncio.sleep(TOKEN_INTERVAL_S)
            chunk = self._chunk(rid, decode_text([t]), "length" if i == len(tokens) - 1 else None)
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if c.include_usage:
            tail = {**self._chunk(rid, "", None), "choices": [], "usage": usage}
            await resp.write(f"data: {json.dumps(tail)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
