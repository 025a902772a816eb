"""A small reference MLA-style attention model with paged KV, split into pipeline stages.

Used to check the real KV paths end to end: KV restored from a pool (or handed off) must give
bit-identical KV pages and identical next-token logits to recomputing the whole prefill.

Primitives:
    ``RefConfig``                       geometry (a 512 + 64 latent per token per layer, 16-token pages)
    ``RefModel(config)``                seeded random weights (``torch.Generator``; no global RNG)
    ``RefModel.kv_spec()``              the ``KVSpec`` of its cache (one ``"kv"`` record per layer)
    ``RefModel.new_caches(num_blocks)`` per stage, one paged cache ``[blocks, 16, 576]`` per layer
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

MLA in the absorbed form (DeepSeek-V2/V3, GLM-5): per token and layer the cache holds the
compressed latent ``c_kv`` (512, RMS-normed) and the RoPE key ``k_pe`` (64, rotated before
caching). A head's score is ``q_nope W_uk . c_kv + q_pe . k_pe``; its output is ``(attn . c_kv) W_uv``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpool.policy.kvspec import KVSpec

KV_LORA_RANK = 512
ROPE_DIM = 64


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

    def __post_init__(self) -> None:
        if not self.stage_layers or any(n <= 0 for n in self.stage_layers):
            raise ValueError(f"stage_layers must be positive counts, got {self.stage_layers}")
        if min(self.vocab, self.d_model, self.heads, self.nope_dim, self.v_dim, self.page_tokens) <= 0:
            raise ValueError("vocab, d_model, heads, nope_dim, v_dim and page_tokens must be > 0")

    @property
    def layers(self) -> int:
        return sum(self.stage_layers)

    @property
    def record_elems(self) -> int:
        return KV_LORA_RANK + ROPE_DIM

    @property
    def weight_bytes(self) -> int:
        """Bytes of the float32 weights ``RefModel`` builds (embedding, every layer, LM head)."""
        d, h, ffn = self.d_model, self.heads, self.ffn_dim or 2 * self.d_model
        per_layer = (2 * d + KV_LORA_RANK + d * KV_LORA_RANK + d * ROPE_DIM + d * h * (self.nope_dim + ROPE_DIM)
                     + h * KV_LORA_RANK * (self.nope_dim + self.v_dim) + h * self.v_dim * d + 2 * d * ffn)
        return 4 * (2 * self.vocab * d + d + self.layers * per_layer)

    @property
    def record_bytes(self) -> int:
        return self.record_elems * torch.empty((), dtype=self.cache_dtype).element_size()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


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
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float64) / ROPE_DIM))
        self._inv_freq = inv.to(self.device)

    # -- geometry ----------------------------------------------------------------------------
    def kv_spec(self, model: str = "refmodel-mla") -> KVSpec:
        """The cache geometry as a ``KVSpec`` (one record per layer, the model's stage split)."""
        c = self.config
        return KVSpec(model=model, layers=c.layers, record_bytes=c.record_bytes, stage_layers=c.stage_layers, page_tokens=c.page_tokens)

    def stage_layer_ids(self, stage: int) -> range:
        start = sum(self.config.stage_layers[:stage])
        return range(start, start + self.config.stage_layers[stage])

    def new_caches(self, num_blocks: int, device: torch.device | str | None = None) -> list[list[torch.Tensor]]:
        """Per stage, one zeroed paged cache ``[num_blocks, page_tokens, 576]`` per layer of the stage."""
        c = self.config
        dev = self.device if device is None else torch.device(device)
        return [
            [torch.zeros(num_blocks, c.page_tokens, c.record_elems, dtype=c.cache_dtype, device=dev) for _ in self.stage_layer_ids(s)]
            for s in range(len(c.stage_layers))
        ]

    # -- forward -----------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate the last dim (pairs of halves) of ``x`` [n, ..., 64] by positions ``pos`` [n]."""
        ang = pos.to(torch.float64)[:, None] * self._inv_freq[None, :]
        cos, sin = ang.cos().float(), ang.sin().float()
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        x1, x2 = x[..., : ROPE_DIM // 2], x[..., ROPE_DIM // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def _layer(self, li: int, x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        c, p = self.config, self.layers[li]
        n, H, P = x.shape[0], c.heads, c.page_tokens
        p0 = int(pos[0])
        h = _rms(x, p["ln1"])
        ckv = _rms(h @ p["w_dkv"], p["ln_kv"])
        kpe = self._rope(h @ p["w_kr"], pos)
        rec = torch.cat([ckv, kpe], dim=-1).to(c.cache_dtype)
        blk = int(table[p0 // P])
        cache[blk, p0 % P : p0 % P + n] = rec  # one page at a time (p0 is page-aligned)
        T = p0 + n
        keys = cache[table[: -(-T // P)]].reshape(-1, c.record_elems)[:T].float()
        ck, kr = keys[:, :KV_LORA_RANK], keys[:, KV_LORA_RANK:]
        qn = (h @ p["w_qn"]).view(n, H, c.nope_dim)
        qr = self._rope((h @ p["w_qr"]).view(n, H, ROPE_DIM), pos)
        qlat = torch.einsum("nhd,hdc->hnc", qn, p["w_uk"])
        scores = (qlat @ ck.T + qr.transpose(0, 1) @ kr.T) / math.sqrt(c.nope_dim + ROPE_DIM)
        mask = torch.arange(T, device=x.device)[None, :] > pos[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        olat = torch.softmax(scores, dim=-1) @ ck  # [H, n, 512]
        o = torch.einsum("hnc,hcv->nhv", olat, p["w_uv"]).reshape(n, H * c.v_dim) @ p["w_o"]
        x = x + o
        return x + torch.nn.functional.silu(_rms(x, p["ln2"]) @ p["w1"]) @ p["w2"]

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
        records into ``caches`` (this stage's per-layer caches) through ``block_ids`` before
        attending; the pages of ``[0, start_token)`` must already hold the prefix. Returns the
        hidden states for the next stage. Stage by stage gives the same bits as ``prefill``: a
        layer's page reads only that layer's earlier pages.
        """
        c = self.config
        if start_token % c.page_tokens:
            raise ValueError(f"start_token {start_token} must be a multiple of the page size {c.page_tokens}")
        table = block_ids.reshape(-1).to(torch.long)
        end = start_token + x.shape[0]
        if table.numel() * c.page_tokens < end:
            raise ValueError(f"block table of {table.numel()} pages is too short for {end} tokens")
        out = []
        for p0 in range(start_token, end, c.page_tokens):
            pos = torch.arange(p0, min(p0 + c.page_tokens, end), device=self.device)
            h = x[p0 - start_token : p0 - start_token + pos.numel()]
            for i, li in enumerate(self.stage_layer_ids(stage)):
                h = self._layer(li, h, pos, caches[i], table)
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
