"""The router's Prometheus metrics (``GET /metrics``); names and their simulator counterparts: docs/metrics.md.

Contract:
    * ``RouterMetrics()`` owns one ``prometheus_client.CollectorRegistry`` (never the global one,
      so several routers in one process keep separate counts); ``render()`` is its text exposition.
    * ``observe_record(record)`` adds a finished request's prompt tokens by source (``gpu``,
      ``pool`` = pool + SSD tokens, ``computed``) and its prompt tokens (the denominator), as
      ``summarize`` counts them for ``share_gpu`` / ``share_pool`` / ``share_computed``.
    * ``pool``: the deployment's pool series (``backend.serve.pool_metrics.PoolSeries``), set by the
      router from the prefill engines' before each render.
    * Outcomes of ``kvpool:requests_total``: ``ok``, ``bad_request`` (4xx before the gate),
      ``rejected`` (the gate's verdict), ``error`` (an engine failed or timed out), ``cancelled``
      (the client went away).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvpool.backend.serve.pool_metrics import PoolSeries
from kvpool.workload.records import RequestRecord

OUTCOMES = ("ok", "bad_request", "rejected", "error", "cancelled")
SOURCES = ("gpu", "pool", "computed")
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.gate_admitted = Counter("kvpool:gate_admitted", "Requests the admission gate admitted (at once or after waiting)", registry=r)
        self.gate_rejected = Counter("kvpool:gate_rejected", "Requests the admission gate rejected, by verdict", ["reason"], registry=r)
        self.gate_waiting = Gauge("kvpool:gate_waiting", "Requests waiting at the admission gate now", registry=r)
        self.running = Gauge("kvpool:requests_running", "Admitted requests in flight now", registry=r)
        self.requests = Counter("kvpool:requests", "Finished completion requests, by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("kvpool:time_to_first_token_seconds", "Arrival at the router to the first token",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("kvpool:inter_token_latency_seconds", "Time between successive tokens of a request "
                             "(a chunk of several tokens counts as that many equal gaps)", buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("kvpool:e2e_request_latency_seconds", "Arrival at the router to the last token",
                             buckets=E2E_BUCKETS_S, registry=r)
        self.prompt_by_source = Counter("kvpool:prompt_tokens_by_source", "Prompt tokens of finished requests by where "
                                        "their KV came from (gpu prefix cache, pool, computed)", ["source"], registry=r)
        self.prompt_tokens = Counter("kvpool:prompt_tokens", "Prompt tokens of finished requests (the denominator of "
                                     "prompt_tokens_by_source)", registry=r)
        self.generation_tokens = Counter("kvpool:generation_tokens", "Tokens generated for finished requests", registry=r)
        self.pool = PoolSeries(r, ("tier",))
        for o in OUTCOMES:
            self.requests.labels(outcome=o)
        for s in SOURCES:
            self.prompt_by_source.labels(source=s)

    def observe_record(self, rec: RequestRecord) -> None:
        """Count a finished request's prompt tokens by source and its generated tokens."""
        self.prompt_by_source.labels(source="gpu").inc(rec.gpu_tokens)
        self.prompt_by_source.labels(source="pool").inc(rec.pool_tokens + rec.ssd_tokens)
        self.prompt_by_source.labels(source="computed").inc(rec.computed_tokens)
        self.prompt_tokens.inc(rec.in_tokens)
        self.generation_tokens.inc(rec.out_tokens)

    def observe_gaps(self, gap_s: float, tokens: int) -> None:
        """``tokens`` arrived ``gap_s`` after the previous ones: ``tokens`` gaps of ``gap_s / tokens``."""
        if tokens <= 0:
            return
        each = gap_s / tokens
        for _ in range(tokens):
            self.itl.observe(each)

    def render(self) -> bytes:
        return generate_latest(self.registry)
