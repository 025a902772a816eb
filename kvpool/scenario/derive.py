"""What follows from a scenario: KV sizes, GPU KV capacities, pool capacity, the handoff plan.

``summarize`` returns the plain dict behind ``kvpool scenario show --json``; its top-level keys are
documented in ``docs/scenario.md`` and relied on by scripts and the dashboard.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.policy.chunks import namespace_for
from kvpool.policy.layout import HandoffPlan
from kvpool.scenario.model import Scenario

GB = 10**9
GIB = 1 << 30
TIB = 1 << 40
HISTORY_PER_SESSION_BYTES = 10 * GIB  # the seed's estimate of reusable history per live session
HANDOFF_EXAMPLE_TOKENS = 8192  # the seed's handoff example: one 8,192-token chunk


def free_kv_bytes_per_gpu(hbm_gb: float, utilization: float, weights_gb: float, gpus: int, reserved_gb: float) -> int:
    """HBM x utilization, less this GPU's share of the weights and its reserve, in bytes (>= 0)."""
    return max(0, round((hbm_gb * utilization - weights_gb / gpus - reserved_gb) * GB))


def prefill_gpu_kv_bytes_per_gpu(s: Scenario) -> int:
    p = s.prefill
    return free_kv_bytes_per_gpu(s.gpu.hbm_gb, p.gpu_mem_utilization, s.model.weights_gb, p.gpus, p.reserved_gb_per_gpu)


def decode_gpu_kv_bytes_per_gpu(s: Scenario) -> int:
    d = s.decode
    return free_kv_bytes_per_gpu(s.gpu.hbm_gb, d.gpu_mem_utilization, s.model.weights_gb, d.gpus, d.reserved_gb_per_gpu)


def prefill_kv_capacity_tokens(s: Scenario) -> int:
    """Tokens one prefill instance's GPUs can cache: each stage's GPUs hold every token of its layers
    (the MLA latent is replicated over TP ranks), so the fullest stage decides. With
    ``cost.kv_capacity = "serve"``: ``serve.prefill_kv_tokens``, the paged KV every stage of a
    ``kvpool serve`` prefill engine holds (one block table for all stages)."""
    if s.cost.kv_capacity == "serve":
        return s.serve.prefill_kv_tokens
    free = prefill_gpu_kv_bytes_per_gpu(s)
    return min(free // b for b in s.kvspec().stage_bytes_per_token)


def decode_kv_capacity_tokens(s: Scenario) -> int:
    """Tokens one decode instance can hold: DCP spreads tokens over ``dcp`` ranks, each holding all layers.
    With ``cost.kv_capacity = "serve"``: ``serve.decode_kv_tokens`` (rounded up to whole pages per
    DCP rank, as the decode engine allocates them)."""
    if s.cost.kv_capacity == "serve":
        return serve_decode_kv_tokens(s)
    return decode_gpu_kv_bytes_per_gpu(s) // s.kvspec().bytes_per_token * s.decode.dcp


def serve_decode_kv_tokens(s: Scenario) -> int:
    """Tokens one ``kvpool serve`` decode engine holds: ``serve.decode_kv_tokens`` rounded up to
    whole pages per DCP rank, as the engine allocates them."""
    per_rank_pages = -(-s.serve.decode_kv_tokens // (s.decode.dcp * s.model.page_tokens))
    return per_rank_pages * s.model.page_tokens * s.decode.dcp


@dataclass(frozen=True)
class ServeDevices:
    """Where ``kvpool serve``'s workers compute (``serve_devices``)."""

    prefill: tuple[tuple[str, ...], ...]  # per prefill instance: each stage's device
    decode: tuple[tuple[str, ...], ...]  # per decode instance: each TP rank's device


def serve_devices(s: Scenario, devices: tuple[str, ...] | None = None) -> ServeDevices:
    """The devices of ``kvpool serve``'s workers: ``devices`` (default ``serve.devices``) taken in
    order -- every prefill instance's ``prefill.pp`` stages, then every decode instance's
    ``decode.tp`` ranks -- wrapping around, so several workers may share one device."""
    devs = tuple(devices) if devices else tuple(s.serve.devices)
    taken = 0

    def take(n: int) -> tuple[str, ...]:
        nonlocal taken
        out = tuple(devs[(taken + k) % len(devs)] for k in range(n))
        taken += n
        return out

    prefill = tuple(take(s.prefill.pp) for _ in range(s.prefill.instances))
    decode = tuple(take(s.decode.tp) for _ in range(s.decode.instances))
    return ServeDevices(prefill, decode)


def pool_capacity_bytes(s: Scenario) -> int:
    return int(s.cluster.servers * s.pool.services_per_server * s.pool.gib_per_service * GIB)


def handoff_plan(s: Scenario, tokens: int = HANDOFF_EXAMPLE_TOKENS) -> HandoffPlan:
    """The handoff of ``tokens`` tokens of the largest prefill stage's MLA records to the decode ranks.

    The main record is what crosses in large writes (ATOM's landing path); extra records such as
    the DSA index cache travel their own path and are not part of this plan.
    """
    spec = s.kvspec()
    layers = max(len(spec.stage_layer_ids(i)) - (s.model.mtp_layers if i == spec.stages - 1 else 0)
                 for i in range(spec.stages))
    return HandoffPlan(
        tokens=tokens,
        layers=layers,
        record_bytes=s.model.record_bytes,
        ranks=s.decode.dcp,
        max_write_bytes=s.handoff.max_write_bytes,
    )


def summarize(s: Scenario) -> dict:
    """Everything ``kvpool scenario show`` prints, as plain values."""
    spec = s.kvspec()
    bpt = spec.bytes_per_token
    prefill_gpu_bytes = prefill_gpu_kv_bytes_per_gpu(s) * s.prefill.gpus * s.prefill.instances
    pool_bytes = pool_capacity_bytes(s)
    copies = s.prefill.tp  # TP ranks each save their replica of the MLA latent
    plan = handoff_plan(s)
    prefill_tokens = prefill_kv_capacity_tokens(s)
    return {
        "name": s.name,
        "namespace": namespace_for(spec, s.pool.chunk_tokens),
        "gpus": s.prefill.instances * s.prefill.gpus + s.decode.instances * s.decode.gpus,
        "kv_bytes_per_token": bpt,
        "kv_bytes_per_token_per_stage": list(spec.stage_bytes_per_token),
        "chunk_tokens": s.pool.chunk_tokens,
        "chunk_object_bytes_per_stage": [spec.chunk_object_bytes(i, s.pool.chunk_tokens) for i in range(spec.stages)],
        "prefill_gpu_kv_bytes": prefill_gpu_bytes,
        "prefill_gpu_kv_capacity_tokens": prefill_tokens,
        "decode_gpu_kv_capacity_tokens": decode_kv_capacity_tokens(s),
        "pool_capacity_bytes": pool_bytes,
        "pool_capacity_tib": pool_bytes / TIB,
        "pool_capacity_tokens": pool_bytes // (bpt * copies),
        "pool_copies_per_token": copies,
        "pool_to_prefill_gpu_kv_ratio": pool_bytes / prefill_gpu_bytes if prefill_gpu_bytes else None,
        "pool_sessions_10gib": pool_bytes / (HISTORY_PER_SESSION_BYTES * copies),  # each copy takes its room
        "handoff_tokens": plan.tokens,
        "handoff_stage_layers": plan.layers,
        "handoff_bytes": plan.total_bytes,
        "handoff_writes_naive": plan.naive_writes,
        "handoff_writes_batched": plan.batched_writes,
        "handoff_max_write_bytes": plan.max_write_bytes,
    }
