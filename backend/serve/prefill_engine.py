"""A prefill engine process: HTTP for the router, the scheduler side of one prefill instance.

Started as ``python -m kvpool.backend.serve.prefill_engine --plan PLAN --name NAME`` after its
stages. It waits for every stage's ready file (``STAGE_READY_WAIT_S`` each), pings them, then
serves aiohttp on ``127.0.0.1:0`` and writes its ready file ``{"pid", "url": "http://127.0.0.1:PORT"}``.
The work is ``backend.serve.prefill_scheduler.PrefillScheduler`` on its own thread.

Routes (bodies JSON; every non-2xx answer is ``{"error": reason}``):
    ``POST /prefill``  ``protocol.PrefillRequest`` -> ``protocol.PrefillResult`` (200):
        ``first_token`` (greedy), ``record`` (the ``RequestRecord`` fields prefill knows: ``key``,
        ``session``, ``in_tokens``, ``prefill``, ``decode``, ``gpu_tokens``, ``pool_tokens``,
        ``computed_tokens``, ``restore_stage_s``, ``restore_spread_s``, ``restore_failed``,
        ``restore_bytes``, ``save_bytes``, ``handoff_bytes``, ``handoff_writes``, ``handoff_s``,
        ``save_s``, ``prefill_start_s`` / ``prefill_end_s`` (seconds after the engine received the request),
        ``lookup_answered``), ``descriptor`` ``{"decode_instance": d, "stages": pp}``.
        400: not JSON, or not a valid ``PrefillRequest`` (the ``ProtocolError`` text), or a
        ``decode_instance`` the plan does not have. 413: the prompt needs more pages than the
        prefill KV holds (names ``serve.prefill_kv_tokens``). 409: the ``request_id`` is already
        being prefilled. 502: the hand-off to the decode instance failed (the stage's reason; the
        decode side's ``CreditTimeout``/``PeerLost``/deadline are bounded by
        ``HANDOFF_TIMEOUT_S``). 503: a stage died or missed a deadline (named), or the engine
        stops. 504: no answer within ``serve.request_timeout_s``.
    ``GET /health``  ``protocol.Health``: ``ok`` (200), ``starting`` or ``failed`` (503, with the
        reason in ``detail.error``). ``detail.pool_up`` lists, per stage, whether its pool client
        reaches its pool (null: the stage did not answer within ``POOL_HEALTH_WAIT_S``); a lost pool
        is no failure (prefill recomputes), so the status stays ``ok``.
    ``GET /metrics``  Prometheus text of this engine's own registry (``METRICS`` lists the series);
        the pool's series come from the stages' ``pool`` command, asked at each scrape (bounded by
        ``POOL_METRICS_WAIT_S``, ``backend.serve.pool_metrics``).

The pool questions go through a stage client of their own (``PoolInfo``, one thread), so they never
wait behind the scheduler's work.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time

from kvpool.backend.serve.handoff_plan import write_cap_bytes
from kvpool.backend.serve.plan import ServePlan, Worker, wait_ready, worker_of_argv, write_ready

STAGE_READY_WAIT_S = 180.0
HANDOFF_TIMEOUT_S = 30.0
#: Bound on the stages' pool answers for one ``/metrics`` scrape (a Mooncake stage reads the master's metrics).
POOL_METRICS_WAIT_S = 1.0
#: Bound on the stages' pool state for one ``/health`` answer.
POOL_HEALTH_WAIT_S = 0.5

#: The Prometheus series of ``/metrics`` (names as exposed; counters end in ``_total``).
METRICS = (
    "kvpool:prompt_tokens_by_source_total{source=gpu|pool|computed}",
    "kvpool:prompt_tokens_total",
    "kvpool:prefill_requests_total{outcome=ok|error}",
    "kvpool:restore_bytes_total",
    "kvpool:restore_seconds (histogram: first stage's start to last stage's end of each load)",
    "kvpool:restore_stage_seconds{stage} (histogram)",
    "kvpool:save_bytes_total",
    "kvpool:save_seconds (histogram: a save, its send to the last stage's reply)",
    "kvpool:handoff_bytes_total",
    "kvpool:handoff_writes_total",
    "kvpool:handoff_seconds (histogram)",
    "kvpool:prefill_kv_usage_perc (gauge: pages referenced by requests / pages)",
    "kvpool:prefill_kv_cached_blocks (gauge)",
    "kvpool:prefill_kv_blocks (gauge)",
    "kvpool:prefill_waiting_requests, kvpool:prefill_running_requests (gauges)",
    "kvpool:prefill_steps_done, kvpool:prefill_step_tokens_done (gauges: chunked-prefill steps, their tokens)",
    "kvpool:prefill_step_requests, kvpool:prefill_step_tokens (histograms: requests and tokens per step)",
    "kvpool:pool_capacity_bytes, kvpool:pool_used_bytes, kvpool:pool_objects {tier, stage} (gauges)",
    "kvpool:pool_evicted_objects_total, kvpool:pool_evicted_bytes_total {tier, stage}",
    "kvpool:pool_up{stage} (gauge: 1 when the stage's pool client reaches its pool)",
    "kvpool_connector_* (backend.connector_metrics)",
)

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class PoolInfo:
    """The stages' pool answers (the stages' ``pool`` command) through a stage client used by one thread only."""

    def __init__(self, endpoints: list[str]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.endpoints = endpoints
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="prefill-pool-info")
        self._client = None

    def _states(self, with_stats: bool, timeout_s: float) -> list[dict | None]:
        import zmq

        from kvpool.backend.serve import stage_link as link

        if self._client is None:
            self._client = link.StageClient(zmq.Context.instance(), self.endpoints)
        n = len(self.endpoints)
        got = self._client.call_all(list(range(n)), "pool", [{"stats": with_stats}] * n, timeout_s)
        self._client.poll()  # late answers of an earlier question are of no use
        return got

    async def states(self, with_stats: bool, timeout_s: float) -> list[dict | None]:
        """Each stage's ``pool`` answer, or ``None`` for a stage that did not answer within ``timeout_s``."""
        return await asyncio.wrap_future(self._exec.submit(self._states, with_stats, timeout_s))

    def close(self) -> None:
        self._exec.shutdown(wait=False, cancel_futures=True)


class EngineMetrics:
    """The engine's Prometheus registry (see ``METRICS``)."""

    def __init__(self, sched) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from kvpool.backend.connector_metrics import ConnectorMetrics
        from kvpool.backend.serve.pool_metrics import PoolSeries

        r = self.registry = CollectorRegistry()
        self.by_source = Counter("kvpool:prompt_tokens_by_source", "Prompt tokens by where their KV came from",
                                 ["source"], registry=r)
        for src in ("gpu", "pool", "computed"):
            self.by_source.labels(src)
        self.prompt = Counter("kvpool:prompt_tokens", "Prompt tokens prefilled (the denominator of the sources)", registry=r)
        self.requests = Counter("kvpool:prefill_requests", "Prefill requests answered", ["outcome"], registry=r)
        self.restore_bytes = Counter("kvpool:restore_bytes", "Bytes loaded from the pool", registry=r)
        self.restore_s = Histogram("kvpool:restore_seconds", "Load time, first stage's start to last stage's end",
                                   buckets=SECONDS_BUCKETS, registry=r)
        self.restore_stage_s = Histogram("kvpool:restore_stage_seconds", "Load time per stage", ["stage"],
                                         buckets=SECONDS_BUCKETS, registry=r)
        self.save_bytes = Counter("kvpool:save_bytes", "Bytes written to the pool", registry=r)
        self.save_s = Histogram("kvpool:save_seconds", "Save time, its send to the last stage's reply",
                                buckets=SECONDS_BUCKETS, registry=r)
        self.handoff_bytes = Counter("kvpool:handoff_bytes", "Bytes handed to decode", registry=r)
        self.handoff_writes = Counter("kvpool:handoff_writes", "Hand-off writes", registry=r)
        self.handoff_s = Histogram("kvpool:handoff_seconds", "Hand-off time, first stage's start to last stage's end",
                                   buckets=SECONDS_BUCKETS, registry=r)
        Gauge("kvpool:prefill_kv_usage_perc", "Fraction of prefill KV pages referenced by requests",
              registry=r).set_function(lambda: sched.blocks.used_blocks / sched.blocks.num_blocks)
        Gauge("kvpool:prefill_kv_cached_blocks", "Pages in the GPU prefix cache",
              registry=r).set_function(lambda: sched.blocks.cached_blocks)
        Gauge("kvpool:prefill_kv_blocks", "Prefill KV pages per stage", registry=r).set_function(lambda: sched.blocks.num_blocks)
        Gauge("kvpool:prefill_waiting_requests", "Requests waiting for pages", registry=r).set_function(lambda: sched.waiting)
        Gauge("kvpool:prefill_running_requests", "Requests admitted", registry=r).set_function(lambda: sched.running)
        Gauge("kvpool:prefill_steps_done", "Chunked-prefill steps done", registry=r).set_function(lambda: sched.steps_done)
        Gauge("kvpool:prefill_step_tokens_done", "Tokens computed in steps", registry=r).set_function(lambda: sched.step_tokens_done)
        for name, doc, series in (
                ("forward", "Seconds each stage spent in its layers' forward pass", sched.stage_forward_s),
                ("queued", "Seconds each stage's compute steps waited behind its earlier ones", sched.stage_queued_s),
                ("handled", "Seconds from each compute command's arrival at the stage to its answer being ready",
                 sched.stage_handled_s),
                ("round_trip", "Seconds from each compute command's send to its answer's arrival at the engine",
                 sched.stage_round_trip_s)):
            gauge = Gauge(f"kvpool:prefill_stage_{name}_seconds", doc, ["stage"], registry=r)
            for stage in range(sched.pp):
                gauge.labels(str(stage)).set_function(lambda stage=stage, series=series: series[stage])
        Gauge("kvpool:prefill_pending_seconds", "Seconds the engine held prompt tokens not yet computed",
              registry=r).set_function(lambda: sched.pending_s)
        Gauge("kvpool:prefill_computable_seconds",
              "Seconds of the pending time with a step in flight or tokens a step could take",
              registry=r).set_function(lambda: sched.computable_s)
        Gauge("kvpool:prefill_loading_only_seconds",
              "Seconds of the pending time with nothing computable and a request loading from the pool",
              registry=r).set_function(lambda: sched.loading_only_s)
        Gauge("kvpool:prefill_steps_in_flight_seconds",
              "Steps in the pipeline integrated over the time the engine held prompt tokens not yet computed",
              registry=r).set_function(lambda: sched.steps_in_flight_s)
        self.step_requests = Histogram("kvpool:prefill_step_requests", "Requests with a chunk in a prefill step",
                                       buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.step_tokens = Histogram("kvpool:prefill_step_tokens", "Tokens computed in a prefill step",
                                     buckets=(16, 64, 256, 1024, 4096, 16384, 65536), registry=r)
        self.connector = ConnectorMetrics(r)
        self.pool = PoolSeries(r, ("tier", "stage"))

    def observe_step(self, requests: int, tokens: int) -> None:
        self.step_requests.observe(requests)
        self.step_tokens.observe(tokens)

    def observe(self, rec, outcome) -> None:
        ok = outcome.status == 200
        self.requests.labels("ok" if ok else "error").inc()
        if not ok and not rec.in_tokens:
            return
        self.prompt.inc(rec.in_tokens)
        self.by_source.labels("gpu").inc(rec.gpu_tokens)
        self.by_source.labels("pool").inc(rec.pool_tokens)
        self.by_source.labels("computed").inc(rec.computed_tokens)
        self.restore_bytes.inc(rec.restore_bytes)
        if rec.restore_stage_s:
            self.restore_s.observe(rec.restore_spread_s)
            for s, t in enumerate(rec.restore_stage_s):
                self.restore_stage_s.labels(str(s)).observe(t)
        self.save_bytes.inc(rec.save_bytes)
        if rec.save_s:
            self.save_s.observe(rec.save_s)
        self.handoff_bytes.inc(rec.handoff_bytes)
        self.handoff_writes.inc(rec.handoff_writes)
        if rec.handoff_bytes:
            self.handoff_s.observe(rec.handoff_s)
        self.connector.observe(rec)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def build_scheduler(plan: ServePlan, worker: Worker, stage_ready: list[dict]):
    """The scheduler of prefill instance ``worker.instance`` over its stages' ready files."""
    from kvpool.backend.connector_scheduler import SchedulerConfig
    from kvpool.backend.serve.blocks import BlockManager
    from kvpool.backend.serve.model_config import ref_config
    from kvpool.backend.serve.prefill_scheduler import PrefillScheduler, SchedulerSettings
    from kvpool.policy.chunks import ChunkNaming, chain_seed

    sc = plan.scenario_model()
    cfg = ref_config(sc)
    spec = cfg.kv_spec(sc.model.name)  # = RefModel.kv_spec: the latents and the indexer records
    naming = ChunkNaming(pool_namespace(sc, spec), spec.stages)
    blocks = BlockManager(sc.serve.prefill_kv_tokens // cfg.page_tokens, cfg.page_tokens,
                          chain_seed(naming.namespace, "gpu-prefix-cache"))
    settings = SchedulerSettings(sc.prefill.max_batched_tokens, cfg.page_tokens, tuple(cfg.stage_layers), cfg.record_bytes,
                                 write_cap_bytes(sc), HANDOFF_TIMEOUT_S, worker.instance, sc.prefill.spread_requests)
    sched_cfg = SchedulerConfig(chunk_tokens=sc.pool.chunk_tokens, page_tokens=cfg.page_tokens,
                                min_load_tokens=sc.pool.min_load_tokens, recheck_after_s=1.0)
    stages = plan.stages_of(worker.instance)
    decodes = {w.instance: w for w in plan.by_role("decode_engine")}
    return PrefillScheduler(settings, blocks, naming, spec, sched_cfg, [r["endpoint"] for r in stage_ready],
                            [int(r.get("pid", 0)) for r in stage_ready], [w.name for w in stages],
                            lambda d: plan.ready_path(decodes[d].name))


def pool_namespace(scenario, spec) -> str:
    """The pool key namespace: KV geometry, chunk size and the model's identity (shape, seed, dtype)."""
    from kvpool.policy.chunks import namespace_for

    s = scenario.serve
    extra = {"model": "refmodel", "seed": s.model_seed, "d_model": s.d_model, "heads": s.heads, "nope_dim": s.nope_dim,
             "v_dim": s.v_dim, "ffn_dim": s.ffn_dim, "vocab": s.vocab, "cache_dtype": s.cache_dtype}
    if spec.extra_records:  # the DSA indexer's shape changes every later layer's KV
        extra.update(index_topk=s.index_topk, index_heads=s.index_heads, index_dim=s.index_dim)
    return namespace_for(spec, scenario.pool.chunk_tokens, extra=extra)


def make_app(plan: ServePlan, worker: Worker, sched, metrics: EngineMetrics, info: PoolInfo):
    from aiohttp import web

    from kvpool.backend.serve import http_errors

    from kvpool.backend.serve.protocol import Health, PrefillRequest, ProtocolError

    sc = plan.scenario_model()
    decodes = {w.instance for w in plan.by_role("decode_engine")}
    capacity = sched.blocks.capacity_tokens

    def error(status: int, reason: str):
        return web.json_response({"error": reason}, status=status)

    async def prefill(request: web.Request):
        try:
            body = json.loads(await http_errors.read_body(request))
        except (ValueError, RecursionError) as e:
            return error(400, f"body: not JSON ({e})")
        try:
            req = PrefillRequest.from_json(body, vocab=sc.serve.vocab)
        except ProtocolError as e:
            return error(400, str(e))
        if req.decode_instance not in decodes:
            return error(400, f"decode_instance: expected one of {sorted(decodes)}, got {req.decode_instance}")
        if len(req.token_ids) > capacity:
            return error(413, f"token_ids: a prompt of {len(req.token_ids)} tokens exceeds the prefill KV room of "
                              f"{capacity} tokens (serve.prefill_kv_tokens)")
        if sched.broken:
            return error(503, sched.broken)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(outcome) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(outcome))

        sched.submit(req.request_id, req.token_ids, req.decode_instance, req.session, done)
        try:
            outcome = await asyncio.wait_for(fut, sc.serve.request_timeout_s)
        except asyncio.TimeoutError:
            sched.cancel(req.request_id)
            return error(504, f"request {req.request_id}: no prefill answer within {sc.serve.request_timeout_s:g} s "
                              "(serve.request_timeout_s)")
        return web.json_response(outcome.body, status=outcome.status)

    async def health(request: web.Request):
        if sched.broken:
            h = Health("failed", "prefill_engine", worker.instance, {"error": sched.broken})
            return web.json_response(h.to_json(), status=503)
        if not sched.started.is_set():
            return web.json_response(Health("starting", "prefill_engine", worker.instance).to_json(), status=503)
        states = await info.states(False, POOL_HEALTH_WAIT_S)
        detail = {"stages": sched.pp, "kv_blocks": sched.blocks.num_blocks, "cached_blocks": sched.blocks.cached_blocks,
                  "running": sched.running, "waiting": sched.waiting,
                  "pool_up": [bool(st["up"]) if st and st.get("ok") else None for st in states]}
        return web.json_response(Health("ok", "prefill_engine", worker.instance, detail).to_json())

    async def metrics_route(request: web.Request):
        from prometheus_client import CONTENT_TYPE_LATEST

        from kvpool.backend.serve.pool_metrics import stage_rows

        metrics.pool.set(stage_rows(await info.states(True, POOL_METRICS_WAIT_S)))
        return web.Response(body=metrics.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=64 << 20, middlewares=[http_errors.json_errors()])
    app.add_routes([web.post("/prefill", prefill), web.get("/health", health), web.get("/metrics", metrics_route)])
    return app


async def _serve(plan: ServePlan, worker: Worker, sched, metrics: EngineMetrics, info: PoolInfo,
                 stop: asyncio.Event) -> None:
    from aiohttp import web

    from kvpool.backend.serve import http_errors

    runner = http_errors.runner(make_app(plan, worker, sched, metrics, info), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    write_ready(plan.ready_path(worker.name), {"url": f"http://127.0.0.1:{port}"})
    print(json.dumps({"serving": worker.name, "url": f"http://127.0.0.1:{port}"}), flush=True)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    plan, worker = worker_of_argv("prefill_engine", argv)
    try:
        ready = [wait_ready(plan.ready_path(w.name), STAGE_READY_WAIT_S) for w in plan.stages_of(worker.instance)]
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sched = build_scheduler(plan, worker, ready)
    info = PoolInfo([r["endpoint"] for r in ready])
    metrics = EngineMetrics(sched)
    sched.on_finish = metrics.observe
    sched.on_step = metrics.observe_step
    thread = threading.Thread(target=sched.run, name="prefill-scheduler", daemon=True)
    thread.start()
    if not sched.started.wait(60.0) or sched.broken:
        print(f"error: the stages did not answer: {sched.broken or 'no ping answer within 60 s'}", file=sys.stderr)
        return 1
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    t0 = time.monotonic()
    try:
        loop.run_until_complete(_serve(plan, worker, sched, metrics, info, stop))
    finally:
        info.close()
        sched.shutdown()
        thread.join(timeout=5.0)
        print(json.dumps({"stopped": worker.name, "after_s": round(time.monotonic() - t0, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
