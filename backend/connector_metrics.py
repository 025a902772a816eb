"""Prometheus export of the connector's per-request metrics (definitions: docs/metrics.md).

``ConnectorMetrics(registry)`` turns finished ``RequestRecord`` records (``kvpool.workload.records``,
the simulator's record type) into Prometheus series.
It owns no global state: pass a ``prometheus_client.CollectorRegistry`` (a fresh one by default),
read it with ``text()``, or serve it with ``serve(port)`` -- on 127.0.0.1 unless told otherwise.

| series | type | from ``RequestRecord`` (docs/metrics.md name) |
|---|---|---|
| ``kvpool_connector_requests_total{outcome}`` | counter | one per request: ``no_load``, ``loaded``, ``load_failed``, ``no_answer`` |
| ``kvpool_connector_gpu_tokens_total`` | counter | ``gpu_tokens`` |
| ``kvpool_connector_pool_tokens_total`` | counter | ``pool_tokens`` |
| ``kvpool_connector_ssd_tokens_total`` | counter | ``ssd_tokens`` (0 in the backend: its pool reads are ``pool_tokens``) |
| ``kvpool_connector_computed_tokens_total`` | counter | ``computed_tokens`` |
| ``kvpool_connector_restore_stage_seconds{stage}`` | histogram | ``restore_stage_s`` (per stage, loads that ran) |
| ``kvpool_connector_restore_spread_seconds`` | histogram | ``restore_spread_s`` (loads that ran) |
| ``kvpool_connector_restore_bytes_total`` | counter | ``restore_bytes`` |
| ``kvpool_connector_save_bytes_total`` | counter | ``save_bytes`` |
"""

from __future__ import annotations

from kvpool.workload.records import RequestRecord

#: Histogram buckets for restore times (the seed: 150-220 ms per stage, 0.4-1.2 s spread).
RESTORE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0, 30.0)


class ConnectorMetrics:
    """Prometheus series of the connector (see the module docstring)."""

    def __init__(self, registry=None, prefix: str = "kvpool_connector") -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry() if registry is None else registry
        r, p = self.registry, prefix
        self.requests = Counter(f"{p}_requests", "Requests by load outcome", ["outcome"], registry=r)
        self.gpu_tokens = Counter(f"{p}_gpu_tokens", "Prompt tokens from the GPU prefix cache", registry=r)
        self.pool_tokens = Counter(f"{p}_pool_tokens", "Prompt tokens loaded from the pool", registry=r)
        self.ssd_tokens = Counter(f"{p}_ssd_tokens", "Prompt tokens loaded from a pool's SSD tier", registry=r)
        self.computed_tokens = Counter(f"{p}_computed_tokens", "Prompt tokens computed by prefill", registry=r)
        self.restore_stage = Histogram(
            f"{p}_restore_stage_seconds", "Per stage: load start to objects read and unpacked", ["stage"],
            buckets=RESTORE_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.restore_spread = Histogram(
            f"{p}_restore_spread_seconds", "First stage starting its load to the last stage finishing it",
            buckets=RESTORE_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.restore_bytes = Counter(f"{p}_restore_bytes", "Bytes read from the pool", registry=r)
        self.save_bytes = Counter(f"{p}_save_bytes", "Bytes written to the pool", registry=r)

    def observe(self, m: RequestRecord) -> None:
        """Add one finished request."""
        if not m.lookup_answered:
            outcome = "no_answer"
        elif m.restore_failed:
            outcome = "load_failed"
        elif m.pool_tokens or m.ssd_tokens:
            outcome = "loaded"
        else:
            outcome = "no_load"
        self.requests.labels(outcome).inc()
        self.gpu_tokens.inc(m.gpu_tokens)
        self.pool_tokens.inc(m.pool_tokens)
        self.ssd_tokens.inc(m.ssd_tokens)
        self.computed_tokens.inc(m.computed_tokens)
        for stage, s in enumerate(m.restore_stage_s):
            self.restore_stage.labels(str(stage)).observe(s)
        if m.restore_stage_s:
            self.restore_spread.observe(m.restore_spread_s)
        self.restore_bytes.inc(m.restore_bytes)
        self.save_bytes.inc(m.save_bytes)

    def text(self) -> str:
        """The registry in Prometheus text format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def serve(self, port: int = 0, addr: str = "127.0.0.1"):
        """Serve ``/metrics`` over HTTP (127.0.0.1 by default); returns ``(server, thread)``."""
        from prometheus_client import start_http_server

        return start_http_server(port, addr=addr, registry=self.registry)
