"""A small reference MLA-style attention model with paged KV, split into pipeline stages.

Used to check the real KV paths end to end: KV restored from a pool (or handed off) must give
bit-identical KV pages and identical next-token logits to recomputing the whole prefill.

Primitives:
    ``RefConfig``                       geometry (a 512 + 64 latent per token per layer, 16-token pages,
                                        the DSA indexer on ``indexer_layers``)
    ``RefModel(config)``                seeded random weights (``torch.Generator``; no global RNG)
    ``RefModel.kv_spec()``              the ``KVSpec`` of its cache (one ``"kv"`` record per layer, an
                                        ``"indexer"`` extra record on the indexer layers)
    ``RefModel.new_caches(num_blocks)`` per stage, its caches in segment order (``stage_segments``):
                                        per layer a paged latent cache ``[blocks, 16, 576]``, then on an
                                        indexer layer its paged indexer cache ``[blocks, 16, 144 B]``
    ``RefModel.prefill(tokens, caches, block_ids, start_token) -> logits``
                                        computes tokens ``[start_token, len)``, reading the cached
                                        prefix ``[0, start_token)`` from the pages; writes their KV
    ``gather_tokens(caches, block_ids, n)`` the first ``n`` tokens' records of every cache (for
                                        comparisons)

Determinism (why "identical" can be asserted, not approximated):
    * Prefill runs one 16-token page of queries at a time, aligned to absolute positions, through
      every layer; attention reads keys **from the paged cache** (after writing the page's own
      records). Every op of page ``b`` then has the same shapes and the same inputs whether the
      prefix was computed in this call, earlier, or restored from a pool, so a CPU (or GPU) run
      gives the same bits. ``start_token`` must therefore be a multiple of the page size (GPU hits
      and pool hits always are).
    * Records are stored in ``cache_dtype`` (bfloat16 by default: 1,152 B per token per layer,
      ATOM's BF16 MLA record; float8_e4m3fn gives the 576 B FP8 record).
    * The indexer's choice for a query reads only the paged indexer keys of its causal context and
      the query's own hidden state, so it is the same bits on every path that gives the same keys.

DSA lightning indexer (DeepSeek-V3.2, GLM-5) on the layers ``indexer_layers``: per token the
layer caches an indexer key ``k = rms(h W_ik)`` (``index_dim`` wide), quantized with one float32
scale per token (``scale = max|k| / 448``, the key stored as ``k / scale`` in ``cache_dtype``). The
record is ``index_dim`` key elements, the 4-byte scale, zero padding to a multiple of 16 B
(``indexer_record_bytes``): 128 FP8 elements give ATOM's 144 B row (128 + 4 + 12), and the CPU's
bfloat16 keeps 144 B with 64 elements. A query ``t`` scores every token ``s <= t`` of its context
as ``sum_j w_j(t) * ReLU(q_j(t) . k(s))`` over ``index_heads`` heads (``q = h W_iq``,
``w = h W_iw / sqrt(index_heads * index_dim)``, ``k`` the dequantized cached key), and the layer's
attention reads the ``index_topk`` best-scored tokens only (ties: the lowest position first). With
``t + 1 <= index_topk`` every token is chosen: the layer is exactly the dense one. Layers without
an indexer attend densely (GLM-5.2's shared layers would reuse the previous indexer's choice; the
reference model does not). The indexer weights are drawn after every other weight, so a model's
other weights do not depend on where its indexer is.

MLA in the absorbed form (DeepSeek-V2/V3, GLM-5): per token and layer the cache holds the
compressed latent ``c_kv`` (512, RMS-normed) and the RoPE key ``k_pe`` (64, rotated before
caching). A head's score is ``q_nope W_uk . c_kv + q_pe . k_pe``; its output is ``(attn . c_kv) W_uv``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpool.policy.kvspec import ExtraRecord, KVSpec

KV_LORA_RANK = 512
ROPE_DIM = 64
#: Bytes of the indexer key's float32 scale, and the alignment its record is padded to.
INDEX_SCALE_BYTES = 4
INDEX_ALIGN_BYTES = 16
#: The key is scaled so its largest element is this (float8_e4m3fn's largest finite value).
INDEX_QMAX = 448.0
#: The indexer's record name (``KVSpec.extra_records``, ``kernels.format.Segment.record``).
INDEXER = "indexer"


def indexer_record_bytes(index_dim: int, cache_dtype: torch.dtype) -> int:
    """Bytes of one token's indexer record: ``index_dim`` key elements of ``cache_dtype``, the
    float32 scale, zero padding to a multiple of 16 B (FP8, 128 dims: 144 B; bfloat16, 64 dims: 144 B)."""
    raw = index_dim * torch.empty((), dtype=cache_dtype).element_size() + INDEX_SCALE_BYTES
    return -(-raw // INDEX_ALIGN_BYTES) * INDEX_ALIGN_BYTES


@dataclass(frozen=True)
class RefConfig:
    """Geometry of the reference model.

    Attributes:
        stage_layers: layers per pipeline stage (e.g. ``(2, 2, 2)``: 6 layers, 3 stages).
        vocab: vocabulary size.
        d_model: hidden size.
        heads: attention heads.
        nope_dim: per-head query dim without RoPE (absorbed into the latent).
        v_dim: per-head value dim (up-projected from the latent).
        page_tokens: tokens per KV page.
        cache_dtype: dtype of the cached records (bfloat16 or float8_e4m3fn).
        seed: weight seed.
        rope_theta: RoPE base.
        ffn_dim: FFN hidden size (0: ``2 * d_model``).
        indexer_layers: layer ids carrying a DSA indexer (empty: no indexer, every layer dense).
        index_heads: indexer query heads.
        index_dim: indexer key / query width.
        index_topk: tokens an indexer layer's query attends to once its context is longer.
    """

    stage_layers: tuple[int, ...] = (2, 2, 2)
    vocab: int = 512
    d_model: int = 256
    heads: int = 2
    nope_dim: int = 64
    v_dim: int = 64
    page_tokens: int = 16
    cache_dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    rope_theta: float = 10000.0
    ffn_dim: int = 0
    indexer_layers: tuple[int, ...] = ()
    index_heads: int = 32
    index_dim: int = 128
    index_topk: int = 2048

    def __post_init__(self) -> None:
        if not self.stage_layers or any(n <= 0 for n in self.stage_layers):
            raise ValueError(f"stage_layers must be positive counts, got {self.stage_layers}")
        if min(self.vocab, self.d_model, self.heads, self.nope_dim, self.v_dim, self.page_tokens) <= 0:
            raise ValueError("vocab, d_model, heads, nope_dim, v_dim and page_tokens must be > 0")
        if min(self.index_heads, self.index_dim, self.index_topk) <= 0:
            raise ValueError("index_heads, index_dim and index_topk must be > 0")
        ids = self.indexer_layers
        if list(ids) != sorted(set(ids)) or any(not 0 <= i < self.layers for i in ids):
            raise ValueError(f"indexer_layers must be distinct increasing ids in [0, {self.layers}), got {ids}")
        if self.index_record_bytes % self.element_bytes:
            raise ValueError(f"the indexer record ({self.index_record_bytes} B) is not whole {self.cache_dtype} elements")

    @property
    def layers(self) -> int:
        return sum(self.stage_layers)

    @property
    def record_elems(self) -> int:
        return KV_LORA_RANK + ROPE_DIM

    @property
    def weight_bytes(self) -> int:
        """Bytes of the float32 weights ``RefModel`` builds (embedding, every layer, indexers, LM head)."""
        d, h, ffn = self.d_model, self.heads, self.ffn_dim or 2 * self.d_model
        per_layer = (2 * d + KV_LORA_RANK + d * KV_LORA_RANK + d * ROPE_DIM + d * h * (self.nope_dim + ROPE_DIM)
                     + h * KV_LORA_RANK * (self.nope_dim + self.v_dim) + h * self.v_dim * d + 2 * d * ffn)
        ih, idim = self.index_heads, self.index_dim
        per_indexer = d * idim + idim + d * ih * idim + d * ih
        return 4 * (2 * self.vocab * d + d + self.layers * per_layer + len(self.indexer_layers) * per_indexer)

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.cache_dtype).element_size()

    @property
    def record_bytes(self) -> int:
        return self.record_elems * self.element_bytes

    @property
    def index_record_bytes(self) -> int:
        """Bytes per token of an indexer layer's indexer record (see ``indexer_record_bytes``)."""
        return indexer_record_bytes(self.index_dim, self.cache_dtype)

    @property
    def index_record_elems(self) -> int:
        """The indexer record as ``cache_dtype`` elements (the last dim of an indexer cache)."""
        return self.index_record_bytes // self.element_bytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token over every layer: ``layers * record_bytes + indexer layers * index_record_bytes``."""
        return self.layers * self.record_bytes + len(self.indexer_layers) * self.index_record_bytes

    def kv_spec(self, model: str = "refmodel-mla") -> KVSpec:
        """The cache geometry as a ``KVSpec``: one ``"kv"`` record per layer, an ``"indexer"`` extra
        record on the indexer layers, the stage split."""
        extra = (ExtraRecord(INDEXER, self.index_record_bytes, self.indexer_layers),) if self.indexer_layers else ()
        return KVSpec(model=model, layers=self.layers, record_bytes=self.record_bytes, stage_layers=self.stage_layers,
                      extra_records=extra, page_tokens=self.page_tokens)

    def stage_segments(self, stage: int) -> list[tuple[int, str]]:
        """``(layer_id, record)`` of each of ``stage``'s caches in order: per layer ``"kv"``, then
        ``"indexer"`` on an indexer layer (``kernels.format.ChunkFormat.from_spec``'s segment order)."""
        start = sum(self.stage_layers[:stage])
        out: list[tuple[int, str]] = []
        for li in range(start, start + self.stage_layers[stage]):
            out.append((li, "kv"))
            if li in self.indexer_layers:
                out.append((li, INDEXER))
        return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def quantize_index_keys(k: torch.Tensor, config: RefConfig) -> torch.Tensor:
    """Indexer keys ``k [n, index_dim]`` (float32) as records ``[n, index_record_elems]`` of
    ``cache_dtype``: ``k / scale`` (``scale = max|k| / 448``), the float32 scale's 4 bytes, zeros."""
    n, dim_bytes = k.shape[0], config.index_dim * config.element_bytes
    scale = (k.abs().amax(dim=-1, keepdim=True) / INDEX_QMAX).clamp_min(torch.finfo(torch.float32).tiny)
    rec = torch.zeros(n, config.index_record_bytes, dtype=torch.uint8, device=k.device)
    rec[:, :dim_bytes] = (k / scale).to(config.cache_dtype).view(torch.uint8)
    rec[:, dim_bytes:dim_bytes + INDEX_SCALE_BYTES] = scale.contiguous().view(torch.uint8)
    return rec.view(config.cache_dtype)


def dequantize_index_keys(rec: torch.Tensor, config: RefConfig) -> torch.Tensor:
    """Float32 keys ``[n, index_dim]`` of indexer records ``rec [n, index_record_elems]``."""
    raw = rec.reshape(rec.shape[0], -1).view(torch.uint8)
    dim_bytes = config.index_dim * config.element_bytes
    q = raw[:, :dim_bytes].contiguous().view(config.cache_dtype).float()
    scale = raw[:, dim_bytes:dim_bytes + INDEX_SCALE_BYTES].contiguous().view(torch.float32)
    return q * scale


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Indexer scores ``[n, T]``: ``sum_j w[:, j] * ReLU(q[:, j] . k)`` for queries ``q [n, heads, dim]``,
    head weights ``w [n, heads]`` and keys ``k [T, dim]``."""
    return (torch.relu(torch.einsum("njd,td->njt", q, k)) * w[:, :, None]).sum(dim=1)


def select_topk(scores: torch.Tensor, pos: torch.Tensor, topk: int) -> torch.Tensor:
    """The indexer's choice, ``[n, T]`` bool: for query ``i`` at position ``pos[i]``, the ``topk``
    best ``scores[i, s]`` over ``s <= pos[i]`` (all of them when there are no more than ``topk``);
    among equal scores the lowest position first (a stable sort)."""
    T = scores.shape[1]
    causal = torch.arange(T, device=scores.device)[None, :] <= pos[:, None]
    order = torch.sort(scores.masked_fill(~causal, float("-inf")), dim=-1, descending=True, stable=True).indices
    chosen = torch.zeros_like(causal)
    chosen.scatter_(1, order[:, :topk], True)
    return chosen & causal


@dataclass(frozen=True)
class _Page:
    """One page of queries as every layer of a stage sees it: computed once per page, read by each
    layer, so a layer's step launches no work of its own for them and never waits for the device."""

    pos: torch.Tensor  # [n] absolute positions of the page's queries
    first: int  # pos[0], a multiple of the page size
    block: int  # the cache block that holds the page
    cos: torch.Tensor  # [n, 32] RoPE tables at pos
    sin: torch.Tensor
    future: torch.Tensor  # [n, first + n] True where the key comes after the query


class RefModel:
    """Seeded MLA-style decoder. See the module docstring."""

    def __init__(self, config: RefConfig = RefConfig(), device: torch.device | str = "cpu") -> None:
        self.config = c = config
        self.device = torch.device(device)
        g = torch.Generator().manual_seed(c.seed)

        def w(*shape: int) -> torch.Tensor:
            fan_in = shape[-2] if len(shape) >= 2 else shape[-1]
            return (torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(self.device)

        H, d = c.heads, c.d_model
        ffn = c.ffn_dim or 2 * d
        self.embed = (torch.randn(c.vocab, d, generator=g)).to(self.device)
        self.layers = []
        for _ in range(c.layers):
            self.layers.append({
                "ln1": torch.ones(d, device=self.device),
                "w_dkv": w(d, KV_LORA_RANK),
                "ln_kv": torch.ones(KV_LORA_RANK, device=self.device),
                "w_kr": w(d, ROPE_DIM),
                "w_qn": w(d, H * c.nope_dim),
                "w_qr": w(d, H * ROPE_DIM),
                "w_uk": w(H, c.nope_dim, KV_LORA_RANK),
                "w_uv": w(H, KV_LORA_RANK, c.v_dim),
                "w_o": w(H * c.v_dim, d),
                "ln2": torch.ones(d, device=self.device),
                "w1": w(d, ffn),
                "w2": w(ffn, d),
            })  # fmt: skip
        self.ln_f = torch.ones(d, device=self.device)
        self.lm_head = w(d, c.vocab)
        ih, idim = c.index_heads, c.index_dim
        for li in c.indexer_layers:  # drawn last: the other weights do not depend on the indexer
            self.layers[li].update({
                "w_ik": w(d, idim),
                "ln_ik": torch.ones(idim, device=self.device),
                "w_iq": w(d, ih * idim),
                "w_iw": w(d, ih),
            })  # fmt: skip
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float64) / ROPE_DIM))
        self._inv_freq = inv.to(self.device)

    # -- geometry ----------------------------------------------------------------------------
    def kv_spec(self, model: str = "refmodel-mla") -> KVSpec:
        """The cache geometry as a ``KVSpec`` (``RefConfig.kv_spec``)."""
        return self.config.kv_spec(model)

    def stage_layer_ids(self, stage: int) -> range:
        start = sum(self.config.stage_layers[:stage])
        return range(start, start + self.config.stage_layers[stage])

    def new_stage_caches(self, stage: int, num_blocks: int, device: torch.device | str | None = None) -> list[torch.Tensor]:
        """Stage ``stage``'s zeroed paged caches in segment order (``RefConfig.stage_segments``):
        ``[num_blocks, page_tokens, 576]`` latents, ``[num_blocks, page_tokens, index_record_elems]`` indexers."""
        c = self.config
        dev = self.device if device is None else torch.device(device)
        return [torch.zeros(num_blocks, c.page_tokens, c.record_elems if rec == "kv" else c.index_record_elems,
                            dtype=c.cache_dtype, device=dev) for _, rec in c.stage_segments(stage)]

    def new_caches(self, num_blocks: int, device: torch.device | str | None = None) -> list[list[torch.Tensor]]:
        """Per stage, its zeroed paged caches (``new_stage_caches``)."""
        return [self.new_stage_caches(s, num_blocks, device) for s in range(len(self.config.stage_layers))]

    # -- forward -----------------------------------------------------------------------------
    def _rope_tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's ``cos`` and ``sin`` ``[n, 32]`` (float32) at positions ``pos [n]``, on ``pos``'s device."""
        ang = pos.to(torch.float64)[:, None] * self._inv_freq.to(pos.device)[None, :]
        return ang.cos().float(), ang.sin().float()

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the last dim (pairs of halves) of ``x [n, ..., 64]`` by ``_rope_tables``' ``cos``, ``sin``."""
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        x1, x2 = x[..., : ROPE_DIM // 2], x[..., ROPE_DIM // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def index_query(self, li: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries ``[n, index_heads, index_dim]`` and head weights ``[n, index_heads]`` of
        layer ``li`` for the normed hidden states ``h [n, d_model]``."""
        c, p = self.config, self.layers[li]
        q = (h @ p["w_iq"]).view(h.shape[0], c.index_heads, c.index_dim)
        return q, (h @ p["w_iw"]) / math.sqrt(c.index_heads * c.index_dim)

    def index_keys(self, li: int, h: torch.Tensor) -> torch.Tensor:
        """Layer ``li``'s indexer records ``[n, index_record_elems]`` for the normed hidden states ``h``."""
        p = self.layers[li]
        return quantize_index_keys(_rms(h @ p["w_ik"], p["ln_ik"]), self.config)

    def _layer(self, li: int, x: torch.Tensor, page: _Page, cache: torch.Tensor, table: torch.Tensor,
               icache: torch.Tensor | None = None) -> torch.Tensor:
        c, p = self.config, self.layers[li]
        n, H, P = x.shape[0], c.heads, c.page_tokens
        p0, blk = page.first, page.block
        h = _rms(x, p["ln1"])
        ckv = _rms(h @ p["w_dkv"], p["ln_kv"])
        kpe = self._rotate(h @ p["w_kr"], page.cos, page.sin)
        rec = torch.cat([ckv, kpe], dim=-1).to(c.cache_dtype)
        cache[blk, p0 % P : p0 % P + n] = rec  # one page at a time (p0 is page-aligned)
        T = p0 + n
        mask = page.future
        if icache is not None:
            icache.view(torch.uint8)[blk, p0 % P : p0 % P + n] = self.index_keys(li, h).view(torch.uint8)
            if T > c.index_topk:
                ikeys = icache.view(torch.uint8)[table[: -(-T // P)]].reshape(-1, c.index_record_bytes)[:T]
                q, wts = self.index_query(li, h)
                mask = ~select_topk(index_scores(q, wts, dequantize_index_keys(ikeys, c)), page.pos, c.index_topk)
        keys = cache[table[: -(-T // P)]].reshape(-1, c.record_elems)[:T].float()
        ck, kr = keys[:, :KV_LORA_RANK], keys[:, KV_LORA_RANK:]
        qn = (h @ p["w_qn"]).view(n, H, c.nope_dim)
        qr = self._rotate((h @ p["w_qr"]).view(n, H, ROPE_DIM), page.cos, page.sin)
        qlat = torch.einsum("nhd,hdc->hnc", qn, p["w_uk"])
        scores = (qlat @ ck.T + qr.transpose(0, 1) @ kr.T) / math.sqrt(c.nope_dim + ROPE_DIM)
        scores = scores.masked_fill(mask[None], float("-inf"))
        olat = torch.softmax(scores, dim=-1) @ ck  # [H, n, 512]
        o = torch.einsum("hnc,hcv->nhv", olat, p["w_uv"]).reshape(n, H * c.v_dim) @ p["w_o"]
        x = x + o
        return x + torch.nn.functional.silu(_rms(x, p["ln2"]) @ p["w1"]) @ p["w2"]

    def _page(self, first: int, n: int, host_table: list[int]) -> _Page:
        """Page ``first // page_tokens``'s ``n`` queries as every layer of a stage sees them."""
        pos = torch.arange(first, first + n, device=self.device)
        cos, sin = self._rope_tables(pos)
        future = torch.arange(first + n, device=self.device)[None, :] > pos[:, None]
        return _Page(pos, first, host_table[first // self.config.page_tokens], cos, sin, future)

    @torch.no_grad()
    def embed_tokens(self, tokens: torch.Tensor | list[int]) -> torch.Tensor:
        """The input hidden states ``[n, d_model]`` of ``tokens`` (stage 0's input)."""
        tok = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        return self.embed[tok]

    @torch.no_grad()
    def stage_forward(
        self, stage: int, x: torch.Tensor, start_token: int, caches: list[torch.Tensor], block_ids: torch.Tensor
    ) -> torch.Tensor:
        """Run stage ``stage``'s layers over the hidden states ``x`` of tokens ``[start_token, start_token + n)``.

        One 16-token page of queries at a time (``start_token`` page-aligned), writing each page's
        records into ``caches`` (this stage's caches in ``stage_segments`` order) through
        ``block_ids`` before attending; the pages of ``[0, start_token)`` must already hold the
        prefix. Returns the hidden states for the next stage. Stage by stage gives the same bits as
        ``prefill``: a layer's page reads only that layer's earlier pages.
        """
        c = self.config
        if start_token % c.page_tokens:
            raise ValueError(f"start_token {start_token} must be a multiple of the page size {c.page_tokens}")
        table = block_ids.reshape(-1).to(torch.long)
        end = start_token + x.shape[0]
        if table.numel() * c.page_tokens < end:
            raise ValueError(f"block table of {table.numel()} pages is too short for {end} tokens")
        segs = c.stage_segments(stage)
        if len(caches) != len(segs):
            raise ValueError(f"stage {stage} has {len(segs)} caches (its layers and indexers), got {len(caches)}")
        by_layer: dict[int, list[torch.Tensor]] = {}
        for (li, _), cache in zip(segs, caches):
            by_layer.setdefault(li, []).append(cache)
        host_table = table.tolist()  # one read of the block table, not one per page and layer
        out = []
        for p0 in range(start_token, end, c.page_tokens):
            page = self._page(p0, min(c.page_tokens, end - p0), host_table)
            h = x[p0 - start_token : p0 - start_token + page.pos.numel()]
            for li in self.stage_layer_ids(stage):
                mine = by_layer[li]  # the latent cache, then the indexer cache on an indexer layer
                h = self._layer(li, h, page, mine[0], table, mine[1] if len(mine) > 1 else None)
            out.append(h)
        return torch.cat(out)

    @torch.no_grad()
    def logits(self, x_last: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[1, vocab]`` from the last stage's hidden state of the last token."""
        return _rms(x_last.reshape(1, -1), self.ln_f) @ self.lm_head

    @torch.no_grad()
    def prefill(
        self,
        tokens: torch.Tensor | list[int],
        caches: list[list[torch.Tensor]],
        block_ids: torch.Tensor,
        start_token: int = 0,
    ) -> torch.Tensor:
        """Compute tokens ``[start_token, len(tokens))``, every stage in turn; returns the last token's logits.

        ``caches[s]`` are stage ``s``'s per-layer caches; pages ``block_ids[k]`` hold tokens
        ``16k .. 16k+15`` and must already hold the prefix ``[0, start_token)`` on every stage.
        """
        tok = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        N = tok.numel()
        if not 0 <= start_token < N:
            raise ValueError(f"start_token {start_token} must be in [0, {N}): the last token is always computed")
        x = self.embed_tokens(tok[start_token:])
        for s in range(len(self.config.stage_layers)):
            x = self.stage_forward(s, x, start_token, caches[s], block_ids)
        return self.logits(x[-1:])


def gather_tokens(caches: list[list[torch.Tensor]], block_ids: torch.Tensor, n_tokens: int) -> list[torch.Tensor]:
    """The first ``n_tokens`` records of every cache (stage-major, layer order) through a block table."""
    out = []
    table = block_ids.reshape(-1).to(torch.long)
    for stage in caches:
        for cache in stage:
            P = cache.shape[1]
            out.append(cache[table[: -(-n_tokens // P)]].reshape(-1, cache.shape[-1])[:n_tokens])
    return out
