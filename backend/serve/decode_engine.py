"""A decode engine process: ``python -m kvpool.backend.serve.decode_engine --plan PLAN --name NAME``.

One per decode instance. ``decode_core.DecodeCore`` (one engine thread) owns the hand-off ranks,
the paged KV, the model and the continuous batch; this module is its HTTP face (aiohttp on
127.0.0.1, port 0) and the process around it.

Routes (JSON bodies checked by ``protocol``'s ``from_json``; every non-2xx answer is
``{"error": reason}``):
    POST /expect    ``ExpectRequest`` -> 200 ``{"request_id", "pages": [per rank]}``; only the ranks
                    of its ``prefill_instance`` wait for the hand-off (and take landing slots for
                    it). 503 when the instance has no room for ``prompt_tokens + max_tokens``
                    tokens; 409 for a request id already expected; 400 for a bad body (or a
                    ``prefill_instance`` the deployment does not have).
    POST /generate  ``GenerateRequest`` -> 200, ``application/x-ndjson``: one ``TokenEvent`` per
                    line (the tokens after ``first_token``, one line per decode step; the last line
                    ``done`` with ``finish_reason`` ``length``/``stop`` or ``error``). 404 for a
                    request not expected (or already ended), 409 for one already generating or a
                    ``max_tokens`` above the expected one, 400 for a bad body (or a descriptor of
                    another decode instance).
    POST /abort     ``AbortRequest`` -> 200 ``{"aborted": bool}`` (false: unknown); an open stream
                    of it ends with an error line.
    GET /health     ``Health``: ``ok`` while the engine thread runs (``detail``: running, waiting,
                    KV use, free pages per rank), 503 ``failed`` once it has stopped.
    GET /metrics    Prometheus text (``decode_metrics``).

Ready file (``plan.write_ready``), written once the server listens: ``{"pid", "url":
"http://127.0.0.1:PORT", "rank_endpoints": [prefill instance 0's DCP rank endpoints, in rank order],
"rank_endpoints_by_prefill": [[...] for each prefill instance], "transport": "ipc"}``. Prefill
instance ``i``'s stages connect to ``rank_endpoints_by_prefill[i]`` (``rank_endpoints`` is instance
0's), with ``PrefillStage(stage=sender)`` per part of ``handoff_plan.stage_parts`` (the latents,
and the DSA indexer's records when the model has it).

Bounds: a handler waits at most ``COMMAND_WAIT_S`` for the engine thread to take a command (503
after), a stream at most ``serve.request_timeout_s`` + the hand-off bound between two lines (a
backstop past the engine's own bounds: the stream then ends with an error and the request is
aborted); the hand-off bounds are ``decode_core``'s. SIGTERM or SIGINT: every
open stream ends with an error line ``decode engine stopping``, the ranks close, the process exits 0.
A client that disconnects mid-stream aborts its request (pages freed).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvpool.backend.serve import handoff_plan as hp
from kvpool.backend.serve import http_errors
from kvpool.backend.serve.decode_core import DecodeCore, NoRoom, RequestConflict
from kvpool.backend.serve.model_config import ServeConfigError
from kvpool.backend.serve.plan import ServePlan, worker_of_argv, write_ready
from kvpool.backend.serve.protocol import (
    AbortRequest,
    ExpectRequest,
    GenerateRequest,
    Health,
    ProtocolError,
    TokenEvent,
)

COMMAND_WAIT_S = 10.0
MAX_BODY_BYTES = 1 << 20


def _error(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason}, status=status)


async def _body(request: web.Request) -> object:
    try:
        return json.loads(await http_errors.read_body(request))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ProtocolError(f"body: expected a JSON object ({exc})") from exc


class DecodeServer:
    def __init__(self, core: DecodeCore, instance: int) -> None:
        self.core, self.instance = core, instance
        self.streams: set[asyncio.Queue] = set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[http_errors.json_errors()])
        app.router.add_post("/expect", self.expect)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort", self.abort)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def _call(self, fn, *args):
        if not self.core.alive:
            raise RuntimeError("the decode engine thread has stopped")
        return await asyncio.wait_for(self.core.submit(fn, *args), COMMAND_WAIT_S)

    async def expect(self, request: web.Request) -> web.Response:
        try:
            req = ExpectRequest.from_json(await _body(request))
            return web.json_response(await self._call(self.core.expect, req))
        except ProtocolError as exc:
            return _error(400, str(exc))
        except NoRoom as exc:
            return _error(503, str(exc))
        except RequestConflict as exc:
            return _error(409, str(exc))
        except (asyncio.TimeoutError, RuntimeError, ValueError) as exc:
            return _error(503, f"decode instance {self.instance}: {type(exc).__name__}: {exc}")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            req = GenerateRequest.from_json(await _body(request))
            d = req.descriptor.get("decode_instance", self.instance)
            if d != self.instance:
                raise ProtocolError(f"descriptor.decode_instance is {d!r}, this is decode instance {self.instance}")
            out: asyncio.Queue = asyncio.Queue()
            await self._call(self.core.generate, req, out)
        except ProtocolError as exc:
            return _error(400, str(exc))
        except KeyError as exc:
            return _error(404, exc.args[0])
        except RequestConflict as exc:
            return _error(409, str(exc))
        except (asyncio.TimeoutError, RuntimeError, ValueError) as exc:
            return _error(503, f"decode instance {self.instance}: {type(exc).__name__}: {exc}")
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        self.streams.add(out)
        try:
            await resp.prepare(request)
            timeout_s = self.core.request_timeout_s + self.core.handoff_wait_s   # past the engine's own bounds
            while True:
                try:
                    ev = await asyncio.wait_for(out.get(), timeout_s)
                except asyncio.TimeoutError:
                    ev = TokenEvent(done=True, error=f"no token within {timeout_s:g} s")
                    await self._abort_quietly(req.request_id)
                await resp.write((json.dumps(ev.to_json(), separators=(",", ":")) + "\n").encode())
                if ev.done:
                    break
            await resp.write_eof()
        except ConnectionResetError:
            print(f"decode{self.instance}: request {req.request_id!r}: the client left mid-stream; aborted", flush=True)
            await self._abort_quietly(req.request_id)
        except asyncio.CancelledError:
            await self._abort_quietly(req.request_id)
            raise
        finally:
            self.streams.discard(out)
        return resp

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await asyncio.shield(self._call(self.core.abort, request_id))
        except (asyncio.TimeoutError, RuntimeError, asyncio.CancelledError):
            pass

    async def abort(self, request: web.Request) -> web.Response:
        try:
            req = AbortRequest.from_json(await _body(request))
            return web.json_response({"aborted": await self._call(self.core.abort, req.request_id)})
        except ProtocolError as exc:
            return _error(400, str(exc))
        except (asyncio.TimeoutError, RuntimeError) as exc:
            return _error(503, f"decode instance {self.instance}: {type(exc).__name__}: {exc}")

    async def health(self, request: web.Request) -> web.Response:
        ok = self.core.alive
        h = Health("ok" if ok else "failed", "decode_engine", self.instance, self.core.counts())
        return web.json_response(h.to_json(), status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.core.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def serve(plan: ServePlan, name: str) -> int:
    worker = plan.worker(name)
    if worker.role != "decode_engine":
        raise ValueError(f"worker {name!r} is a {worker.role}, not a decode_engine")
    scenario = plan.scenario_model()
    loop = asyncio.get_running_loop()
    devices = worker.devices or ("cpu",)
    if all(d == "cpu" for d in devices):
        torch.set_num_threads(1)   # tiny products: more threads only spin on shared cores
    core = DecodeCore(scenario, worker.instance, devices, loop, log=lambda s: print(s, flush=True))
    server = DecodeServer(core, worker.instance)
    runner = http_errors.runner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001  (aiohttp has no public accessor)
    core.start()
    url = f"http://127.0.0.1:{port}"
    write_ready(plan.ready_path(name), {"url": url, "rank_endpoints": core.rank_endpoints[0],
                                        "rank_endpoints_by_prefill": core.rank_endpoints, "transport": hp.TRANSPORT})
    print(f"{name}: serving on {url}, ranks {core.rank_endpoints}, devices {list(devices)}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set() and core.alive:
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    failed = not core.alive and not stop.is_set()
    await loop.run_in_executor(None, core.stop, "decode engine stopping")
    await asyncio.sleep(0.1)   # let the handlers write the streams' last lines
    await asyncio.wait_for(runner.cleanup(), 5.0)
    print(f"{name}: stopped", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    plan, worker = worker_of_argv("decode_engine", argv)
    try:
        return asyncio.run(serve(plan, worker.name))
    except (ServeConfigError, ValueError) as exc:
        print(f"error: {worker.name}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
