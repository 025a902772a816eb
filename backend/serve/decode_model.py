"""The reference model's decode step over DCP-sharded paged KV, batched and batch-invariant.

Contract:
    * ``DcpCaches(config, dcp, blocks_per_rank, devices, share=True)``: every DCP rank's paged KV,
      one ``[blocks_per_rank, page_tokens, 576]`` cache per layer of the model (``rank_caches[r]``,
      in layer order, on ``devices[r % len(devices)]``) and one ``[blocks_per_rank, page_tokens,
      index_record_elems]`` indexer cache per indexer layer (``rank_index_caches[r]``, in layer
      order; the same pages). Token ``t`` of a sequence lives on rank ``t mod dcp`` at local index
      ``t // dcp`` in both; a sequence's block table on rank ``r`` maps local pages to blocks of
      that rank (the layout ``kernels.scatter_dcp`` writes). When every rank is on one device (and
      ``share``), the ranks' caches of a layer are views of one tensor (``shared``,
      ``shared_index``). ``handoff_caches(r)``: rank ``r``'s latents then its indexer caches, the
      list a hand-off scatters into.
    * ``DecodeModel(model, caches, devices, tp=1, attention="auto")``: ``step(seqs) -> (next_tokens,
      logits)`` runs one decode step for a batch of ``DecodeSeq`` (the last token, its absolute
      position, the sequence's block tables). For each layer, the new token's MLA record is written
      into the rank that owns its position; each rank computes the new query's partial attention
      over its own tokens (running max, sum of exponentials, weighted latent sum), and the partials
      are merged exactly (log-sum-exp merge, in rank order); then the rest of the layer. The next
      token is the greedy argmax (ties: the lowest id).
    * The DSA indexer (``RefModel``'s): on an indexer layer the new token's indexer record is
      written into its rank's indexer cache like its latent. A sequence whose context (its new
      token included) holds at most ``index_topk`` tokens attends densely, through the path above;
      a longer one is overwritten by the sparse path, in torch, one sequence at a time: its
      indexer keys are read from every rank in position order, scored
      (``refmodel.index_scores``), the ``index_topk`` best chosen (``refmodel.select_topk``: ties
      to the lowest position), their latents gathered from their ranks in position order, and the
      query attends to those only.
    * Attention with ``shared`` caches: one ``kernels.attention.DecodePlan`` per step (every
      sequence's page rows, built on the host once and uploaded in one copy); per layer one indexed
      copy writes every sequence's new record and ``mla_decode`` (backend ``attention``: Triton on a
      GPU, the torch reference on the CPU under ``"auto"``) computes every sequence's attention, its
      parts being runs of one rank's tokens in rank order. Without ``shared`` caches each rank's
      partial is computed on its device, sequence by sequence.
    * Batch invariance: a sequence's logits do not depend on which other sequences share the step,
      nor on its row in the batch (bits, on one device type). Every row-wise op and product runs on
      blocks of exactly ``ROW_BLOCK`` rows (the last block padded with zero rows), so every kernel
      sees the same shapes whatever the batch size, and a GEMM's row never reads another row; the
      element-wise RoPE runs over all rows at once; attention's work for a sequence depends on that
      sequence alone (see ``kernels.attention``).
    * TP and the heads: the ``tp`` ranks' head groups are computed in this process, head ``h`` on
      ``devices[h * tp // heads]``. When every head is on ``devices[0]`` (any ``tp`` with one device),
      all heads run together: per row block one product gives the latent, the RoPE key, every
      head's RoPE query and every head's latent query (``w_qn[h] @ w_uk[h]`` absorbed into one
      weight), and one product gives every head's output projection (``w_uv[h] @ w_o[h]``
      absorbed). That path does not depend on ``tp``. Otherwise heads run one at a time on their
      devices and their output projections are summed in head order on ``devices[0]``: every
      product has the same shape whatever ``tp`` is, so the tokens do not depend on ``tp`` among
      such placements; the two paths round differently (the same tokens up to near-ties). The FFN
      and the logits run on ``devices[0]``; rank ``r``'s KV on ``devices[r % len(devices)]``.
    * The model's weights are ``RefModel``'s (same seed, same tensors); the step differs from
      ``RefModel.prefill`` only in the order of floating-point sums (the attention merge, the
      absorbed or per-head projections), so its tokens equal a recompute's up to near-ties of the
      logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpool.backend.refmodel import (
    INDEXER,
    KV_LORA_RANK,
    ROPE_DIM,
    RefConfig,
    RefModel,
    _rms,
    dequantize_index_keys,
    index_scores,
    quantize_index_keys,
    select_topk,
)
from kvpool.kernels.attention import DecodePlan, mla_decode
from kvpool.policy.layout import rank_token_count

#: Rows of every row-wise kernel launch (a batch is cut into blocks of this many rows).
ROW_BLOCK = 16
#: ``DecodeModel``'s ``attention`` choices (``kernels.attention.mla_decode``'s backends).
ATTENTION_BACKENDS = ("auto", "triton", "torch")
_EPS = 1e-6


def _read_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """The records of ``pages`` of ``cache`` in order, ``[pages * page_tokens, record]``; gathered as
    bytes (indexing is defined for uint8 on every device, not for every float8 type)."""
    rec = cache.shape[-1]
    raw = cache.view(torch.uint8)[pages]
    return raw.reshape(-1, raw.shape[-1]).view(cache.dtype).reshape(-1, rec)


def rank_pages(tokens: int, rank: int, dcp: int, page_tokens: int) -> int:
    """Pages rank ``rank`` needs to hold its share of a sequence's first ``tokens`` tokens."""
    return -(-rank_token_count(tokens, rank, dcp) // page_tokens)


class DcpCaches:
    """Every DCP rank's paged KV of one decode instance (see the module docstring)."""

    def __init__(self, config: RefConfig, dcp: int, blocks_per_rank: int, devices: Sequence[str | torch.device],
                 share: bool = True) -> None:
        if dcp <= 0 or blocks_per_rank <= 0 or not devices:
            raise ValueError(f"need dcp > 0, blocks_per_rank > 0 and a device, got {dcp}, {blocks_per_rank}, {devices}")
        self.config = config
        self.dcp = dcp
        self.blocks_per_rank = blocks_per_rank
        self.devices = [torch.device(devices[r % len(devices)]) for r in range(dcp)]
        #: per layer, every rank's pages in one tensor when all ranks share a device and ``share``
        #: (rank ``r``'s cache is rows ``r * blocks_per_rank ..`` of it); None otherwise
        self.shared: list[torch.Tensor] | None = None
        self.shared_index: list[torch.Tensor] | None = None
        self.rank_caches = self._make(config.record_elems, config.layers, share, "shared")
        self.rank_index_caches = self._make(config.index_record_elems, len(config.indexer_layers), share, "shared_index")

    def _make(self, elems: int, count: int, share: bool, shared_attr: str) -> list[list[torch.Tensor]]:
        c, B = self.config, self.blocks_per_rank
        shape = (B, c.page_tokens, elems)
        if share and len(set(self.devices)) == 1:
            big = [torch.zeros(self.dcp * B, *shape[1:], dtype=c.cache_dtype, device=self.devices[0]) for _ in range(count)]
            setattr(self, shared_attr, big)
            return [[t[r * B:(r + 1) * B] for t in big] for r in range(self.dcp)]
        return [[torch.zeros(*shape, dtype=c.cache_dtype, device=dev) for _ in range(count)] for dev in self.devices]

    def cache_of(self, rank: int, layer: int, record: str = "kv") -> torch.Tensor:
        """Rank ``rank``'s cache of ``layer``'s ``record`` (``"kv"`` or ``"indexer"``)."""
        if record == "kv":
            return self.rank_caches[rank][layer]
        if record == INDEXER:
            return self.rank_index_caches[rank][self.config.indexer_layers.index(layer)]
        raise ValueError(f"record must be 'kv' or {INDEXER!r}, got {record!r}")

    def handoff_caches(self, rank: int) -> list[torch.Tensor]:
        """Rank ``rank``'s caches as a hand-off sees them: every layer's latent, then every indexer layer's indexer."""
        return self.rank_caches[rank] + self.rank_index_caches[rank]


@dataclass
class DecodeSeq:
    """One running sequence as a decode step sees it.

    Attributes:
        token: the last token (its KV is not cached yet; this step writes it).
        position: its absolute position (the prompt's tokens are ``0 .. prompt - 1``).
        tables: per DCP rank, the sequence's block table on that rank (int64, on the rank's device),
            long enough for local index ``position // dcp``.
        pages: the same tables as host lists (optional: the record write then reads its block id
            from ``tables``, a device synchronization on a GPU).
    """

    token: int
    position: int
    tables: list[torch.Tensor]
    pages: list[list[int]] | None = None


class DecodeModel:
    """One decode step of ``RefModel`` over ``DcpCaches`` (see the module docstring)."""

    def __init__(self, model: RefModel, caches: DcpCaches, devices: Sequence[str | torch.device], tp: int = 1,
                 attention: str = "auto") -> None:
        c = model.config
        if tp <= 0:
            raise ValueError(f"tp must be > 0, got {tp}")
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention: expected one of {', '.join(ATTENTION_BACKENDS)}, got {attention!r}")
        self.model, self.config, self.kv, self.attention = model, c, caches, attention
        self.dcp = caches.dcp
        self.dev0 = torch.device(devices[0])
        if model.device != self.dev0:
            raise ValueError(f"the model's weights are on {model.device}, devices[0] is {self.dev0}")
        #: per indexer layer id: its index in ``rank_index_caches`` and its fused indexer weight
        #: ``[d, index_dim + index_heads * index_dim + index_heads]`` (key, queries, head weights)
        self.index_of = {li: k for k, li in enumerate(c.indexer_layers)}
        self.w_index = {li: torch.cat([model.layers[li]["w_ik"], model.layers[li]["w_iq"], model.layers[li]["w_iw"]],
                                      dim=1).contiguous() for li in c.indexer_layers}
        H = c.heads
        self.head_dev = [torch.device(devices[(h * tp // H) % len(devices)]) for h in range(H)]
        self.scale = 1.0 / math.sqrt(c.nope_dim + ROPE_DIM)
        #: per layer, the one-device path's fused weights (every head on devices[0]); None otherwise
        self.fused: list[dict[str, torch.Tensor]] | None = None
        #: per layer, per head: contiguous weights on the head's device (heads on several devices)
        self.heads: list[list[dict[str, torch.Tensor]]] = []
        if all(dev == self.dev0 for dev in self.head_dev):
            self.fused = [self._fuse(p) for p in model.layers]
            return
        for p in model.layers:
            per = []
            for h in range(H):
                dev = self.head_dev[h]
                per.append({
                    "w_qn": p["w_qn"][:, h * c.nope_dim:(h + 1) * c.nope_dim].contiguous().to(dev),
                    "w_qr": p["w_qr"][:, h * ROPE_DIM:(h + 1) * ROPE_DIM].contiguous().to(dev),
                    "w_uk": p["w_uk"][h].contiguous().to(dev),                            # [nope, 512]
                    "w_uv": p["w_uv"][h].contiguous().to(dev),                            # [512, v]
                    "w_o": p["w_o"][h * c.v_dim:(h + 1) * c.v_dim].contiguous().to(dev),  # [v, d]
                })  # fmt: skip
            self.heads.append(per)

    # ---- one step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, seqs: Sequence[DecodeSeq], between_layers: Callable[[], None] | None = None
             ) -> tuple[list[int], torch.Tensor]:
        """Run one decode step; returns each sequence's next token and its logits ``[n, vocab]``.
        ``between_layers`` is called after each layer but the last (the engine polls its hand-off
        side channels there, so a long step does not hold landing slots back)."""
        n = len(seqs)
        if n == 0:
            return [], torch.empty(0, self.config.vocab, device=self.dev0)
        B = ROW_BLOCK
        blocks = -(-n // B)
        tok = torch.zeros(blocks * B, dtype=torch.long, device=self.dev0)
        pos = torch.zeros(blocks * B, dtype=torch.long, device=self.dev0)
        tok[:n] = torch.tensor([s.token for s in seqs], dtype=torch.long)
        pos[:n] = torch.tensor([s.position for s in seqs], dtype=torch.long)
        x = [self.model.embed[tok[b * B:(b + 1) * B]] for b in range(blocks)]
        x = [xb * (torch.arange(b * B, (b + 1) * B, device=self.dev0) < n)[:, None] for b, xb in enumerate(x)]
        posb = [pos[b * B:(b + 1) * B] for b in range(blocks)]
        plan = self._plan(seqs) if self.kv.shared is not None else None
        rope = self._rope_tables(pos) if self.fused is not None else None
        olat = torch.zeros(blocks * B, self.config.heads, KV_LORA_RANK, device=self.dev0)
        for li in range(self.config.layers):
            if self.fused is not None:
                rec, qlat, qr = self._pre_fused(li, x, rope)
            else:
                rec, qlat, qr = (torch.cat(t) for t in zip(*(self._pre(li, x[b], posb[b]) for b in range(blocks))))
            index = self._index_pre(li, x) if li in self.index_of else None
            if index is not None:
                self._write_index(li, seqs, plan, index[0][:n])
            if plan is not None:
                self._attend_plan(li, plan, rec[:n], qlat, qr, olat)
            else:
                for i, s in enumerate(seqs):
                    olat[i] = self._attend(li, s, rec[i], qlat[i], qr[i])
            if index is not None:
                for i, s in enumerate(seqs):
                    if s.position + 1 > self.config.index_topk:
                        olat[i] = self._attend_sparse(li, s, qlat[i], qr[i], index[1][i], index[2][i])
            post = self._post_fused if self.fused is not None else self._post
            x = [post(li, x[b], olat[b * B:(b + 1) * B]) for b in range(blocks)]
            if between_layers is not None and li + 1 < self.config.layers:
                between_layers()
        logits = torch.cat([_rms(xb, self.model.ln_f) @ self.model.lm_head for xb in x])[:n]
        return logits.argmax(dim=-1).tolist(), logits

    # ---- the layer on one device: every head in one product -----------------------------------

    def _fuse(self, p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One layer's weights for the one-device path: ``w_in [d, 576 + H * 64 + H * 512]`` (the
        latent, the RoPE key, every head's RoPE query and every head's absorbed latent query
        ``w_qn[h] @ w_uk[h]``) and ``w_out [H * 512, d]`` (every head's ``w_uv[h] @ w_o[h]``); the
        absorbed products are formed in float64 and rounded once."""
        c, H = self.config, self.config.heads
        d = c.d_model
        qabs = torch.einsum("dhn,hnc->dhc", p["w_qn"].double().view(d, H, c.nope_dim), p["w_uk"].double())
        out = torch.einsum("hcv,hvd->hcd", p["w_uv"].double(), p["w_o"].double().view(H, c.v_dim, d))
        w_in = torch.cat([p["w_dkv"], p["w_kr"], p["w_qr"], qabs.reshape(d, H * KV_LORA_RANK).float()], dim=1)
        return {"w_in": w_in.contiguous(), "w_out": out.reshape(H * KV_LORA_RANK, d).float().contiguous()}

    def _rope_tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the RoPE factors ``(C, S) [rows, 1, 64]``: ``rope(x) = x * C + roll(x, 32) * S``
        (``C = [cos, cos]``, ``S = [-sin, sin]``: ``RefModel``'s rotation, the same products)."""
        cos, sin = self.model._rope_tables(pos)
        return torch.cat([cos, cos], dim=-1)[:, None], torch.cat([-sin, sin], dim=-1)[:, None]

    def _pre_fused(self, li: int, x: list[torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row block of ``x``: records ``[rows, 576]`` (cache dtype), latent queries
        ``[rows, H, 512]`` and rotated RoPE queries ``[rows, H, 64]`` (views of one product per
        block; the norms and products run per block of ``ROW_BLOCK`` rows, the element-wise RoPE
        over all rows)."""
        c, p, w = self.config, self.model.layers[li], self.fused[li]
        B, H, L = ROW_BLOCK, c.heads, KV_LORA_RANK
        y = torch.empty(len(x) * B, w["w_in"].shape[1], device=self.dev0)
        for b, xb in enumerate(x):
            torch.matmul(F.rms_norm(xb, (c.d_model,), p["ln1"], _EPS), w["w_in"], out=y[b * B:(b + 1) * B])
        norms = [F.rms_norm(y[b * B:(b + 1) * B, :L], (L,), p["ln_kv"], _EPS) for b in range(len(x))]
        ckv = norms[0] if len(norms) == 1 else torch.cat(norms)
        r = y[:, L:L + (H + 1) * ROPE_DIM].view(-1, H + 1, ROPE_DIM)
        r = r * rope[0] + torch.roll(r, ROPE_DIM // 2, dims=-1) * rope[1]
        rec = torch.cat([ckv, r[:, 0]], dim=-1).to(c.cache_dtype)
        return rec, y[:, L + (H + 1) * ROPE_DIM:].view(-1, H, L), r[:, 1:]

    def _post_fused(self, li: int, x: torch.Tensor, olat: torch.Tensor) -> torch.Tensor:
        """Rows ``x [B, d]`` and their attention latents ``olat [B, H, 512]``: every head's output
        projection in one product, the residual, the FFN."""
        p = self.model.layers[li]
        x = x + olat.reshape(olat.shape[0], -1) @ self.fused[li]["w_out"]
        return x + F.silu(F.rms_norm(x, (x.shape[-1],), p["ln2"], _EPS) @ p["w1"]) @ p["w2"]

    # ---- attention over shared caches: every sequence in one plan ------------------------------

    def _plan(self, seqs: Sequence[DecodeSeq]) -> DecodePlan:
        """This step's attention tables (host lists to one device tensor, once per step)."""
        pages = [s.pages if s.pages is not None else [t.tolist() for t in s.tables] for s in seqs]
        return DecodePlan.build(pages, [s.position for s in seqs], self.dcp, self.kv.blocks_per_rank,
                                self.config.page_tokens, self.kv.devices[0])

    def _attend_plan(self, li: int, plan: DecodePlan, rec: torch.Tensor, qlat: torch.Tensor, qr: torch.Tensor,
                     olat: torch.Tensor) -> None:
        """Write every sequence's new record (one indexed copy), then every sequence's attention
        (``kernels.attention.mla_decode``) into rows ``0 .. n`` of ``olat``."""
        cache = self.kv.shared[li]
        dev = cache.device
        cache.view(torch.uint8)[plan.write_block, plan.write_slot] = rec.to(dev).view(torch.uint8)
        out = olat if olat.device == dev else torch.zeros_like(olat, device=dev)
        mla_decode(cache, qlat.to(dev), qr.to(dev), plan, self.scale, out, self.attention)
        if out is not olat:
            olat.copy_(out)

    # ---- the DSA indexer --------------------------------------------------------------------------

    def _index_pre(self, li: int, x: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row block of ``x``: indexer records ``[rows, index_record_elems]`` (cache dtype),
        queries ``[rows, index_heads, index_dim]`` and head weights ``[rows, index_heads]`` (one
        product per block of ``ROW_BLOCK`` rows)."""
        c, p, w = self.config, self.model.layers[li], self.w_index[li]
        B, IH, D = ROW_BLOCK, c.index_heads, c.index_dim
        y = torch.empty(len(x) * B, w.shape[1], device=self.dev0)
        for b, xb in enumerate(x):
            torch.matmul(F.rms_norm(xb, (c.d_model,), p["ln1"], _EPS), w, out=y[b * B:(b + 1) * B])
        keys = torch.cat([F.rms_norm(y[b * B:(b + 1) * B, :D], (D,), p["ln_ik"], _EPS) for b in range(len(x))])
        q = y[:, D:D + IH * D].view(-1, IH, D)
        return quantize_index_keys(keys, c), q, y[:, D + IH * D:] / math.sqrt(IH * D)

    def _write_index(self, li: int, seqs: Sequence[DecodeSeq], plan: DecodePlan | None, irec: torch.Tensor) -> None:
        """Every sequence's new indexer record into its rank's indexer cache."""
        k = self.index_of[li]
        if plan is not None:
            cache = self.kv.shared_index[k]
            cache.view(torch.uint8)[plan.write_block, plan.write_slot] = irec.to(cache.device).view(torch.uint8)
            return
        R, P = self.dcp, self.config.page_tokens
        for i, s in enumerate(seqs):
            owner, local = s.position % R, s.position // R
            cache = self.kv.rank_index_caches[owner][k]
            blk = s.pages[owner][local // P] if s.pages is not None else int(s.tables[owner][local // P])
            cache[blk, local % P] = irec[i].to(cache.device)

    def _attend_sparse(self, li: int, s: DecodeSeq, qlat: torch.Tensor, qr: torch.Tensor, qi: torch.Tensor,
                       wi: torch.Tensor) -> torch.Tensor:
        """The query's attention ``[H, 512]`` over the ``index_topk`` tokens its indexer chooses
        among the sequence's ``position + 1`` tokens (see the module docstring)."""
        c, R, P = self.config, self.dcp, self.config.page_tokens
        T = s.position + 1
        k = self.index_of[li]
        ikeys = torch.empty(T, c.index_record_bytes, dtype=torch.uint8, device=self.dev0)
        for r in range(R):
            n_r = rank_token_count(T, r, R)
            if n_r:
                cache = self.kv.rank_index_caches[r][k]
                ikeys[r::R] = _read_pages(cache, s.tables[r][: -(-n_r // P)])[:n_r].view(torch.uint8).to(self.dev0)
        scores = index_scores(qi[None], wi[None], dequantize_index_keys(ikeys, c))
        pos = torch.tensor([T - 1], device=self.dev0)
        sel = select_topk(scores, pos, c.index_topk)[0].nonzero().squeeze(1)   # positions, ascending
        rows = torch.empty(sel.numel(), c.record_bytes, dtype=torch.uint8, device=self.dev0)
        for r in range(R):
            mine = (sel % R) == r
            if not bool(mine.any()):
                continue
            cache = self.kv.rank_caches[r][li]
            local = (sel[mine] // R).to(cache.device)
            blk = s.tables[r][local // P]
            rows[mine] = cache.view(torch.uint8)[blk, local % P].to(self.dev0)
        keys = rows.view(c.cache_dtype).float()
        ck, kr = keys[:, :KV_LORA_RANK], keys[:, KV_LORA_RANK:]
        att = torch.softmax((qlat @ ck.T + qr @ kr.T) * self.scale, dim=-1)    # [H, topk]
        return att @ ck

    # ---- the layer head by head (heads on several devices) -------------------------------------


    def _pre(self, li: int, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``x [B, d]`` at ``pos [B]``: their records ``[B, 576]`` (cache dtype), latent
        queries ``[B, H, 512]`` and rotated RoPE queries ``[B, H, 64]``."""
        c, p = self.config, self.model.layers[li]
        h = _rms(x, p["ln1"])
        ckv = _rms(h @ p["w_dkv"], p["ln_kv"])
        kpe = self._rope(h @ p["w_kr"], pos)
        rec = torch.cat([ckv, kpe], dim=-1).to(c.cache_dtype)
        qlat, qr = [], []
        for hw, dev in zip(self.heads[li], self.head_dev):
            hd, pd = h.to(dev), pos.to(dev)
            qlat.append((hd @ hw["w_qn"] @ hw["w_uk"]).to(self.dev0))
            qr.append(self._rope(hd @ hw["w_qr"], pd).to(self.dev0))
        return rec, torch.stack(qlat, dim=1), torch.stack(qr, dim=1)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``RefModel``'s RoPE of rows ``x [B, 64]`` at ``pos [B]`` (both on one device)."""
        return self.model._rotate(x, *self.model._rope_tables(pos))

    def _attend(self, li: int, s: DecodeSeq, rec: torch.Tensor, qlat: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        """Caches not shared (ranks on several devices): write the new token's record on its rank,
        then the exact merge of every rank's partial attention of the query (``qlat [H, 512]``,
        ``qr [H, 64]``) over that rank's tokens, each rank's partial on its device."""
        c, R, P = self.config, self.dcp, self.config.page_tokens
        t = s.position
        owner, local = t % R, t // R
        cache = self.kv.rank_caches[owner][li]
        blk = s.pages[owner][local // P] if s.pages is not None else int(s.tables[owner][local // P])
        cache[blk, local % P] = rec.to(cache.device)       # plain indexing: a copy, for every dtype
        parts = []
        for r in range(R):
            n_r = rank_token_count(t + 1, r, R)
            if n_r == 0:
                continue
            cache = self.kv.rank_caches[r][li]
            dev = cache.device
            keys = _read_pages(cache, s.tables[r][: -(-n_r // P)])[:n_r].float()
            ck, kr = keys[:, :KV_LORA_RANK], keys[:, KV_LORA_RANK:]
            scores = (qlat.to(dev) @ ck.T + qr.to(dev) @ kr.T) * self.scale          # [H, n_r]
            mx = scores.max(dim=-1, keepdim=True).values
            e = torch.exp(scores - mx)
            parts.append((mx.to(self.dev0), e.sum(dim=-1, keepdim=True).to(self.dev0), (e @ ck).to(self.dev0)))
        top = parts[0][0]
        for mx, _, _ in parts[1:]:
            top = torch.maximum(top, mx)
        num = torch.zeros(c.heads, KV_LORA_RANK, device=self.dev0)
        den = torch.zeros(c.heads, 1, device=self.dev0)
        for mx, l_r, o_r in parts:
            w = torch.exp(mx - top)
            num = num + w * o_r
            den = den + w * l_r
        return num / den

    def _post(self, li: int, x: torch.Tensor, olat: torch.Tensor) -> torch.Tensor:
        """Rows ``x [B, d]`` and their attention latents ``olat [B, H, 512]``: the output projection
        (per head, summed in head order), the residual, the FFN."""
        p = self.model.layers[li]
        o = torch.zeros_like(x)
        for h, (hw, dev) in enumerate(zip(self.heads[li], self.head_dev)):
            o = o + (olat[:, h].contiguous().to(dev) @ hw["w_uv"] @ hw["w_o"]).to(self.dev0)
        x = x + o
        return x + torch.nn.functional.silu(_rms(x, p["ln2"]) @ p["w1"]) @ p["w2"]
