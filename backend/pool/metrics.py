"""Read a Mooncake master's metrics endpoint (``/metrics``, Prometheus text) for ``pool status``.

Contract:
    * ``read_master_metrics(url)`` fetches ``{url}/metrics`` with a bounded timeout and returns a
      ``MasterMetrics``; it raises ``MetricsUnavailable`` (with the URL and the reason) when the
      master does not answer or the text lacks the capacity gauges.
    * Names used (mooncake-transfer-engine 0.3.13): ``master_total_capacity_bytes``,
      ``master_allocated_bytes``, ``master_key_count``, ``master_evicted_key_count``,
      ``master_evicted_size_bytes``, ``master_successful_evictions_total``,
      ``master_attempted_evictions_total``, ``master_active_clients`` and per segment
      ``segment_total_capacity_bytes{segment=...}`` / ``segment_allocated_bytes{segment=...}``.
      Missing counters read as 0.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass

from kvpool.backend.pool.api import PoolStats

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class MetricsUnavailable(RuntimeError):
    """The master's metrics endpoint did not answer usefully."""


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples by metric name: ``{name: [(labels, value), ...]}``; comments and junk are skipped."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


@dataclass(frozen=True)
class SegmentUse:
    """One store service's segment as the master sees it."""

    segment: str
    capacity_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class MasterMetrics:
    """Capacity, use, keys and evictions of one Mooncake master's pool."""

    capacity_bytes: int
    used_bytes: int
    key_count: int
    evicted_key_count: int
    evicted_bytes: int
    eviction_passes: int
    eviction_attempts: int
    active_clients: int
    segments: tuple[SegmentUse, ...]

    def to_pool_stats(self) -> PoolStats:
        return PoolStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.used_bytes,
            key_count=self.key_count,
            evicted_key_count=self.evicted_key_count,
            evicted_bytes=self.evicted_bytes,
            eviction_passes=self.eviction_passes,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["segments"] = [asdict(s) for s in self.segments]
        return d


def metrics_from_text(text: str) -> MasterMetrics:
    """``MasterMetrics`` from ``/metrics`` text; ``MetricsUnavailable`` if the gauges are absent."""
    samples = parse_prometheus(text)

    def scalar(name: str, required: bool = False) -> int:
        got = samples.get(name)
        if not got:
            if required:
                raise MetricsUnavailable(f"metric {name} missing from the master's /metrics")
            return 0
        return int(sum(v for _, v in got))

    caps = {lab.get("segment", "?"): int(v) for lab, v in samples.get("segment_total_capacity_bytes", [])}
    used = {lab.get("segment", "?"): int(v) for lab, v in samples.get("segment_allocated_bytes", [])}
    segments = tuple(SegmentUse(name, caps[name], used.get(name, 0)) for name in sorted(caps))
    return MasterMetrics(
        capacity_bytes=scalar("master_total_capacity_bytes", required=True),
        used_bytes=scalar("master_allocated_bytes", required=True),
        key_count=scalar("master_key_count", required=True),
        evicted_key_count=scalar("master_evicted_key_count"),
        evicted_bytes=scalar("master_evicted_size_bytes"),
        eviction_passes=scalar("master_successful_evictions_total"),
        eviction_attempts=scalar("master_attempted_evictions_total"),
        active_clients=scalar("master_active_clients"),
        segments=segments,
    )


def read_master_metrics(metrics_url: str, timeout_s: float = 2.0) -> MasterMetrics:
    """Fetch and parse ``{metrics_url}/metrics`` (``metrics_url`` like ``http://127.0.0.1:9003``)."""
    url = metrics_url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise MetricsUnavailable(f"no answer from {url}: {e}") from None
    return metrics_from_text(text)
