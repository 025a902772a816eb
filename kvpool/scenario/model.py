"""The scenario: a deployment, a pool, a gate and a workload, as one typed, frozen, validated value.

Scenarios come from TOML files (``scenarios/*.toml`` are built in, loadable by name). Every
section is a frozen pydantic model with ``extra="forbid"``, so a misspelt field is an error that
names it. Units are in the field names. ``docs/scenario.md`` documents every field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvpool.policy.kvspec import ExtraRecord, KVSpec, every_kth_layer
from kvpool.workload.presets import PRESETS


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ExtraRecordConfig(_Section):
    """A per-token record on some layers only (e.g. the DSA indexer key)."""

    name: str = Field(description="label, e.g. indexer")
    bytes_per_token: int = Field(gt=0, description="bytes of the record per token per layer that carries it")
    layer_ids: tuple[int, ...] | None = Field(
        default=None, description="explicit layer ids (ids >= layers name MTP layers)"
    )
    first_dense_layers: int = Field(default=0, ge=0, description="schedule: the first N layers carry it")
    every_k: int = Field(default=1, gt=0, description="schedule: then every k-th layer")
    offset: int = Field(default=0, ge=0, description="schedule: starting at this layer")
    include_mtp: bool = Field(default=False, description="schedule: MTP layers carry it too")

    def resolve(self, layers: int, mtp_layers: int) -> ExtraRecord:
        if self.layer_ids is not None:
            ids = tuple(self.layer_ids)
        else:
            ids = every_kth_layer(layers, self.first_dense_layers, self.every_k, self.offset)
            if self.include_mtp:
                ids += tuple(range(layers, layers + mtp_layers))
        return ExtraRecord(self.name, self.bytes_per_token, ids)


class ModelConfig(_Section):
    """The served model's KV geometry and weight footprint."""

    name: str = Field(description="model name (part of the key namespace)")
    layers: int = Field(gt=0, description="attention layers of the main model")
    mtp_layers: int = Field(default=0, ge=0, description="MTP draft layers caching KV; they run on the last stage")
    record_bytes: int = Field(gt=0, description="bytes per token per layer of the main KV record")
    extra_records: tuple[ExtraRecordConfig, ...] = Field(default=(), description="[[model.extra_records]] tables: records on some layers only")
    page_tokens: int = Field(default=16, gt=0, description="tokens per GPU KV page (block size)")
    weights_gb: float = Field(gt=0, description="weights of one instance, GB (1e9 B)")
    active_params_b: float = Field(gt=0, description="active parameters per token, billions (cost model)")


class GPUConfig(_Section):
    """One GPU and its links."""

    name: str = Field(description="GPU model")
    hbm_gb: float = Field(gt=0, description="HBM per GPU, GB (1e9 B)")
    hbm_tb_s: float = Field(gt=0, description="HBM bandwidth, TB/s")
    dense_tflops: float = Field(gt=0, description="dense peak of the compute dtype, TFLOP/s")
    nic_gb_s: float = Field(gt=0, description="effective large-write bandwidth of the GPU's NIC, GB/s")
    nic_writes_per_s: float = Field(gt=0, description="small-write message rate of one NIC, writes/s")
    nic_latency_us: float = Field(default=5.0, ge=0, description="one-way NIC latency, microseconds")


class ClusterConfig(_Section):
    """Servers and their NUMA nodes."""

    servers: int = Field(gt=0, description="servers in the cluster")
    gpus_per_server: int = Field(gt=0, description="GPUs per server")
    numa_per_server: int = Field(default=2, gt=0, description="NUMA nodes per server")


class PrefillConfig(_Section):
    """Prefill instances: pipeline stages (layer split) x tensor parallel ranks."""

    instances: int = Field(gt=0, description="prefill instances")
    pp: int = Field(gt=0, description="pipeline stages per instance (one GPU each per TP rank)")
    tp: int = Field(default=1, gt=0, description="tensor-parallel ranks per stage (MLA latent replicated)")
    stage_layers: tuple[int, ...] = Field(description="layers per pipeline stage, in order; sums to model.layers")
    gpu_mem_utilization: float = Field(default=0.85, gt=0, le=1, description="fraction of HBM the engine takes")
    reserved_gb_per_gpu: float = Field(default=0.0, ge=0, description="activations/workspace per GPU, GB")
    max_batched_tokens: int = Field(default=8192, gt=0, description="chunked-prefill tokens per step")

    @property
    def gpus(self) -> int:
        return self.pp * self.tp


class DecodeConfig(_Section):
    """Decode instances: tensor parallel with decode context parallelism (tokens spread over DCP ranks)."""

    instances: int = Field(gt=0, description="decode instances")
    tp: int = Field(gt=0, description="tensor-parallel ranks (GPUs) per instance")
    dcp: int = Field(default=1, gt=0, description="decode context parallelism: token t on rank t mod dcp")
    gpu_mem_utilization: float = Field(default=0.85, gt=0, le=1, description="fraction of HBM the engine takes")
    reserved_gb_per_gpu: float = Field(default=0.0, ge=0, description="activations/workspace per GPU, GB")
    max_seqs: int = Field(default=256, gt=0, description="running sequences per instance")
    mtp_accept_tokens: float = Field(default=1.0, ge=1, description="tokens per decode step (MTP acceptance)")

    @property
    def gpus(self) -> int:
        return self.tp


class SSDConfig(_Section):
    """An optional tier below DRAM: groups evicted from DRAM demote here (at once: demotion takes no
    link time); restores read from it at ``read_gb_s_per_server``."""

    enabled: bool = Field(default=False, description="add the SSD tier")
    gib_per_server: float = Field(default=0.0, ge=0, description="SSD capacity per server, GiB")
    read_gb_s_per_server: float = Field(default=12.0, gt=0, description="SSD read bandwidth per server, GB/s")


class PoolConfig(_Section):
    """The Mooncake Store pool: services, masters, eviction, chunking."""

    mode: Literal["shared", "split"] = Field(default="shared", description="shared: every prefill uses every master; split: each server's masters serve its own prefills")
    parts: int = Field(default=1, gt=0, description="pool parts (one master each); rank i uses part i mod parts")
    services_per_server: int = Field(ge=0, description="memory-only Store services per server")
    gib_per_service: float = Field(ge=0, description="DRAM each service contributes, GiB")
    high_watermark: float = Field(default=0.90, gt=0, le=1, description="usage fraction that starts eviction")
    evict_ratio: float = Field(default=0.05, gt=0, le=1, description="fraction of capacity a pass frees")
    eviction_policy: Literal["lru", "lfu", "fifo"] = Field(default="lru", description="group eviction order")
    chunk_tokens: int = Field(default=256, gt=0, description="tokens per chunk (multiple of model.page_tokens)")
    min_load_tokens: int = Field(default=8192, ge=0, description="loads shorter than this are recomputed")
    ssd: SSDConfig = Field(default=SSDConfig(), description="[pool.ssd]: optional tier below DRAM")


class HandoffConfig(_Section):
    """Prefill -> decode KV handoff."""

    max_write_bytes: int = Field(default=8 << 20, gt=0, description="largest single write of the handoff, bytes")


class GateConfigModel(_Section):
    """The KV admission gate in front of decode.

    A request reserves its input + output tokens on the decode instance with the most room. One
    that fits nowhere waits; every release offers the freed budget to the waiting requests in
    arrival order (first fit: one that still does not fit keeps its place), and a request still
    waiting after ``max_wait_s`` is rejected. A new request that fits is admitted at once.
    """

    enabled: bool = Field(default=True, description="put the gate in front of decode")
    tokens_per_decode: int = Field(default=10_000_000, gt=0, description="token budget per decode instance")
    budget_fraction: float = Field(default=0.9, gt=0, le=1, description="usable fraction of the budget")
    max_input_tokens: int = Field(default=917_504, gt=0, description="longer inputs are rejected")
    max_output_tokens: int = Field(default=131_072, gt=0, description="longer outputs are rejected")
    max_wait_s: float = Field(default=900.0, ge=0, description="longest admission wait before rejection, s")


class RoutingConfig(_Section):
    """How requests are routed to prefill instances (decode is always the instance with the most free KV,
    ``policy.routing.choose_decode``)."""

    prefill: Literal["power_of_two", "session_affinity"] = Field(default="power_of_two", description="prefill router")


class WorkloadConfig(_Section):
    """What is replayed, and how."""

    mode: Literal["agentx", "replay"] = Field(default="agentx", description="agentx: lanes of live session trees; replay: Poisson production replay")
    traces: str | None = Field(default=None, description="trace file/dir; none: the synthetic preset")
    preset: str = Field(default="agentx-062126", description="synthetic preset when no traces are given")
    synthetic_sessions: int = Field(default=200, gt=0, description="sessions the synthetic preset generates")
    sessions: int = Field(default=56, gt=0, description="AgentX lanes (concurrent session trees)")
    rps: float = Field(default=0.8, gt=0, description="replay: Poisson arrivals per second")
    lanes: int = Field(default=160, gt=0, description="replay: lanes")
    duration_s: float = Field(default=3600.0, gt=0, description="measured window, s")
    idle_cap_s: float = Field(default=300.0, gt=0, description="per-tree idle gap cap, s")
    grace_s: float = Field(
        default=30.0, ge=0,
        description="responses finishing later than duration_s + grace_s after the measured start are "
                    "left out of the metrics (AIPerf's --benchmark-grace-period, default 30 s)",
    )
    warmup_requests: int = Field(default=3, ge=0, description="warm-up requests per lane (excluded from metrics)")
    start_fraction_min: float = Field(default=0.25, ge=0, le=1, description="lane start point t*: lowest fraction of the trace span")
    start_fraction_max: float = Field(default=0.75, ge=0, le=1, description="lane start point t*: highest fraction")
    max_context_tokens: int = Field(default=917_504, gt=0, description="traces whose peak context exceeds this are skipped")
    max_output_tokens: int | None = Field(default=None, gt=0, description="cap on output tokens per request (none: recorded)")
    context_scale: float = Field(
        default=1.0, gt=0, le=10,
        description="synthetic presets only: every prompt-side token count of the sessions times this "
                    "(first prompts, growth, compaction, context limits); outputs and timing unchanged",
    )
    shared_prefix_tokens: int = Field(
        default=0, ge=0,
        description="leading prompt tokens of every main-thread request that are the same in every session "
                    "(one agent product's tool definitions), whole trace blocks only; 0: sessions share nothing "
                    "(AgentX cache-busts every session)",
    )

    @model_validator(mode="after")
    def _start_range(self) -> WorkloadConfig:
        if self.start_fraction_min > self.start_fraction_max:
            raise ValueError("start_fraction_min must be <= start_fraction_max")
        return self

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        if v not in PRESETS:
            raise ValueError(f"allowed: {', '.join(PRESETS)}")
        return v


class CostConfig(_Section):
    """Parameters of the analytical cost model (``kvpool.sim.cost``); sources in docs/cost-model.md."""

    prefill_mfu: float = Field(default=0.15, gt=0, le=1, description="achieved fraction of dense peak in prefill")
    attention_flops_per_token: float = Field(
        default=2.2e10, ge=0, description="context-independent attention FLOPs per prefilled token (sparse MLA, top-2048)"
    )
    attention_flops_per_token_ctx: float = Field(
        default=1.7e5, ge=0, description="FLOPs per prefilled token per token of context (DSA indexer)"
    )
    prefill_step_overhead_s: float = Field(default=0.004, ge=0, description="fixed cost of one prefill step, s")
    decode_step_fixed_s: float = Field(default=0.0093, ge=0, description="fixed cost of one decode step, s")
    decode_step_per_seq_s: float = Field(
        default=0.00031, ge=0,
        description="decode step cost per running sequence per token it verifies (ceil(mtp_accept_tokens)), s",
    )
    decode_kv_read_bytes_per_token: float = Field(
        default=2800.0, ge=0, description="KV bytes a decode step reads per context token (DSA indexer keys)"
    )
    hbm_efficiency: float = Field(default=0.5, gt=0, le=1, description="achieved fraction of HBM bandwidth")
    unpack_gb_s: float = Field(default=1000.0, gt=0, description="GPU pack/gather/scatter copy rate, GB/s")
    pool_load_gb_s: float = Field(
        default=10.0, gt=0, description="one load worker's pool read + unpack rate, GB/s (after the NIC transfer)"
    )
    load_workers_per_stage: int = Field(default=1, gt=0, description="concurrent pool loads per prefill stage")
    frontend_overhead_s: float = Field(
        default=0.0, ge=0,
        description="fixed time from a request's arrival to its admission: API gateway, chat template and "
                    "tokenization in front of the router, s (0: the client talks to the router directly)",
    )


class Scenario(_Section):
    """A whole deployment. See ``docs/scenario.md``."""

    name: str = Field(description="scenario name")
    description: str = Field(default="", description="one line shown in listings")
    seed: int = Field(default=7, description="seed of every random choice")
    model: ModelConfig
    gpu: GPUConfig
    cluster: ClusterConfig
    prefill: PrefillConfig
    decode: DecodeConfig
    pool: PoolConfig
    handoff: HandoffConfig = Field(default=HandoffConfig())
    gate: GateConfigModel = Field(default=GateConfigModel())
    routing: RoutingConfig = Field(default=RoutingConfig())
    workload: WorkloadConfig = Field(default=WorkloadConfig())
    cost: CostConfig = Field(default=CostConfig())

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        p, m = self.prefill, self.model
        if len(p.stage_layers) != p.pp:
            raise ValueError(f"prefill.stage_layers has {len(p.stage_layers)} stages but prefill.pp is {p.pp}")
        if sum(p.stage_layers) != m.layers:
            raise ValueError(
                f"prefill.stage_layers sums to {sum(p.stage_layers)} but model.layers is {m.layers}"
            )
        if self.pool.chunk_tokens % m.page_tokens:
            raise ValueError(
                f"pool.chunk_tokens ({self.pool.chunk_tokens}) must be a multiple of model.page_tokens ({m.page_tokens})"
            )
        gpus_needed = p.instances * p.gpus + self.decode.instances * self.decode.gpus
        gpus_have = self.cluster.servers * self.cluster.gpus_per_server
        if gpus_needed > gpus_have:
            raise ValueError(
                f"prefill ({p.instances} x {p.gpus} GPUs) and decode ({self.decode.instances} x "
                f"{self.decode.gpus} GPUs) need {gpus_needed} GPUs; the cluster has {gpus_have}"
            )
        if self.decode.tp % self.decode.dcp:
            raise ValueError(f"decode.dcp ({self.decode.dcp}) must divide decode.tp ({self.decode.tp})")
        if self.handoff.max_write_bytes < m.record_bytes:
            raise ValueError("handoff.max_write_bytes must hold at least one record")
        self.kvspec()  # extra-record layer ids in range
        return self

    def kvspec(self) -> KVSpec:
        """The policy core's KV geometry for this deployment's prefill layout."""
        m = self.model
        return KVSpec(
            model=m.name,
            layers=m.layers,
            record_bytes=m.record_bytes,
            stage_layers=tuple(self.prefill.stage_layers),
            mtp_layers=m.mtp_layers,
            extra_records=tuple(r.resolve(m.layers, m.mtp_layers) for r in m.extra_records),
            page_tokens=m.page_tokens,
        )
