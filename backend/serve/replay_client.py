"""The replay client: a ``workload.replay`` schedule driven in wall-clock time against an OpenAI server.

It drives the same ``AgentXReplay`` / ``ProductionReplay`` objects as the simulator's driver
(``sim.driver``), with asyncio instead of SimPy: ``start`` at time zero, ``finished`` when a
request ends (successfully or not), ``poll`` when the newest ``Wake.next_due_s`` comes; the
replay's clock is seconds since the replay started (``loop.time()``, monotonic).

Contract:
    * ``check_server(url, timeout_s) -> model`` asks ``GET /v1/models`` (bounded); a server that
      does not answer raises ``ReplayError`` naming the URL. The model is the first one listed
      (``"kvpool"`` when the list is empty).
    * ``run_replay(replay, url=..., prompts=..., ...) -> ReplayResult``: every dispatch becomes one
      ``POST /v1/completions`` with ``{"model", "prompt": token ids (prompts.PromptBuilder),
      "max_tokens": out_tokens, "ignore_eos": true, "stream": true}`` and the headers
      ``x-request-id: replay-KEY`` and ``x-kvpool-session: SCOPE`` (the dispatch's chunk-key scope,
      the session id for global ids: a router may keep a session on one instance).
      The answer is read as server-sent events (``data: JSON`` lines, ending ``data: [DONE]``).
      ``arrival_s`` is when the request was sent, ``first_token_s`` when the first data event came,
      ``end_s`` when ``[DONE]`` came, all on the client's clock (so a server sends its first event
      with the first token, not before).
    * The server's record: the last ``"kvpool": {"record": {...}}`` of any event (or of an error
      answer's JSON) gives ``SERVER_FIELDS`` (token sources, restore and hand-off figures, the
      instances, ``rejected``); fields of the wrong type, negative ones (an instance may be -1: none)
      and non-finite times are ignored. Its ``prefill_start_s`` /
      ``prefill_end_s`` are moved onto the client's clock by the server's own ``arrival_s``.
      ``usage.completion_tokens``, when given, is the record's ``out_tokens``; one that is not an
      integer from 0 to the request's ``max_tokens`` fails the request (``bad answer``).
    * Failures: a non-2xx answer (its JSON ``error`` or text), an event with ``error``, a stream that
      breaks off or ends before ``[DONE]``, a connection error, or no answer within
      ``request_timeout_s`` (the whole request) makes the outcome's ``error`` say so, and its
      ``end_s`` stays 0 (so ``summarize`` leaves it out); the replay is told the request finished
      and goes on. A non-2xx answer whose record has ``rejected`` set is a rejection (the
      simulator's ``rejected``), not an error.
    * It stops when the replay is done, when ``stop`` is set (Ctrl-C), or at ``window_end_s`` (the
      measured window's end plus the grace the simulator allows, ``cutoff_s``): requests still
      running then are cancelled and kept with ``error`` ``"cancelled: ..."`` (not errors).
    * ``on_update(done, dispatched, errors)`` is called after every change (a progress bar).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from kvpool.backend.serve.prompts import PromptBuilder
from kvpool.workload.records import RequestRecord
from kvpool.workload.replay import AgentXReplay, Dispatch, ProductionReplay, Wake

#: RequestRecord fields the server's record provides (the client's clock gives the timing).
SERVER_FIELDS = (
    "prefill", "decode", "gpu_tokens", "pool_tokens", "ssd_tokens", "computed_tokens", "restore_stage_s",
    "restore_spread_s", "restore_failed", "handoff_s", "save_s", "restore_bytes", "save_bytes", "handoff_bytes",
    "handoff_writes", "rejected", "lookup_answered",
)
_INT_FIELDS = {"prefill", "decode", "gpu_tokens", "pool_tokens", "ssd_tokens", "computed_tokens", "restore_bytes",
               "save_bytes", "handoff_bytes", "handoff_writes"}
_FLOAT_FIELDS = {"restore_spread_s", "handoff_s", "save_s"}
_BOOL_FIELDS = {"restore_failed", "lookup_answered"}
_MAX_ERROR_CHARS = 300
_CONNECT_TIMEOUT_S = 10.0

Replay = AgentXReplay | ProductionReplay


class ReplayError(Exception):
    """The replay cannot start (the server does not answer); the message names the URL."""


@dataclass
class Outcome:
    """One dispatch as it went: its record and, when it failed or was cancelled, why."""

    dispatch: Dispatch
    record: RequestRecord
    error: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.error) and not self.cancelled

    @property
    def cancelled(self) -> bool:
        return self.error.startswith("cancelled")

    def as_dict(self) -> dict:
        """The JSONL line: ``RequestRecord.as_dict()`` plus ``error`` (empty when it succeeded)."""
        return {**self.record.as_dict(), "error": self.error}


@dataclass
class ReplayResult:
    outcomes: list[Outcome] = field(default_factory=list)  # in dispatch (key) order
    interrupted: bool = False
    wall_s: float = 0.0
    window_end_s: float | None = None

    @property
    def records(self) -> list[RequestRecord]:
        return [o.record for o in self.outcomes]

    @property
    def errors(self) -> int:
        return sum(1 for o in self.outcomes if o.failed)

    @property
    def cancelled(self) -> int:
        return sum(1 for o in self.outcomes if o.cancelled)


def window_end_s(replay: Replay, grace_s: float) -> float | None:
    """When the measured window ends plus ``grace_s`` (replay clock); None while AgentX warms up."""
    start = replay.profile_start_s if isinstance(replay, AgentXReplay) else replay.start_s
    if start is None or not math.isfinite(replay.duration_s):
        return None
    return start + replay.duration_s + grace_s


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def merge_server_record(rec: RequestRecord, server: object) -> None:
    """Copy ``SERVER_FIELDS`` of the server's record ``server`` into ``rec`` (see the contract)."""
    if not isinstance(server, dict):
        return
    for name in SERVER_FIELDS:
        if name not in server:
            continue
        v = server[name]
        if name in _INT_FIELDS:
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= (-1 if name in ("prefill", "decode") else 0)
        elif name in _FLOAT_FIELDS:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        elif name in _BOOL_FIELDS:
            ok = isinstance(v, bool)
        elif name == "rejected":
            ok = isinstance(v, str)
        else:  # restore_stage_s
            ok = isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                             and x >= 0 for x in v)
            v = [float(x) for x in v] if ok else v
        if ok:
            setattr(rec, name, v)
    arrival = server.get("arrival_s")
    if isinstance(arrival, (int, float)) and not isinstance(arrival, bool):
        for name in ("prefill_start_s", "prefill_end_s"):
            v = server.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                setattr(rec, name, rec.arrival_s + (v - arrival))


def _server_record(doc: object) -> object:
    if isinstance(doc, dict) and isinstance(doc.get("kvpool"), dict):
        return doc["kvpool"].get("record")
    return None


async def check_server(url: str, timeout_s: float = _CONNECT_TIMEOUT_S) -> str:
    """The model the server at ``url`` serves (``GET /v1/models``); ``ReplayError`` when it does not answer."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.get(f"{url}/v1/models") as resp:
                if resp.status != 200:
                    raise ReplayError(f"GET {url}/v1/models answered HTTP {resp.status}: {_short(await resp.text())}")
                doc = await resp.json(content_type=None)
    except asyncio.TimeoutError:
        raise ReplayError(f"no answer from {url} within {timeout_s:g} s") from None
    except aiohttp.ClientError as e:
        raise ReplayError(f"cannot reach {url}: {_short(str(e)) or type(e).__name__}") from None
    except ValueError:
        raise ReplayError(f"GET {url}/v1/models did not answer JSON") from None
    models = doc.get("data") if isinstance(doc, dict) else None
    if isinstance(models, list) and models and isinstance(models[0], dict) and isinstance(models[0].get("id"), str):
        return models[0]["id"]
    return "kvpool"


async def _sse_data(resp: aiohttp.ClientResponse):
    """The ``data`` payloads of a server-sent event stream, one per event."""
    lines: list[str] = []
    async for raw in resp.content:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if lines:
                yield "\n".join(lines)
                lines = []
        elif line.startswith("data:"):
            lines.append(line[5:].lstrip(" "))
    if lines:
        yield "\n".join(lines)


class _Client:
    def __init__(self, replay: Replay, http: aiohttp.ClientSession, url: str, model: str, prompts: PromptBuilder,
                 request_timeout_s: float, on_update: Callable[[int, int, int], None] | None):
        self.replay, self.http, self.url, self.model, self.prompts = replay, http, url, model, prompts
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=min(_CONNECT_TIMEOUT_S, request_timeout_s))
        self.request_timeout_s = request_timeout_s
        self.on_update = on_update
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.wake = asyncio.Event()
        self.tasks: dict[int, asyncio.Task] = {}
        self.outcomes: dict[int, Outcome] = {}
        self.done = 0
        self.errors = 0

    def now(self) -> float:
        return self.loop.time() - self.t0

    def update(self) -> None:
        if self.on_update is not None:
            self.on_update(self.done, len(self.outcomes), self.errors)

    def issue(self, w: Wake) -> Wake:
        for d in w.ready:
            rec = RequestRecord(d.key, d.session.id, d.request.thread, d.measured, self.now(),
                                self.prompts.prompt_tokens(d), d.out_tokens)
            self.outcomes[d.key] = Outcome(d, rec)
            self.tasks[d.key] = asyncio.create_task(self.serve(d))
        if w.ready:
            self.update()
        return w

    async def serve(self, d: Dispatch) -> None:
        out = self.outcomes[d.key]
        try:
            out.error = await self.request(d, out.record)
        except asyncio.CancelledError:
            self.tasks.pop(d.key, None)
            raise
        except asyncio.TimeoutError:
            out.error = f"timed out after {self.request_timeout_s:g} s"
        except aiohttp.ClientPayloadError as e:  # the stream broke off
            out.error = f"stream broken: {_short(str(e)) or type(e).__name__}"
        except aiohttp.ClientError as e:  # connection refused or reset
            out.error = f"connection error: {_short(str(e)) or type(e).__name__}"
        except ValueError as e:  # bad JSON in an event, an over-long line
            out.error = f"bad answer: {_short(str(e))}"
        except Exception as e:  # anything else still ends this request only, never the replay
            out.error = f"client error: {type(e).__name__}: {_short(str(e))}"
        if out.error:
            out.record.end_s = 0.0
            self.errors += 1
        self.tasks.pop(d.key, None)
        self.done += 1
        self.issue(self.replay.finished(d.key, self.now()))
        self.update()
        self.wake.set()

    async def request(self, d: Dispatch, rec: RequestRecord) -> str:
        """Send ``d``; fill ``rec``; the error text, or "" when it succeeded."""
        body = {"model": self.model, "prompt": self.prompts.prompt(d), "max_tokens": d.out_tokens,
                "ignore_eos": True, "stream": True}
        headers = {"x-request-id": f"replay-{d.key}", "x-kvpool-session": d.scope or d.session.id}
        rec.arrival_s = self.now()
        async with self.http.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=self.timeout) as resp:
            if resp.status // 100 != 2:
                text = await resp.text(errors="replace")
                try:
                    doc = json.loads(text)
                except ValueError:
                    doc = None
                merge_server_record(rec, _server_record(doc))
                if rec.rejected:
                    return ""
                reason = doc.get("error") if isinstance(doc, dict) else None
                if isinstance(reason, dict):  # OpenAI's {"error": {"message": ...}}
                    reason = reason.get("message", reason)
                return f"HTTP {resp.status}: {_short(str(reason if reason is not None else text))}"
            finished = False
            async for data in _sse_data(resp):
                if data.strip() == "[DONE]":
                    finished = True
                    break
                event = json.loads(data)
                if not rec.first_token_s:
                    rec.first_token_s = self.now()
                if not isinstance(event, dict):
                    continue
                server = _server_record(event)
                if server is not None:
                    merge_server_record(rec, server)
                usage = event.get("usage")
                if isinstance(usage, dict) and "completion_tokens" in usage:
                    n = usage["completion_tokens"]
                    if not (isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= d.out_tokens):
                        return (f"bad answer: usage.completion_tokens {_short(repr(n))}: an integer of at most "
                                f"max_tokens ({d.out_tokens}) was asked for")
                    rec.out_tokens = n
                if event.get("error"):
                    return f"stream error: {_short(str(event['error']))}"
            if not finished:
                return "stream ended before [DONE]"
            rec.end_s = self.now()
            if not rec.first_token_s:
                rec.first_token_s = rec.end_s
            return ""

    async def drive(self, stop: asyncio.Event, grace_s: float) -> bool:
        """Run the replay to its end; True when ``stop`` ended it."""
        w = self.issue(self.replay.start(self.now()))
        while not w.done and not stop.is_set():
            end = window_end_s(self.replay, grace_s)
            if end is not None and self.now() >= end:
                break
            due = [t for t in (w.next_due_s, end) if t is not None]
            timeout = max(0.0, min(due) - self.now()) if due else None
            try:
                await asyncio.wait_for(self.wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()
            w = self.issue(self.replay.poll(self.now()))
        return stop.is_set()

    async def cancel_running(self, why: str) -> None:
        tasks = list(self.tasks.items())
        for key, t in tasks:
            self.outcomes[key].error = f"cancelled: {why}"
            self.outcomes[key].record.end_s = 0.0
            t.cancel()
        if tasks:
            await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
        self.update()


async def run_replay(replay: Replay, *, url: str, prompts: PromptBuilder, model: str = "kvpool",
                     request_timeout_s: float = 300.0, grace_s: float = 0.0,
                     on_update: Callable[[int, int, int], None] | None = None,
                     stop: asyncio.Event | None = None) -> ReplayResult:
    """Drive ``replay`` against the server at ``url`` (see the module contract)."""
    stop = stop if stop is not None else asyncio.Event()
    wall0 = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        client = _Client(replay, http, url.rstrip("/"), model, prompts, request_timeout_s, on_update)

        def wake_on_stop() -> None:
            client.wake.set()

        watcher = asyncio.create_task(stop.wait())
        watcher.add_done_callback(lambda _t: wake_on_stop())
        try:
            interrupted = await client.drive(stop, grace_s)
        finally:
            watcher.cancel()
            await client.cancel_running("interrupted" if stop.is_set() else "still running at the end of the window")
    outcomes = [client.outcomes[k] for k in sorted(client.outcomes)]
    return ReplayResult(outcomes, interrupted, time.perf_counter() - wall0, window_end_s(replay, grace_s))
