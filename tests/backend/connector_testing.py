"""Helpers of the connector tests: a reference engine (``backend.refmodel``) driving the real connector.

``Engine.serve`` is one prefill the way a PP engine runs it: fresh pages, lookup + all-stage load,
compute the rest, save the new full chunks. ``reference`` recomputes a prompt from scratch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvpool.backend.connector import StageAlignedConnector
from kvpool.backend.connector_data import SaveOutcome
from kvpool.backend.connector_metrics import ConnectorMetrics
from kvpool.backend.connector_scheduler import ConnectorScheduler, SchedulerConfig
from kvpool.backend.connector_worker import ConnectorWorker, WorkerConfig
from kvpool.backend.pool import Pool
from kvpool.backend.refmodel import RefConfig, RefModel, gather_tokens
from kvpool.policy.chunks import ChunkNaming, namespace_for
from kvpool.workload.records import RequestRecord

CHUNK = 256
#: 4 layers in 3 stages (uneven, like GLM's 20/20/20/18); bf16 records of 1,152 B.
REF_CONFIG = RefConfig(stage_layers=(2, 1, 1))
NUM_BLOCKS = 200  # 3,200 tokens of pages per stage


@functools.lru_cache(maxsize=2)
def model(device: str = "cpu") -> RefModel:
    if device == "cpu":
        torch.set_num_threads(1)  # 2 loaded cores: one thread is ~5x faster here, and the same in every path
    return RefModel(REF_CONFIG, device=device)


def prompt(n: int, seed: int, prefix: list[int] | None = None) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    tail = torch.randint(0, REF_CONFIG.vocab, (n - len(prefix or []),), generator=g).tolist()
    return (prefix or []) + tail


@dataclass
class Served:
    logits: torch.Tensor
    metrics: RequestRecord
    table: torch.Tensor
    save: SaveOutcome | None


class Engine:
    """Paged caches per stage, one ``StageAlignedConnector`` over ``pool``, the reference model."""

    def __init__(
        self,
        pool: Pool,
        keyspace: str,
        worker_config: WorkerConfig | None = None,
        sched_config: SchedulerConfig | None = None,
        metrics: ConnectorMetrics | None = None,
        device: str = "cpu",
    ) -> None:
        self.device = device
        self.model = model(device)
        self.spec = self.model.kv_spec()
        self.caches = self.model.new_caches(NUM_BLOCKS)
        ns = namespace_for(self.spec, CHUNK, extra={"test": keyspace})
        self.naming = ChunkNaming(ns, self.spec.stages)
        self.sched = ConnectorScheduler(pool, self.naming, self.spec, sched_config or SchedulerConfig(recheck_after_s=60))
        wc = worker_config or WorkerConfig(load_buffer_bytes=4 << 20, save_buffer_bytes=2 << 20, load_timeout_s=10, save_timeout_s=10)
        self.workers = [ConnectorWorker(pool, self.spec, s, self.caches[s], wc).start() for s in range(self.spec.stages)]
        self.conn = StageAlignedConnector(self.sched, self.workers, metrics)
        self.pool = pool
        self._serial = 0

    def new_table(self, n_tokens: int) -> torch.Tensor:
        """Fresh pages in a shuffled order (they hold other requests' stale bytes)."""
        self._serial += 1
        g = torch.Generator().manual_seed(1000 + self._serial)
        pages = -(-n_tokens // REF_CONFIG.page_tokens)
        return torch.randperm(NUM_BLOCKS, generator=g)[:pages].to(torch.int32).to(self.device)

    def serve(
        self, request_id: str, tokens: list[int], save: bool = True, on_round=None, gpu_hit_tokens: int = 0
    ) -> Served:
        """One prefill; ``gpu_hit_tokens`` > 0 first writes the reference KV of that prefix into the
        pages (a GPU prefix-cache hit)."""
        table = self.new_table(len(tokens))
        if gpu_hit_tokens:
            scatter_tokens(self.caches, table, [r[:gpu_hit_tokens] for r in _reference(tuple(tokens), self.device)[1]])
        self.conn.restore(request_id, tokens, table, gpu_hit_tokens=gpu_hit_tokens, on_round=on_round)
        logits = None
        for start, end in self.conn.compute_ranges(request_id):
            logits = self.model.prefill(tokens[:end], self.caches, table, start)
        assert logits is not None
        out = self.conn.save(request_id, table, len(tokens)) if save else None
        return Served(logits, self.conn.finish(request_id), table, out)

    def close(self) -> None:
        self.conn.close()


@functools.lru_cache(maxsize=8)
def _reference(tokens: tuple[int, ...], device: str = "cpu") -> tuple[torch.Tensor, list[torch.Tensor]]:
    m = model(device)
    caches = m.new_caches(-(-len(tokens) // REF_CONFIG.page_tokens))
    table = torch.arange(caches[0][0].shape[0], dtype=torch.int32, device=device)
    logits = m.prefill(list(tokens), caches, table, 0)
    return logits, [t.clone() for t in gather_tokens(caches, table, len(tokens))]


def assert_matches_reference(engine: Engine, served: Served, tokens: list[int]) -> None:
    """Bit-identical KV records of every layer and identical next-token logits to a full recompute."""
    ref_logits, ref_kv = _reference(tuple(tokens), engine.device)
    got = gather_tokens(engine.caches, served.table, len(tokens))
    assert len(got) == len(ref_kv)
    for i, (a, b) in enumerate(zip(got, ref_kv)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"KV of cache {i} differs from the recompute"
    assert torch.equal(served.logits, ref_logits), "next-token logits differ from the recompute"


def scatter_tokens(caches: list[list[torch.Tensor]], block_ids: torch.Tensor, records: list[torch.Tensor]) -> None:
    """Inverse of ``gather_tokens``: write each cache's first ``n`` records through a block table."""
    flat = [c for stage in caches for c in stage]
    table = block_ids.reshape(-1).to(torch.long)
    for cache, rec in zip(flat, records):
        P, n = cache.shape[1], rec.shape[0]
        full = n // P
        cache[table[:full]] = rec[: full * P].view(full, P, -1)
        if n % P:
            cache[table[full], : n % P] = rec[full * P :]


def prime(engine: Engine, request_id: str, tokens: list[int]) -> SaveOutcome | None:
    """Save a prompt's history through the real save path without computing it again: the pages
    get the reference KV (as if prefill had just written them), then every stage packs and puts."""
    table = engine.new_table(len(tokens))
    engine.conn.restore(request_id, tokens, table)
    scatter_tokens(engine.caches, table, _reference(tuple(tokens), engine.device)[1])
    out = engine.conn.save(request_id, table, len(tokens))
    engine.conn.finish(request_id)
    return out
