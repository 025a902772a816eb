"""The scenario: a deployment, a pool, a gate and a workload, as one typed, frozen, validated value.

Scenarios come from TOML files (``scenarios/*.toml`` are built in, loadable by name). Every
section is a frozen pydantic model with ``extra="forbid"``, so a misspelt field is an error that
names it. Units are in the field names. ``docs/scenario.md`` documents every field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from kvpool.policy.kvspec import ExtraRecord, KVSpec, every_kth_layer
from kvpool.policy.placement import place
from kvpool.workload.presets import PRESETS


# Strict scalar types: no bool taken as a number, no string coerced to a number or a bool, no
# non-finite float. Each numeric field also has an upper bound that a real deployment cannot reach,
# so a typo is an error rather than a run that never ends or exhausts memory; each rate the cost
# model divides by (bandwidths, FLOP/s, efficiencies) a lower one far below any real device, so a
# step never takes an infinite or astronomically long time.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
PLAIN_TEXT = r"^[^\x00-\x1f\x7f-\x9f]*$"  # one line, nothing a terminal acts on (C0, DEL, C1)
Label = Annotated[str, Strict(), Field(min_length=1, max_length=200, pattern=PLAIN_TEXT)]

MAX_LAYERS = 1024
MAX_MTP_LAYERS = 16
MAX_RECORD_BYTES = 1 << 20
MAX_SERVERS = 1024
MAX_INSTANCES = 4096
MAX_TOKENS = 1 << 24          # 16,777,216 tokens: longer than any model's context
MAX_SESSIONS = 100_000
MAX_SYNTHETIC_SESSIONS = 1024  # synthetic sessions x max(1, context_scale): above the largest trace set a preset is fitted on (710)


def synthetic_size_error(sessions: int, context_scale: float) -> str | None:
    """Why a synthetic workload of ``sessions`` at ``context_scale`` is too large to build, or None.

    Its build time and memory grow with the sessions times the prompt-side tokens of each, so
    ``sessions x max(1, context_scale)`` is at most ``MAX_SYNTHETIC_SESSIONS`` (a build of about
    15 s on one core at the bound)."""
    if sessions * max(1.0, context_scale) > MAX_SYNTHETIC_SESSIONS:
        return (f"synthetic_sessions x context_scale ({sessions} x {context_scale:g}) must be <= "
                f"{MAX_SYNTHETIC_SESSIONS} (the build's time and memory grow with both)")
    return None
MAX_SECONDS = 604_800.0       # one week
MAX_SEED = 2**32 - 1


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ExtraRecordConfig(_Section):
    """A per-token record on some layers only (e.g. the DSA indexer key)."""

    name: Label = Field(description="label, e.g. indexer")
    bytes_per_token: Int = Field(gt=0, le=MAX_RECORD_BYTES, description="bytes of the record per token per layer that carries it")
    layer_ids: tuple[Annotated[int, Strict(), Field(ge=0, lt=MAX_LAYERS + MAX_MTP_LAYERS)], ...] | None = Field(
        default=None, max_length=MAX_LAYERS + MAX_MTP_LAYERS,
        description="explicit layer ids, distinct (ids >= layers name MTP layers)",
    )
    first_dense_layers: Int = Field(default=0, ge=0, le=MAX_LAYERS, description="schedule: the first N layers carry it")
    every_k: Int = Field(default=1, gt=0, le=MAX_LAYERS, description="schedule: then every k-th layer")
    offset: Int = Field(default=0, ge=0, le=MAX_LAYERS, description="schedule: starting at this layer")
    include_mtp: Bool = Field(default=False, description="schedule: MTP layers carry it too")

    @field_validator("layer_ids")
    @classmethod
    def _distinct_ids(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is not None and len(set(v)) != len(v):
            dup = sorted({x for x in v if v.count(x) > 1})
            raise ValueError(f"layer ids must be distinct; repeated: {', '.join(map(str, dup))}")
        return v

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

    name: Label = Field(description="model name (part of the key namespace)")
    layers: Int = Field(gt=0, le=MAX_LAYERS, description="attention layers of the main model")
    mtp_layers: Int = Field(default=0, ge=0, le=MAX_MTP_LAYERS, description="MTP draft layers caching KV; they run on the last stage")
    record_bytes: Int = Field(gt=0, le=MAX_RECORD_BYTES, description="bytes per token per layer of the main KV record")
    extra_records: tuple[ExtraRecordConfig, ...] = Field(default=(), max_length=16, description="[[model.extra_records]] tables: records on some layers only")
    page_tokens: Int = Field(default=16, gt=0, le=4096, description="tokens per GPU KV page (block size)")
    weights_gb: Float = Field(gt=0, le=100_000, description="weights of one instance, GB (1e9 B)")
    active_params_b: Float = Field(gt=0, le=100_000, description="active parameters per token, billions (cost model)")


class GPUConfig(_Section):
    """One GPU and its links."""

    name: Label = Field(description="GPU model")
    hbm_gb: Float = Field(gt=0, le=10_000, description="HBM per GPU, GB (1e9 B)")
    hbm_tb_s: Float = Field(ge=0.01, le=1_000, description="HBM bandwidth, TB/s")
    dense_tflops: Float = Field(ge=0.01, le=1_000_000, description="dense peak of the compute dtype, TFLOP/s")
    nic_gb_s: Float = Field(ge=0.001, le=10_000, description="effective large-write bandwidth of the GPU's NIC, GB/s")
    nic_writes_per_s: Float = Field(ge=1, le=1e10, description="small-write message rate of one NIC, writes/s")
    nic_latency_us: Float = Field(default=5.0, ge=0, le=1_000_000, description="one-way NIC latency, microseconds")


class ClusterConfig(_Section):
    """Servers and their NUMA nodes."""

    servers: Int = Field(gt=0, le=MAX_SERVERS, description="servers in the cluster")
    gpus_per_server: Int = Field(gt=0, le=64, description="GPUs per server")
    numa_per_server: Int = Field(default=2, gt=0, le=16, description="NUMA nodes per server")


class PrefillConfig(_Section):
    """Prefill instances: pipeline stages (layer split) x tensor parallel ranks."""

    instances: Int = Field(gt=0, le=MAX_INSTANCES, description="prefill instances")
    pp: Int = Field(gt=0, le=64, description="pipeline stages per instance (one GPU each per TP rank)")
    tp: Int = Field(default=1, gt=0, le=256, description="tensor-parallel ranks per stage (MLA latent replicated)")
    stage_layers: tuple[Annotated[int, Strict(), Field(gt=0, le=MAX_LAYERS)], ...] = Field(max_length=64, description="layers per pipeline stage, in order; sums to model.layers")
    gpu_mem_utilization: Float = Field(default=0.85, gt=0, le=1, description="fraction of HBM the engine takes")
    reserved_gb_per_gpu: Float = Field(default=0.0, ge=0, le=10_000, description="activations/workspace per GPU, GB")
    max_batched_tokens: Int = Field(default=8192, gt=0, le=MAX_TOKENS, description="chunked-prefill tokens per step")
    spread_requests: Bool = Field(default=False, description="a step takes at most the runnable requests' even share over the pipeline stages, so that the next steps fill the stages behind it (kvpool serve and the simulator)")

    @property
    def gpus(self) -> int:
        return self.pp * self.tp


class DecodeConfig(_Section):
    """Decode instances: tensor parallel with decode context parallelism (tokens spread over DCP ranks)."""

    instances: Int = Field(gt=0, le=MAX_INSTANCES, description="decode instances")
    tp: Int = Field(gt=0, le=256, description="tensor-parallel ranks (GPUs) per instance")
    dcp: Int = Field(default=1, gt=0, le=256, description="decode context parallelism: token t on rank t mod dcp")
    gpu_mem_utilization: Float = Field(default=0.85, gt=0, le=1, description="fraction of HBM the engine takes")
    reserved_gb_per_gpu: Float = Field(default=0.0, ge=0, le=10_000, description="activations/workspace per GPU, GB")
    max_seqs: Int = Field(default=256, gt=0, le=65_536, description="running sequences per instance")
    mtp_accept_tokens: Float = Field(default=1.0, ge=1, le=16, description="tokens per decode step (MTP acceptance)")

    @property
    def gpus(self) -> int:
        return self.tp


class SSDConfig(_Section):
    """An optional tier below DRAM: groups evicted from DRAM demote here (at once: demotion takes no
    link time); restores read from it at ``read_gb_s_per_server``."""

    enabled: Bool = Field(default=False, description="add the SSD tier")
    gib_per_server: Float = Field(default=0.0, ge=0, le=1_048_576, description="SSD capacity per server, GiB")
    read_gb_s_per_server: Float = Field(default=12.0, ge=0.001, le=10_000, description="SSD read bandwidth per server, GB/s")


class PoolConfig(_Section):
    """The Mooncake Store pool: services, masters, eviction, chunking."""

    mode: Literal["shared", "split"] = Field(default="shared", description="shared: every prefill uses every master; split: each server's masters serve its own prefills")
    parts: Int = Field(default=1, gt=0, le=4096, description="pool parts (one master each); rank i uses part i mod parts")
    services_per_server: Int = Field(ge=0, le=256, description="memory-only Store services per server")
    gib_per_service: Float = Field(ge=0, le=65_536, description="DRAM each service contributes, GiB")
    high_watermark: Float = Field(default=0.90, gt=0, le=1, description="usage fraction that starts eviction")
    evict_ratio: Float = Field(default=0.05, gt=0, le=1, description="fraction of capacity a pass frees")
    eviction_policy: Literal["lru", "lfu", "fifo"] = Field(default="lru", description="group eviction order")
    chunk_tokens: Int = Field(default=256, gt=0, le=1 << 20, description="tokens per chunk (multiple of model.page_tokens)")
    min_load_tokens: Int = Field(default=8192, ge=0, le=MAX_TOKENS, description="loads shorter than this are recomputed")
    ssd: SSDConfig = Field(default=SSDConfig(), description="[pool.ssd]: optional tier below DRAM")


class HandoffConfig(_Section):
    """Prefill -> decode KV handoff."""

    max_write_bytes: Int = Field(default=8 << 20, gt=0, le=1 << 34, description="largest single write of the handoff, bytes")


class GateConfigModel(_Section):
    """The KV admission gate in front of decode.

    A request reserves its input + output tokens on the decode instance with the most room. One
    that fits nowhere waits; every release offers the freed budget to the waiting requests in
    arrival order (first fit: one that still does not fit keeps its place), and a request still
    waiting after ``max_wait_s`` is rejected. A new request that fits is admitted at once.
    """

    enabled: Bool = Field(default=True, description="put the gate in front of decode")
    tokens_per_decode: Int = Field(default=10_000_000, gt=0, le=10**12, description="token budget per decode instance")
    budget_fraction: Float = Field(default=0.9, gt=0, le=1, description="usable fraction of the budget")
    max_input_tokens: Int = Field(default=917_504, gt=0, le=MAX_TOKENS, description="longer inputs are rejected")
    max_output_tokens: Int = Field(default=131_072, gt=0, le=MAX_TOKENS, description="longer outputs are rejected")
    max_wait_s: Float = Field(default=900.0, ge=0, le=MAX_SECONDS, description="longest admission wait before rejection, s")


class RoutingConfig(_Section):
    """How requests are routed, alike in the simulator and in kvpool serve (``policy.routing``): decode is
    the instance with the most free KV (``policy.routing.choose_decode``: over the gate's budget when
    enabled, else over the decode KV less what ``policy.admission.Ungated`` admitted), prefill an instance of that decode instance's group (prefill instance i serves decode
    group i mod decode.instances), picked by the group's router, seeded from ``seed``."""

    prefill: Literal["power_of_two", "session_affinity"] = Field(default="power_of_two", description="prefill router")


class WorkloadConfig(_Section):
    """What is replayed, and how."""

    mode: Literal["agentx", "replay"] = Field(default="agentx", description="agentx: lanes of live session trees; replay: Poisson production replay")
    traces: Annotated[str, Strict(), Field(min_length=1, max_length=4096)] | None = Field(default=None, description="trace file/dir; none: the synthetic preset")
    preset: Label = Field(default="agentx-062126", description="synthetic preset when no traces are given")
    synthetic_sessions: Int = Field(
        default=200, gt=0, le=MAX_SYNTHETIC_SESSIONS,
        description="sessions the synthetic preset generates (times max(1, context_scale): at most 1024)")
    sessions: Int = Field(default=56, gt=0, le=MAX_SESSIONS, description="AgentX lanes (concurrent session trees)")
    rps: Float = Field(default=0.8, gt=0, le=10_000, description="replay: Poisson arrivals per second")
    lanes: Int = Field(default=160, gt=0, le=MAX_SESSIONS, description="replay: lanes")
    duration_s: Float = Field(default=3600.0, gt=0, le=MAX_SECONDS, description="measured window, s")
    idle_cap_s: Float = Field(default=300.0, gt=0, le=MAX_SECONDS, description="per-tree idle gap cap, s")
    grace_s: Float = Field(
        default=30.0, ge=0, le=MAX_SECONDS,
        description="responses finishing later than duration_s + grace_s after the measured start are "
                    "left out of the metrics (AIPerf's --benchmark-grace-period, default 30 s)",
    )
    warmup_requests: Int = Field(default=3, ge=0, le=10_000, description="warm-up requests per lane (excluded from metrics)")
    start_fraction_min: Float = Field(default=0.25, ge=0, le=1, description="lane start point t*: lowest fraction of the trace span")
    start_fraction_max: Float = Field(default=0.75, ge=0, le=1, description="lane start point t*: highest fraction")
    max_context_tokens: Int = Field(default=917_504, gt=0, le=MAX_TOKENS, description="traces whose peak context exceeds this are skipped")
    max_output_tokens: Int | None = Field(default=None, gt=0, le=MAX_TOKENS, description="cap on output tokens per request (none: recorded)")
    context_scale: Float = Field(
        default=1.0, gt=0, le=10,
        description="synthetic presets only: every prompt-side token count of the sessions times this "
                    "(first prompts, growth, compaction, context limits); outputs and timing unchanged",
    )
    token_scale: Float = Field(
        default=1.0, gt=0, le=1,
        description="every recorded prompt scaled to a small model (workload.token_scale.scale_workload): a hash "
                    "block of B tokens becomes max(1, round(B x F)) tokens, a prompt of N tokens max(1, round(N x "
                    "b / B)); outputs unchanged. The simulator and kvpool replay apply it alike (1: as recorded)",
    )
    shared_prefix_tokens: Int = Field(
        default=0, ge=0, le=MAX_TOKENS,
        description="leading prompt tokens of every main-thread request that are the same in every session "
                    "(one agent product's tool definitions), whole trace blocks only; 0: sessions share nothing "
                    "(AgentX cache-busts every session)",
    )

    @model_validator(mode="after")
    def _start_range(self) -> WorkloadConfig:
        if self.start_fraction_min > self.start_fraction_max:
            raise ValueError("start_fraction_min must be <= start_fraction_max")
        if self.shared_prefix_tokens > self.max_context_tokens:
            raise ValueError(f"shared_prefix_tokens ({self.shared_prefix_tokens}) must be <= max_context_tokens "
                             f"({self.max_context_tokens})")
        if (why := synthetic_size_error(self.synthetic_sessions, self.context_scale)) is not None:
            raise ValueError(why)
        return self

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        if v not in PRESETS:
            raise ValueError(f"allowed: {', '.join(PRESETS)}")
        return v


class CostConfig(_Section):
    """Parameters of the analytical cost model (``kvpool.sim.cost``); sources in docs/cost-model.md."""

    prefill_mfu: Float = Field(default=0.15, ge=0.001, le=1, description="achieved fraction of dense peak in prefill")
    attention_flops_per_token: Float = Field(
        default=2.2e10, ge=0, le=1e15, description="context-independent attention FLOPs per prefilled token (sparse MLA, top-2048)"
    )
    attention_flops_per_token_ctx: Float = Field(
        default=1.7e5, ge=0, le=1e12, description="FLOPs per prefilled token per token of context (DSA indexer)"
    )
    prefill_step_overhead_s: Float = Field(default=0.004, ge=0, le=60, description="fixed cost of one prefill step, s")
    decode_step_fixed_s: Float = Field(default=0.0093, ge=0, le=60, description="fixed cost of one decode step, s")
    decode_step_per_seq_s: Float = Field(
        default=0.00031, ge=0, le=60,
        description="decode step cost per running sequence per token it verifies (ceil(mtp_accept_tokens)), s",
    )
    decode_kv_read_bytes_per_token: Float = Field(
        default=2800.0, ge=0, le=1e7, description="KV bytes a decode step reads per context token (DSA indexer keys)"
    )
    hbm_efficiency: Float = Field(default=0.5, ge=0.001, le=1, description="achieved fraction of HBM bandwidth")
    unpack_gb_s: Float = Field(default=1000.0, ge=0.001, le=100_000, description="GPU pack/gather/scatter copy rate, GB/s")
    pool_load_gb_s: Float = Field(
        default=10.0, ge=0.001, le=100_000, description="one load worker's pool read + unpack rate, GB/s (after the NIC transfer)"
    )
    load_workers_per_stage: Int = Field(default=1, gt=0, le=1024, description="concurrent pool loads per prefill stage")
    frontend_overhead_s: Float = Field(
        default=0.0, ge=0, le=600,
        description="fixed time from a request's arrival to its admission: API gateway, chat template and "
                    "tokenization in front of the router, s (0: the client talks to the router directly)",
    )
    kv_capacity: Literal["hbm", "serve"] = Field(
        default="hbm",
        description="where the simulator's GPU KV capacities come from (data only: the mechanisms are the "
                    "same, kvpool serve's page discipline and pipeline; docs/fidelity.md): hbm: derived from "
                    "HBM, weights and reserves (kvpool scenario show); serve: serve.prefill_kv_tokens per "
                    "prefill instance and serve.decode_kv_tokens per decode instance, what kvpool serve "
                    "allocates",
    )
    calibration: Annotated[str, Strict(), Field(min_length=1, max_length=4096)] | None = Field(
        default=None,
        description="a calibration file (kvpool calibrate): measured prefill, decode, restore and hand-off "
                    "curves and overheads replace the analytic model inside their grids, and its "
                    "sharing section slows the workers that share a device (a relative path is "
                    "taken from the working directory, as workload.traces is); none: analytic only",
    )
    control_plane_s: Float = Field(
        default=0.0, ge=0, le=600,
        description="fixed time per admitted request before its prefill's lookup that the model does not "
                    "resolve into its parts: the router's dispatch, the Store masters' lookups and transfer "
                    "set-up before a restore, and the hand-off's descriptor exchange with the decode instance, s",
    )


class FaultsConfig(_Section):
    """Requests that hang, time out or lose a transfer (off by default: every probability 0, no timeout).

    AgentX's error semantics: an errored request is left out of TTFT, throughput and the token
    shares (it counts under ``errors``), its session goes on with its next request as if it had
    finished, and what it held (its gate reservation, its place in the prefill's queue and the
    router's count of its tokens) is given back when it fails. Every draw is a pure function of
    the scenario's seed and the request's key, so runs stay deterministic. A *pool miss* is a
    request whose lookup leaves at least ``pool.min_load_tokens`` tokens to compute (the GPU
    cache and the pool together missed a loadable part of its history).
    """

    request_timeout_s: Float | None = Field(
        default=None, gt=0, le=MAX_SECONDS,
        description="admission to first token beyond this is an error (ATOM's prefill/decode timeout: 300 s); "
                    "a request that has joined a decode batch gets its first token within one step and is not "
                    "timed out; none: no timeout",
    )
    hang_prob_on_pool_miss: Float = Field(
        default=0.0, ge=0, le=1, description="probability that a pool miss hangs after its lookup")
    hang_prob_other: Float = Field(
        default=0.0, ge=0, le=1, description="probability that any other request hangs after its lookup")
    hang_s: Float = Field(
        default=900.0, gt=0, le=MAX_SECONDS,
        description="how long a hung request holds what it reserved before it fails (the timeout, when "
                    "shorter, fails it first), s")
    restore_fail_prob: Float = Field(
        default=0.0, ge=0, le=1,
        description="probability that a restore from the pool fails once its transfer is done; the request "
                    "computes those tokens instead (record: restore_failed)")
    save_fail_prob: Float = Field(
        default=0.0, ge=0, le=1,
        description="probability that a save to the pool fails once its bytes have travelled; the pool does "
                    "not hold those chunks, so a later hit on them is a recompute")

    @property
    def enabled(self) -> bool:
        """Whether any fault can happen."""
        return (self.request_timeout_s is not None or self.hang_prob_on_pool_miss > 0 or self.hang_prob_other > 0
                or self.restore_fail_prob > 0 or self.save_fail_prob > 0)


class ServeConfig(_Section):
    """Production mode (``kvpool serve``): the reference model's shape, where the workers run, their KV room.

    The model has ``model.layers`` layers split as ``prefill.stage_layers`` and caches
    ``model.record_bytes`` per token per layer: 1,152 B for ``bfloat16`` records, 576 B for
    ``float8_e4m3fn`` (the 512 + 64 MLA latent). A ``model.extra_records`` entry named ``indexer``
    puts the DSA lightning indexer on its layers (``index_*``; its ``bytes_per_token`` is the
    indexer record's size). Workers take ``devices`` in order (prefill
    instances' stages, then decode instances' ranks), wrapping around, so several workers may share
    one device.
    """

    d_model: Int = Field(default=256, gt=0, le=65_536, description="reference model: hidden size")
    heads: Int = Field(default=2, gt=0, le=1024, description="reference model: attention heads")
    nope_dim: Int = Field(default=64, gt=0, le=4096, description="reference model: per-head query dim without RoPE")
    v_dim: Int = Field(default=64, gt=0, le=4096, description="reference model: per-head value dim")
    ffn_dim: Int = Field(default=512, gt=0, le=1 << 20, description="reference model: FFN hidden size")
    vocab: Int = Field(default=512, ge=257, le=1 << 20, description="reference model: vocabulary (text prompts are UTF-8 bytes, so at least 257)")
    cache_dtype: Literal["bfloat16", "float8_e4m3fn"] = Field(default="bfloat16", description="dtype of the cached KV records")
    model_seed: Int = Field(default=0, ge=0, le=MAX_SEED, description="seed of the reference model's random weights")
    index_topk: Int = Field(default=2048, gt=0, le=MAX_TOKENS, description="reference model's DSA indexer (on the layers of the model.extra_records entry named indexer): tokens an indexer layer's query attends to once its context is longer (GLM-5: 2048)")
    index_heads: Int = Field(default=32, gt=0, le=1024, description="reference model's DSA indexer: query heads (GLM-5: 32)")
    index_dim: Int = Field(default=128, gt=0, le=4096, description="reference model's DSA indexer: key width; the indexer record is index_dim elements of serve.cache_dtype + a 4 B float32 scale, padded to a multiple of 16 B (float8_e4m3fn, 128: 144 B; bfloat16, 64: 144 B)")
    devices: tuple[Annotated[str, Strict(), Field(pattern=r"^(cpu|cuda(:[0-9]{1,3})?)$")], ...] = Field(default=("cpu",), min_length=1, max_length=1024, description="torch devices the workers take in order (cpu, cuda:0, ...)")
    prefill_kv_tokens: Int = Field(default=65_536, gt=0, le=MAX_TOKENS, description="paged KV per prefill stage (its GPU prefix cache), tokens")
    decode_kv_tokens: Int = Field(default=65_536, gt=0, le=MAX_TOKENS, description="paged KV per decode instance, tokens")
    landing_slots: Int = Field(default=16, gt=0, le=4096, description="hand-off landing slots per decode rank")
    pool: Literal["embedded", "mooncake"] = Field(default="embedded", description="embedded: an in-process pool; mooncake: a Mooncake Store")
    drain_s: Float = Field(default=30.0, ge=0, le=3600, description="how long a stop waits for in-flight requests, s")
    request_timeout_s: Float = Field(default=300.0, gt=0, le=MAX_SECONDS, description="longest a request may take end to end before it fails, s")


class Scenario(_Section):
    """A whole deployment. See ``docs/scenario.md``."""

    name: Label = Field(description="scenario name (a label: output file names use a sanitised form)")
    description: Annotated[str, Strict(), Field(max_length=1000, pattern=PLAIN_TEXT)] = Field(default="", description="one line shown in listings")
    seed: Int = Field(default=7, ge=0, le=MAX_SEED, description="seed of every random choice")
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
    faults: FaultsConfig = Field(default=FaultsConfig())
    serve: ServeConfig = Field(default=ServeConfig())

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
        c = self.cluster
        place(c.servers, c.gpus_per_server, c.numa_per_server,
              self.decode.instances, self.decode.gpus, p.instances, p.gpus)  # PlacementError: a ValueError
        if self.decode.tp % self.decode.dcp:
            raise ValueError(f"decode.dcp ({self.decode.dcp}) must divide decode.tp ({self.decode.tp})")
        if self.handoff.max_write_bytes < m.record_bytes:
            raise ValueError("handoff.max_write_bytes must hold at least one record")
        names = [r.name for r in m.extra_records]
        if len(set(names)) != len(names):
            raise ValueError(f"model.extra_records: names must be distinct, got {', '.join(names)}")
        self._check_pool()
        for role, part in (("prefill", p), ("decode", self.decode)):
            engine_gb, weights_gb = self.gpu.hbm_gb * part.gpu_mem_utilization, m.weights_gb / part.gpus
            if weights_gb > engine_gb or weights_gb + part.reserved_gb_per_gpu > self.gpu.hbm_gb:
                raise ValueError(
                    f"{role}: the weights' share per GPU (model.weights_gb / {part.gpus} GPUs = {weights_gb:g} GB) "
                    f"and {role}.reserved_gb_per_gpu ({part.reserved_gb_per_gpu:g} GB) do not fit in gpu.hbm_gb "
                    f"({self.gpu.hbm_gb:g} GB) x {role}.gpu_mem_utilization ({part.gpu_mem_utilization:g})"
                )
            if role == "decode" and engine_gb - weights_gb - part.reserved_gb_per_gpu <= 0:
                raise ValueError(
                    f"decode: no HBM left for KV: gpu.hbm_gb x decode.gpu_mem_utilization ({engine_gb:g} GB) less "
                    f"the weights' share ({weights_gb:g} GB) and decode.reserved_gb_per_gpu ({part.reserved_gb_per_gpu:g} GB)"
                )
        self.kvspec()  # extra-record layer ids in range
        return self

    def _check_pool(self) -> None:
        pool, services = self.pool, self.cluster.servers * self.pool.services_per_server
        if pool.services_per_server:
            if pool.mode == "split" and pool.parts > pool.services_per_server:
                raise ValueError(f"pool.parts ({pool.parts}) exceeds pool.services_per_server "
                                 f"({pool.services_per_server}): a split pool has its parts on every server")
            if pool.mode == "shared" and pool.parts > services:
                raise ValueError(f"pool.parts ({pool.parts}) exceeds the store services (cluster.servers x "
                                 f"pool.services_per_server = {services})")
        if pool.ssd.enabled and pool.ssd.gib_per_server <= 0:
            raise ValueError("pool.ssd.enabled needs pool.ssd.gib_per_server > 0")
        if pool.ssd.enabled and not (pool.services_per_server and pool.gib_per_service):
            raise ValueError("pool.ssd.enabled needs a DRAM pool above it (pool.services_per_server > 0 and "
                             "pool.gib_per_service > 0): the SSD tier holds what DRAM evicts")

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
