"""The pool's Prometheus series in production mode: per stage on a prefill engine, for the deployment on the router.

Series (names and their simulator counterparts: docs/metrics.md):
    ``kvpool:pool_capacity_bytes{tier}``, ``kvpool:pool_used_bytes{tier}``, ``kvpool:pool_objects{tier}``
    (gauges), ``kvpool:pool_evicted_objects_total{tier}``, ``kvpool:pool_evicted_bytes_total{tier}``
    (counters: since the pool started), ``kvpool:pool_up`` (gauge, 1 or 0: every pool client reaches
    its pool; 0 while one has lost the Mooncake master and recomputes instead of loading and saving).
    A prefill engine labels each with ``stage`` (its stages' pool clients); the router exposes the
    deployment's pool without it.

Contract:
    * ``PoolSeries(registry, labels)`` registers a collector; ``set(rows)`` replaces what it
      exposes: one ``PoolRow`` per label set. A row without stats exposes only ``kvpool:pool_up``
      (and nothing when ``up`` is unknown too): a pool that does not answer has no capacity figure.
    * ``stage_rows(states)``: the engine's rows from its stages' ``pool`` answers (``None``: that
      stage did not answer in time: no row).
    * ``deployment_row(kind, engine_texts)``: the router's row from the prefill engines' ``/metrics``
      texts. Embedded pools are one per stage of each instance: their figures add up. A Mooncake pool
      is one pool every stage's client reads: each figure is the largest any stage reports (they
      read the same master moments apart). ``up`` is 0 if any stage reports 0, and unknown when no
      engine reported a stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpool.backend.pool.metrics import parse_prometheus

#: (series name without ``_total``, ``PoolStats`` field, kind, help)
FIGURES = (
    ("kvpool:pool_capacity_bytes", "capacity_bytes", "gauge", "Bytes the pool can hold"),
    ("kvpool:pool_used_bytes", "used_bytes", "gauge", "Bytes allocated to the pool's objects now"),
    ("kvpool:pool_objects", "key_count", "gauge", "Objects (one stage's chunk each) in the pool now"),
    ("kvpool:pool_evicted_objects", "evicted_key_count", "counter", "Objects the pool evicted since it started"),
    ("kvpool:pool_evicted_bytes", "evicted_bytes", "counter", "Bytes the pool evicted since it started"),
)
UP = "kvpool:pool_up"
UP_HELP = "1 when every pool client reaches its pool; 0 while one has lost the Mooncake master (prefill recomputes)"


@dataclass(frozen=True)
class PoolRow:
    """One label set's figures: ``labels`` (``tier`` among them), ``up`` (None: unknown), ``stats``
    (``PoolStats`` fields by name, or None)."""

    labels: dict[str, str]
    up: bool | None
    stats: dict[str, float] | None = None


class PoolSeries:
    """A collector of the pool's series over ``labels`` (``tier`` first; see the module docstring)."""

    def __init__(self, registry, labels: Sequence[str] = ("tier",)) -> None:
        self.labels = tuple(labels)
        self.up_labels = tuple(n for n in self.labels if n != "tier")
        self.rows: list[PoolRow] = []
        registry.register(self)

    def set(self, rows: Iterable[PoolRow]) -> None:
        self.rows = list(rows)

    def collect(self):
        families = []
        for name, key, kind, help_ in FIGURES:
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, help_, labels=self.labels)
            for row in self.rows:
                if row.stats is not None:
                    fam.add_metric([row.labels[n] for n in self.labels], float(row.stats[key]))
            families.append(fam)
        up = GaugeMetricFamily(UP, UP_HELP, labels=self.up_labels)
        for row in self.rows:
            if row.up is not None:
                up.add_metric([row.labels[n] for n in self.up_labels], 1.0 if row.up else 0.0)
        families.append(up)
        return families

    def describe(self):
        return []  # collected at scrape time only


def stage_rows(states: Sequence[dict | None]) -> list[PoolRow]:
    """The engine's rows: one per stage that answered its ``pool`` command."""
    rows = []
    for s, st in enumerate(states):
        if not st or not st.get("ok"):
            continue
        stats = st.get("stats")
        rows.append(PoolRow({"tier": str(st.get("tier", "dram")), "stage": str(s)}, bool(st.get("up")),
                            dict(stats) if isinstance(stats, dict) else None))
    return rows


def deployment_row(kind: str, engine_texts: Sequence[str]) -> PoolRow | None:
    """The router's row from the prefill engines' ``/metrics`` texts (see the module docstring)."""
    stats: dict[str, float] | None = None
    ups: list[bool] = []
    tier = "dram"
    for text in engine_texts:
        samples = parse_prometheus(text)
        ups += [v >= 1.0 for _, v in samples.get(UP, [])]
        per_stage: dict[str, dict[str, float]] = {}
        for name, key, kind_, _ in FIGURES:
            exposed = name + ("_total" if kind_ == "counter" else "")
            for labels, v in samples.get(exposed, []):
                tier = labels.get("tier", tier)
                per_stage.setdefault(labels.get("stage", "?"), {})[key] = v
        for figures in per_stage.values():
            if len(figures) != len(FIGURES):
                continue
            if stats is None:
                stats = dict(figures)
            elif kind == "mooncake":
                stats = {k: max(stats[k], figures[k]) for k in stats}
            else:
                stats = {k: stats[k] + figures[k] for k in stats}
    if not ups and stats is None:
        return None
    return PoolRow({"tier": tier}, all(ups) if ups else None, stats)


__all__ = ["FIGURES", "UP", "PoolRow", "PoolSeries", "deployment_row", "stage_rows"]
