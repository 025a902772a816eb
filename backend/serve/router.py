"""The router of production mode: the OpenAI-compatible front door, the admission gate and the routing.

Routes (aiohttp; the supervisor binds it on 127.0.0.1 only):
    POST /v1/completions   ``model``, ``prompt`` (text or a list of token ids), ``max_tokens``
                           (required, 1 .. ``gate.max_output_tokens``), ``ignore_eos`` (false),
                           ``stream`` (false), ``stream_options``, ``user`` / ``kvpool_session``
                           (the session, for session-affinity routing; without either, the
                           ``x-kvpool-session`` header names it); ``stop`` is not supported (400)
                           and so is any other field (400).
    GET /v1/models         the one model served (``model.name`` of the scenario).
    GET /health            200 when every engine answers its ``/health`` with ``ok`` (and the
                           supervisor's children run), else 503 naming the ones that do not;
                           ``pool`` says ``up``, or ``down`` while a prefill stage's client has lost
                           the Mooncake master (serving goes on: prefill recomputes).
    GET /metrics           Prometheus text (``backend.serve.metrics``); the pool's series
                           (``backend.serve.pool_metrics``) from the prefill engines' ``/metrics``,
                           each asked within ``POOL_SCRAPE_TIMEOUT_S``.

A completion (``protocol`` holds the engine messages):
    1. parse and check the body (400 naming the field);
    2. gate: ``AdmissionGate.arrive``: rejected at once (400 naming the verdict:
       ``policy.admission.refusal``, the caps and the gate's budget), admitted on a decode instance,
       or wait on an asyncio future until a ``release`` admits it or ``expire`` at its deadline
       rejects it (429 ``reject_admission_timeout``). Without a gate (``gate.enabled = false``)
       ``policy.admission.Ungated`` over each decode instance's KV (``serve.decode_kv_tokens`` in
       whole pages per DCP rank, ``kvpool.scenario.derive.serve_decode_kv_tokens``): the same
       ``refusal`` with that KV as the budget, then the decode instance with the most KV the router
       has not handed out (the simulator's admit step asks the same object);
    3. route: ``Routing.choose_prefill`` (``policy.routing.routing_for``, built as the simulator
       builds it): a prefill instance of the decode instance's group, picked by the group's router
       over the prompt tokens each of them has outstanding;
    4. POST decode /expect (naming the prefill instance, whose ranks alone take the hand-off),
       POST prefill /prefill (the first token), POST decode /generate (an NDJSON
       stream of ``TokenEvent``); every engine call ends by the request's deadline,
       ``serve.request_timeout_s`` after admission (504 when it passes);
    5. the gate's reservation goes back however the request ends. On a failure after /expect the
       router sends decode /abort (bounded by ``ABORT_TIMEOUT_S``) and answers 502 (504 for a
       deadline; an engine's own 413, 503 or 504 keeps its status) with a reason naming the engine
       and the cause; after a stream has begun, the
       stream ends with an ``{"error": ...}`` chunk instead of ``[DONE]``.

Answers: ``choices[0].text`` and ``choices[0].token_ids``, ``usage`` with
``prompt_tokens_details.cached_tokens`` (GPU prefix cache + pool tokens), and ``kvpool.record``:
the request's ``RequestRecord`` (times in seconds since the router started). A stream sends
OpenAI completion chunks (``data: {...}``), then a chunk with ``choices: []``, ``usage`` and
``kvpool``, then ``data: [DONE]``. Errors are ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from kvpool.backend.serve import http_errors
from kvpool.backend.serve import tokens as tok
from kvpool.backend.serve.metrics import CONTENT_TYPE, RouterMetrics
from kvpool.backend.serve.protocol import (
    AbortRequest,
    ExpectRequest,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    ProtocolError,
    TokenEvent,
)
from kvpool.policy.admission import AdmissionGate, GateConfig, Ungated, Verdict
from kvpool.policy.routing import routing_for
from kvpool.scenario.derive import serve_decode_kv_tokens
from kvpool.scenario.model import Scenario
from kvpool.workload.records import RequestRecord

#: Longest the router waits for decode to confirm an /abort, s.
ABORT_TIMEOUT_S = 5.0
#: Longest one engine's /health may take before the router counts it unhealthy, s.
HEALTH_TIMEOUT_S = 2.0
#: Longest one prefill engine's /metrics may take inside the router's /metrics (then its pool is left out), s.
POOL_SCRAPE_TIMEOUT_S = 2.0
#: Longest a request's body may take to arrive once its headers have, s (then 408).
BODY_TIMEOUT_S = 30.0
#: What the router serves, for the message of a 404 or 405.
ROUTES = "POST /v1/completions, GET /v1/models, GET /health, GET /metrics"
#: How the router's aiohttp runner is built: a client that goes away cancels its request's handler, so
#: a request waiting at the gate leaves the queue and a running one is aborted on decode at once.
RUNNER_OPTIONS = {"handler_cancellation": True}
#: Fields a completion request may carry.
FIELDS = frozenset({"model", "prompt", "max_tokens", "ignore_eos", "stream", "stream_options", "user",
                    "kvpool_session", "stop"})
#: The header that names a request's session when its body does not (``kvpool replay`` sends it).
SESSION_HEADER = "x-kvpool-session"
#: Record fields the router owns; an engine's record never overrides them.
ROUTER_FIELDS = frozenset({"key", "session", "thread", "measured", "arrival_s", "in_tokens", "out_tokens", "prefill",
                           "decode", "first_token_s", "end_s", "rejected"})
RECORD_FIELDS = frozenset(f.name for f in fields(RequestRecord))
#: Engine record fields measured from the engine's receipt of the request (shifted to the router's clock).
ENGINE_RELATIVE = ("prefill_start_s", "prefill_end_s")


class ApiError(Exception):
    """An answer other than 200: HTTP ``status`` and the OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 outcome: str = "bad_request") -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.outcome = status, message, type_, param, outcome

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def router_error_body(status: int, message: str) -> dict:
    """The router's error object for an answer aiohttp gives before any route (``http_errors``): a
    request line, header or framing it cannot parse (4xx), or an exception a handler left (5xx)."""
    return ApiError(status, message, type_="invalid_request_error" if status < 500 else "internal_error").body()


def serve_runner(app: web.Application, **kwargs) -> web.AppRunner:
    """The ``AppRunner`` of the router's ``app``: every error answer an error object (``http_errors``)."""
    return http_errors.runner(app, router_error_body, **kwargs)


class BodyError(ApiError):
    """A request body that could not be read to its end (408, 413, a broken encoding): the answer
    closes the connection."""


#: Engine answers the router passes on with their own status (the prompt does not fit the prefill KV,
#: the engine is out of room or stopping, its deadline passed); any other failure is a 502.
PASSED_ON = frozenset({413, 503, 504})


class EngineError(ApiError):
    """An engine failed (502, or its own 413/503/504) or the request's deadline passed (504); the
    message names the engine and the cause."""

    def __init__(self, engine: str, cause: str, timeout: bool = False, status: int = 502) -> None:
        status = 504 if timeout else status
        super().__init__(status, f"{engine}: {cause}", "timeout" if status == 504 else "engine_error", None, "error")
        self.engine = engine


@dataclass(frozen=True)
class Completion:
    """A checked completion request."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool
    stream: bool
    session: str


@dataclass(frozen=True)
class Engines:
    """Where the engines listen: ``(name, url)`` per prefill instance and per decode instance, in order."""

    prefill: tuple[tuple[str, str], ...]
    decode: tuple[tuple[str, str], ...]

    def all(self) -> tuple[tuple[str, str], ...]:
        return self.decode + self.prefill


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _opt_str(body: dict, name: str) -> str:
    v = body.get(name)
    if v is None:
        return ""
    if not isinstance(v, str) or len(v) > 256:
        raise _bad(name, f"expected a string of at most 256 characters, got {v!r:.80}")
    return v


def _opt_bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(name, f"expected true or false, got {v!r:.80}")
    return v


def _session_header(v: str | None) -> str:
    if v is None:
        return ""
    if len(v) > 256:
        raise _bad(SESSION_HEADER, f"expected at most 256 characters, got {len(v)}")
    return v


def parse_completion(body: object, *, model: str, vocab: int, session_header: str | None = None) -> Completion:
    """The checked request, or ``ApiError`` (400; 404 for another model) naming the field.

    The session: the body's ``kvpool_session``, else its ``user``, else ``session_header`` (the
    ``SESSION_HEADER`` of the request), else none."""
    if not isinstance(body, dict):
        raise ApiError(400, "expected a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(unknown)} (allowed: {', '.join(sorted(FIELDS))})",
                       param=unknown[0])
    if body.get("stop") not in (None, [], ""):
        raise _bad("stop", "not supported: a generation ends after max_tokens, or at the end-of-sequence token "
                           "unless ignore_eos")
    m = body.get("model")
    if not isinstance(m, str):
        raise _bad("model", f"required: the model's name ({model!r})")
    if m != model:
        raise ApiError(404, f"model: {m!r:.80} is not served here; the model is {model!r}", param="model",
                       type_="invalid_request_error")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "expected a non-empty string or list of token ids")
        if not prompt.isascii():
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise _bad("prompt", f"not Unicode text: a lone surrogate (\\u{ord(prompt[e.start]):04x}) "
                                     f"at position {e.start}") from None
        ids = tuple(tok.encode(prompt))
    elif isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], (list, str)):
            raise _bad("prompt", "one prompt per request: a string or one list of token ids")
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise _bad("prompt", f"prompt[{i}]: expected an integer token id in [0, {vocab - 1}], got {t!r:.80}")
        ids = tuple(prompt)
    else:
        raise _bad("prompt", "expected a non-empty string or list of token ids")
    mt = body.get("max_tokens")
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise _bad("max_tokens", f"required: an integer >= 1, got {mt!r:.80}")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage", "continuous_usage_stats"}
                           or any(not isinstance(v, bool) for v in so.values())):
        raise _bad("stream_options", "expected {\"include_usage\": true|false}")
    header = _session_header(session_header)
    session = _opt_str(body, "kvpool_session") or _opt_str(body, "user") or header
    return Completion(ids, mt, _opt_bool(body, "ignore_eos"), _opt_bool(body, "stream"), session)


def _verdict_error(verdict: Verdict, c: Completion, gate: GateConfig, budget_tokens: int, budget: str) -> ApiError:
    """The answer to a refused request; ``budget`` names where ``budget_tokens`` comes from."""
    n_in, n_out = len(c.prompt_ids), c.max_tokens
    if verdict is Verdict.REJECT_INPUT:
        return ApiError(400, f"{verdict.value}: the prompt has {n_in} tokens; gate.max_input_tokens is "
                             f"{gate.max_input_tokens}", verdict.value, "prompt", "rejected")
    if verdict is Verdict.REJECT_OUTPUT:
        return ApiError(400, f"{verdict.value}: max_tokens is {n_out}; gate.max_output_tokens is "
                             f"{gate.max_output_tokens}", verdict.value, "max_tokens", "rejected")
    if verdict is Verdict.REJECT_BUDGET:
        return ApiError(400, f"{verdict.value}: prompt + max_tokens = {n_in + n_out} tokens; one decode instance "
                             f"admits {budget_tokens} ({budget})", verdict.value, None, "rejected")
    return ApiError(429, f"{verdict.value}: no decode instance had room for {n_in + n_out} tokens within "
                         f"gate.max_wait_s = {gate.max_wait_s:g} s", verdict.value, None, "rejected")


class Router:
    """One router over ``engines`` for ``scenario``; ``app`` is its aiohttp application.

    ``healthy_children``: the supervisor's check that its processes run (``/health`` fails without it).
    """

    def __init__(self, scenario: Scenario, engines: Engines,
                 healthy_children: Callable[[], str | None] = lambda: None) -> None:
        if len(engines.decode) != scenario.decode.instances or len(engines.prefill) != scenario.prefill.instances:
            raise ValueError("engines: one per prefill and decode instance of the scenario")
        self.scenario, self.engines = scenario, engines
        self.model = scenario.model.name
        self.vocab = scenario.serve.vocab
        self.request_timeout_s = scenario.serve.request_timeout_s
        g = scenario.gate
        self.gate_config = GateConfig(g.tokens_per_decode, g.budget_fraction, g.max_input_tokens, g.max_output_tokens,
                                      g.max_wait_s)
        self.gate = AdmissionGate(self.gate_config, scenario.decode.instances) if g.enabled else None
        #: the decode groups' prefill instances and routers, built as the simulator builds them
        self.routing = routing_for(scenario.routing.prefill, scenario.seed, scenario.prefill.instances,
                                   scenario.decode.instances)
        self.prefill_outstanding = [0] * scenario.prefill.instances
        #: without a gate: admission over each decode instance's KV (serve.decode_kv_tokens in whole
        #: pages per DCP rank), as the simulator's admit step asks it
        self.ungated = (None if g.enabled else
                        Ungated(self.gate_config, [serve_decode_kv_tokens(scenario)] * scenario.decode.instances))
        self.metrics = RouterMetrics()
        self.healthy_children = healthy_children
        self.in_flight = 0
        self.draining = False
        self._cut = False  # cut_in_flight was called
        self._tasks: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._held: dict[str, tuple[int, int]] = {}  # request id -> (decode, tokens), admitted
        self._waiters: dict[str, asyncio.Future] = {}
        self._t0 = time.monotonic()
        self._ids = 0
        self._http: aiohttp.ClientSession | None = None
        max_body = max(1 << 20, g.max_input_tokens * 12 + (1 << 20))
        self.app = web.Application(client_max_size=max_body, middlewares=[_json_errors])
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics_text)
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    # lifecycle ----------------------------------------------------------------------------------
    async def _start(self, _app: web.Application) -> None:
        self._t0 = time.monotonic()
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def _stop(self, _app: web.Application) -> None:
        if self._http is not None:
            await self._http.close()

    def begin_drain(self) -> None:
        """From now on, refuse new requests (503)."""
        self.draining = True

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests (503) and wait up to ``timeout_s`` for the in-flight ones; ``True`` if none is left."""
        self.begin_drain()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def now_s(self) -> float:
        """Seconds since the router started (the records' clock and the gate's)."""
        return time.monotonic() - self._t0

    # small routes -------------------------------------------------------------------------------
    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": 0, "owned_by": "kvpool",
            "max_model_len": self.gate_config.max_input_tokens + self.gate_config.max_output_tokens}]})

    async def metrics_text(self, _request: web.Request) -> web.Response:
        from kvpool.backend.serve.pool_metrics import deployment_row

        async def one(url: str) -> str | None:
            try:
                async with self._session().get(f"{url}/metrics",
                                               timeout=aiohttp.ClientTimeout(total=POOL_SCRAPE_TIMEOUT_S)) as r:
                    return await r.text() if r.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return None

        texts = await asyncio.gather(*(one(u) for _, u in self.engines.prefill))
        row = deployment_row(self.scenario.serve.pool, [t for t in texts if t is not None])
        self.metrics.pool.set([row] if row is not None else [])
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def health(self, _request: web.Request) -> web.Response:
        pool_down: list[str] = []

        async def one(name: str, url: str) -> tuple[str, str]:
            try:
                async with self._session().get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                    body = await r.json(content_type=None)
                    status = body.get("status", "?") if isinstance(body, dict) else "?"
                    detail = body.get("detail") if isinstance(body, dict) else None
                    ups = detail.get("pool_up") if isinstance(detail, dict) else None
                    if isinstance(ups, list) and any(u is False for u in ups):
                        pool_down.append(name)
                    return name, status if r.status == 200 else f"HTTP {r.status} ({status})"
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                return name, f"unreachable ({type(e).__name__}: {e})"

        engines = dict(await asyncio.gather(*(one(n, u) for n, u in self.engines.all())))
        problem = self.healthy_children()
        ok = problem is None and not self.draining and all(s == "ok" for s in engines.values())
        body = {"status": "ok" if ok else ("draining" if self.draining else "unhealthy"), "engines": engines,
                "pool": f"down ({', '.join(sorted(pool_down))}: the pool client lost its master; prefill recomputes)"
                        if pool_down else "up"}
        if problem is not None:
            body["processes"] = problem
        return web.json_response(body, status=200 if ok else 503)

    # completions --------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival_s = self.now_s()
        if self.draining:
            return self._fail(ApiError(503, "the server is shutting down", "unavailable", outcome="error"))
        try:
            body = await _read_json(request)
        except ApiError as e:
            resp = self._fail(e)
            if isinstance(e, BodyError):
                resp.force_close()  # what is left of the body is not read as a next request
            return resp
        try:
            c = parse_completion(body, model=self.model, vocab=self.vocab,
                                 session_header=request.headers.get(SESSION_HEADER))
        except ApiError as e:
            return self._fail(e)
        self._ids += 1
        rid = f"cmpl-{self._ids}"
        self.in_flight += 1
        self._idle.clear()
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            return await self._serve(request, rid, c, arrival_s)
        except asyncio.CancelledError:
            if not self._cut:
                raise
            task.uncancel()  # cut_in_flight's: answer, as a waiting request's cut ends here
            return self._fail(self._cut_error())
        finally:
            self._tasks.discard(task)
            if rid in self._held:
                self._release(rid)
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def _fail(self, e: ApiError) -> web.Response:
        self.metrics.requests.labels(outcome=e.outcome).inc()
        return e.response()

    async def _serve(self, request: web.Request, rid: str, c: Completion, arrival_s: float) -> web.StreamResponse:
        try:
            decode = await self._admit(rid, c)
        except asyncio.CancelledError:
            if not self._cut:
                self.metrics.requests.labels(outcome="cancelled").inc()
            raise
        except ApiError as e:
            if e.outcome == "rejected":
                self.metrics.gate_rejected.labels(reason=e.type).inc()
            return self._fail(e)
        self.metrics.running.inc()
        try:
            return await self._answer(request, rid, c, arrival_s, decode)
        finally:
            self.metrics.running.dec()

    # gate ---------------------------------------------------------------------------------------
    async def _admit(self, rid: str, c: Completion) -> int:
        """The decode instance ``rid`` is admitted on (``_held`` records it), or ``ApiError``."""
        n_in, n_out = len(c.prompt_ids), c.max_tokens
        need = n_in + n_out
        if self.gate is None:
            adm = self.ungated.admit(rid, n_in, n_out)
            if adm.verdict is not Verdict.ADMITTED:
                raise _verdict_error(adm.verdict, c, self.gate_config, self.ungated.budget_tokens,
                                     "serve.decode_kv_tokens")
            self._held[rid] = (adm.decode, need)
            return adm.decode
        adm = self.gate.arrive(rid, n_in, n_out, self.now_s())
        if adm.verdict is Verdict.ADMITTED:
            self._held[rid] = (adm.decode, need)
            self.metrics.gate_admitted.inc()
            return adm.decode
        if adm.verdict is not Verdict.WAIT:
            raise _verdict_error(adm.verdict, c, self.gate_config, self.gate_config.budget_tokens,
                                 "gate.tokens_per_decode x gate.budget_fraction")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._waiters[rid] = fut
        self.metrics.gate_waiting.set(self.gate.waiting)
        timer = loop.call_later(max(0.0, adm.deadline_s - self.now_s()), self._expire, rid)
        try:
            decode = await fut
        finally:
            timer.cancel()
            self._waiters.pop(rid, None)
            self.gate.expire(rid)  # a no-op unless the wait ended otherwise (the client went away)
            self.metrics.gate_waiting.set(self.gate.waiting)
        self.metrics.gate_admitted.inc()
        return decode

    def _expire(self, rid: str) -> None:
        fut = self._waiters.get(rid)
        if self.gate is not None and self.gate.expire(rid) and fut is not None and not fut.done():
            fut.set_exception(self._timeout_error())
        self.metrics.gate_waiting.set(self.gate.waiting if self.gate else 0)

    def _timeout_error(self) -> ApiError:
        g = self.gate_config
        v = Verdict.REJECT_TIMEOUT.value
        return ApiError(429, f"{v}: no decode instance had room for the request within gate.max_wait_s = "
                             f"{g.max_wait_s:g} s", v, None, "rejected")

    def _release(self, rid: str) -> None:
        """Give ``rid``'s reservation back and hand the freed budget to the waiters the gate admits."""
        self._held.pop(rid)
        if self.gate is None:
            self.ungated.release(rid)
            return
        queue = [rid]
        while queue:
            for wid, d in self.gate.release(queue.pop()):
                fut = self._waiters.get(wid)
                self._held[wid] = (d, 0)  # the gate holds its tokens
                if fut is not None and not fut.done():
                    fut.set_result(d)
                else:  # its client went away while the release was on its way: give it straight back
                    del self._held[wid]
                    queue.append(wid)
        self.metrics.gate_waiting.set(self.gate.waiting)

    def _route(self, decode: int, c: Completion) -> int:
        """The prefill instance for ``c`` admitted on ``decode``: ``Routing.choose_prefill`` over the
        prompt tokens each prefill instance has outstanding (the caller counts ``c``'s in)."""
        return self.routing.choose_prefill(decode, c.session, self.prefill_outstanding)

    # engines ------------------------------------------------------------------------------------
    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("the router has not started")
        return self._http

    async def _post(self, engine: str, url: str, path: str, message: dict, deadline: float) -> dict:
        """POST ``message`` to ``url + path`` and return the JSON answer; ``EngineError`` naming ``engine``."""
        try:
            async with asyncio.timeout_at(deadline):
                async with self._session().post(f"{url}{path}", json=message) as r:
                    text = await r.text()
        except TimeoutError:
            raise EngineError(engine, f"POST {path} did not answer within serve.request_timeout_s = "
                                      f"{self.request_timeout_s:g} s", timeout=True) from None
        except aiohttp.ClientError as e:
            raise EngineError(engine, f"POST {path} failed: {type(e).__name__}: {e}") from None
        if r.status != 200:
            raise EngineError(engine, f"POST {path} answered HTTP {r.status}: {_reason(text)}",
                              status=r.status if r.status in PASSED_ON else 502)
        try:
            return json.loads(text)
        except ValueError:
            raise EngineError(engine, f"POST {path} answered something other than JSON: {text[:200]!r}") from None

    async def _abort(self, decode: int, rid: str) -> None:
        name, url = self.engines.decode[decode]
        try:
            async with self._session().post(f"{url}/abort", json=AbortRequest(rid).to_json(),
                                            timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)) as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError):
            pass  # the engine is gone or hung: nothing of the request survives there that matters

    async def _tokens(self, rid: str, c: Completion, rec: RequestRecord,
                      deadline: float) -> AsyncIterator[tuple[list[int], str]]:
        """The request's tokens as they come: ``(tokens, finish_reason)``, the reason on the last item."""
        d = rec.decode
        # route now, before anything is awaited, so concurrent requests see each other's tokens
        p = rec.prefill = self._route(d, c)
        dname, durl = self.engines.decode[d]
        pname, purl = self.engines.prefill[p]
        n = len(c.prompt_ids)
        self.prefill_outstanding[p] += n
        try:
            await self._post(dname, durl, "/expect", ExpectRequest(rid, n, c.max_tokens, p).to_json(), deadline)
            sent_s = self.now_s()
            answer = await self._post(pname, purl, "/prefill",
                                      PrefillRequest(rid, c.prompt_ids, d, c.session).to_json(), deadline)
        finally:
            self.prefill_outstanding[p] -= n
        try:
            result = PrefillResult.from_json(answer)
        except ProtocolError as e:
            raise EngineError(pname, f"POST /prefill answered a malformed PrefillResult: {e}") from None
        rec.first_token_s = self.now_s()
        _merge(rec, result.record, sent_s, overwrite=True)
        first = result.first_token
        if c.max_tokens == 1 or (first == tok.EOS_TOKEN and not c.ignore_eos):
            await self._abort(d, rid)  # nothing to generate: decode frees the pages it set aside
            yield [first], "length" if c.max_tokens == 1 and (first != tok.EOS_TOKEN or c.ignore_eos) else "stop"
            return
        yield [first], ""
        async for event in self._generate(dname, durl, GenerateRequest(rid, first, c.max_tokens, result.descriptor,
                                                                       c.ignore_eos), deadline):
            if event.done:
                _merge(rec, event.record, sent_s, overwrite=False)
                yield list(event.tokens), event.finish_reason or "length"
                return
            yield list(event.tokens), ""

    async def _generate(self, engine: str, url: str, req: GenerateRequest, deadline: float) -> AsyncIterator[TokenEvent]:
        path = "/generate"
        try:
            async with asyncio.timeout_at(deadline):
                async with self._session().post(f"{url}{path}", json=req.to_json()) as r:
                    if r.status != 200:
                        raise EngineError(engine, f"POST {path} answered HTTP {r.status}: {_reason(await r.text())}",
                                          status=r.status if r.status in PASSED_ON else 502)
                    while True:
                        line = await r.content.readline()
                        if not line:
                            raise EngineError(engine, f"POST {path}: the stream ended before its last event")
                        if not line.strip():
                            continue
                        try:
                            event = TokenEvent.from_json(json.loads(line))
                        except (ValueError, ProtocolError) as e:
                            raise EngineError(engine, f"POST {path}: a malformed TokenEvent: {e}") from None
                        if event.error:
                            raise EngineError(engine, f"POST {path}: {event.error}")
                        yield event
                        if event.done:
                            return
        except TimeoutError:
            raise EngineError(engine, f"POST {path} did not finish within serve.request_timeout_s = "
                                      f"{self.request_timeout_s:g} s", timeout=True) from None
        except aiohttp.ClientError as e:
            raise EngineError(engine, f"POST {path} failed: {type(e).__name__}: {e}") from None

    # answers ------------------------------------------------------------------------------------
    async def _answer(self, request: web.Request, rid: str, c: Completion, arrival_s: float,
                      decode: int) -> web.StreamResponse:
        rec = RequestRecord(key=rid, session=c.session, arrival_s=arrival_s, in_tokens=len(c.prompt_ids), decode=decode)
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        out: list[int] = []
        text = tok.TextStream()
        resp: web.StreamResponse | None = None
        finish = ""
        last_s = 0.0
        gen = self._tokens(rid, c, rec, deadline)
        try:
            async for ids, finish in gen:
                now = self.now_s()
                if not out:
                    self.metrics.ttft.observe(now - arrival_s)
                else:
                    self.metrics.observe_gaps(now - last_s, len(ids))
                last_s = now
                out.extend(ids)
                if c.stream:
                    if resp is None:
                        resp = await self._open_stream(request)
                    piece = text.feed(ids) + (text.flush() if finish else "")
                    await _send(resp, self._chunk(rid, piece, ids, finish or None))
        except asyncio.CancelledError:
            await gen.aclose()
            if not self._cut:
                await asyncio.shield(self._abort(decode, rid))
                self.metrics.requests.labels(outcome="cancelled").inc()
                raise
            asyncio.current_task().uncancel()
            return await self._failed(self._cut_error(), resp, decode, rid)
        except ApiError as e:
            return await self._failed(e, resp, decode, rid)
        except ConnectionError:
            await gen.aclose()
            await self._abort(decode, rid)
            self.metrics.requests.labels(outcome="cancelled").inc()
            raise
        rec.end_s = self.now_s()
        rec.out_tokens = len(out)
        self.metrics.e2e.observe(rec.end_s - arrival_s)
        self.metrics.observe_record(rec)
        self.metrics.requests.labels(outcome="ok").inc()
        usage = {"prompt_tokens": rec.in_tokens, "completion_tokens": len(out), "total_tokens": rec.in_tokens + len(out),
                 "prompt_tokens_details": {"cached_tokens": rec.gpu_tokens + rec.pool_tokens + rec.ssd_tokens}}
        extension = {"record": rec.as_dict()}
        if resp is not None:
            try:
                await _send(resp, {**self._head(rid, "text_completion"), "choices": [], "usage": usage,
                                   "kvpool": extension})
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except ConnectionError:
                pass
            return resp
        return web.json_response({**self._head(rid, "text_completion"), "choices": [{
            "index": 0, "text": tok.decode(out), "token_ids": out, "logprobs": None, "finish_reason": finish}],
            "usage": usage, "kvpool": extension})

    async def _failed(self, e: ApiError, resp: web.StreamResponse | None, decode: int, rid: str) -> web.StreamResponse:
        """Abort on decode, then answer ``e``: an error response, or an error chunk ending a begun stream."""
        await self._abort(decode, rid)
        if resp is None:
            return self._fail(e)
        self.metrics.requests.labels(outcome=e.outcome).inc()
        try:
            await _send(resp, e.body())
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return resp

    def _cut_error(self) -> ApiError:
        return ApiError(503, f"the server stopped: the request did not finish within serve.drain_s = "
                             f"{self.scenario.serve.drain_s:g} s of the stop", "unavailable", outcome="error")

    def cut_in_flight(self) -> None:
        """End every in-flight request now (after the drain): each answers 503 ``unavailable``."""
        self._cut = True
        for t in list(self._tasks):
            t.cancel()

    def _head(self, rid: str, obj: str) -> dict:
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model}

    def _chunk(self, rid: str, text: str, ids: list[int], finish: str | None) -> dict:
        return {**self._head(rid, "text_completion"), "choices": [
            {"index": 0, "text": text, "token_ids": ids, "logprobs": None, "finish_reason": finish}]}

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp


async def _read_json(request: web.Request) -> object:
    """The request's body as JSON, or an ``ApiError``: 400 (not JSON, nested deeper than the parser
    goes, not what its Content-Encoding says), 413 (over the size limit), 408 (the body did not
    arrive within ``BODY_TIMEOUT_S``; the connection is then closed)."""
    try:
        data = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise BodyError(408, f"the body did not arrive within {BODY_TIMEOUT_S:g} s") from None
    except web.HTTPRequestEntityTooLarge as e:
        raise BodyError(413, f"the body is larger than {request.client_max_size} bytes: {e.text}") from None
    except (web.HTTPException, HttpProcessingError, RequestPayloadError, zlib.error) as e:
        enc = request.headers.get("Content-Encoding")
        why = f"the body is not what its Content-Encoding ({enc}) says" if enc else "the body cannot be read"
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise BodyError(400, f"{why}: {detail}") from None
    try:
        return json.loads(data.decode(request.charset or "utf-8"))
    except (ValueError, UnicodeDecodeError, LookupError) as e:
        raise ApiError(400, f"the body is not JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the body is not JSON this router reads: nested too deep") from None


@web.middleware
async def _json_errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    """aiohttp's own 4xx answers (no such path, a method the path does not take) as error objects."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        what = {404: "no such path", 405: "method not allowed"}.get(e.status, e.reason)
        return ApiError(e.status, f"{request.method} {request.path}: {what}; the router serves {ROUTES}",
                        type_="not_found" if e.status == 404 else "invalid_request_error").response()


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def _reason(text: str) -> str:
    """An engine's ``{"error": reason}`` answer as its reason (else the text, shortened)."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(body, dict) and "error" in body:
        e = body["error"]
        return e.get("message", str(e)) if isinstance(e, dict) else str(e)
    return text[:200]


def _merge(rec: RequestRecord, part: dict, sent_s: float, overwrite: bool) -> None:
    """Copy an engine's record fields into ``rec`` (never the router's own; engine-relative times shifted)."""
    for k, v in part.items():
        if k not in RECORD_FIELDS or k in ROUTER_FIELDS:
            continue
        if not overwrite and getattr(rec, k) != getattr(RequestRecord(key=""), k):
            continue
        if k in ENGINE_RELATIVE and isinstance(v, (int, float)):
            v = sent_s + v
        setattr(rec, k, v)

