"""The reference model's decode step over DCP-sharded paged KV, batched and batch-invariant.

Contract:
    * ``DcpCaches(config, dcp, blocks_per_rank, devices, share=True)``: every DCP rank's paged KV,
      one ``[blocks_per_rank, page_tokens, 576]`` cache per layer of the model (``rank_caches[r]``,
      in layer order, on ``devices[r % len(devices)]``). Token ``t`` of a sequence lives on rank
      ``t mod dcp`` at local index ``t // dcp``; a sequence's block table on rank ``r`` maps local
      pages to blocks of that rank (the layout ``kernels.scatter_dcp`` writes). When every rank is
      on one device (and ``share``), the ranks' caches of a layer are views of one tensor
      (``shared``).
    * ``DecodeModel(model, caches, devices, tp=1)``: ``step(seqs) -> (next_tokens, logits)`` runs one
      decode step for a batch of ``DecodeSeq`` (the last token, its absolute position, the
      sequence's block tables). For each layer, the new token's MLA record is written into the rank
      that owns its position; each rank computes the new query's partial attention over its own
      tokens (running max, sum of exponentials, weighted latent sum), and the partials are merged
      exactly (log-sum-exp merge, ranks in order); then the rest of the layer. The next token is
      the greedy argmax (ties: the lowest id).
    * Batch invariance: a sequence's logits do not depend on which other sequences share the step,
      nor on its row in the batch (bits, on one device type). Every row-wise op runs on blocks of
      exactly ``ROW_BLOCK`` rows (the last block padded with zero rows), so every kernel sees the
      same shapes whatever the batch size, and a GEMM's row never reads another row; attention
      runs per sequence, with shapes that depend on that sequence alone (with ``shared`` caches,
      one gather and one batched product give every rank's partial of the sequence; otherwise
      each rank's partial is computed on its device, one by one).
    * TP: the ``tp`` ranks' head groups are computed in this process. Head ``h``'s projections run on
      ``devices[h * tp // heads]``, one head at a time, and the heads' output projections are summed
      in head order on ``devices[0]``: every product has the same shape whatever ``tp`` is, so the
      tokens do not depend on ``tp``. The FFN and the logits run on ``devices[0]``; rank ``r``'s
      KV and its partial attention on ``devices[r % len(devices)]``.
    * The model's weights are ``RefModel``'s (same seed, same tensors); the step differs from
      ``RefModel.prefill`` only in the order of floating-point sums (the attention merge, the
      per-head output sum), so its tokens equal a recompute's up to near-ties of the logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvpool.backend.refmodel import KV_LORA_RANK, ROPE_DIM, RefConfig, RefModel, _rms
from kvpool.policy.layout import rank_token_count

#: Rows of every row-wise kernel launch (a batch is cut into blocks of this many rows).
ROW_BLOCK = 16


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
        shape = (blocks_per_rank, config.page_tokens, config.record_elems)
        if share and len(set(self.devices)) == 1:
            self.shared = [torch.zeros(dcp * shape[0], *shape[1:], dtype=config.cache_dtype, device=self.devices[0])
                           for _ in range(config.layers)]
            self.rank_caches = [[big[r * shape[0]:(r + 1) * shape[0]] for big in self.shared] for r in range(dcp)]
        else:
            self.rank_caches = [[torch.zeros(*shape, dtype=config.cache_dtype, device=dev)
                                 for _ in range(config.layers)] for dev in self.devices]


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

    def __init__(self, model: RefModel, caches: DcpCaches, devices: Sequence[str | torch.device], tp: int = 1) -> None:
        c = model.config
        if tp <= 0:
            raise ValueError(f"tp must be > 0, got {tp}")
        self.model, self.config, self.kv = model, c, caches
        self.dcp = caches.dcp
        self.dev0 = torch.device(devices[0])
        if model.device != self.dev0:
            raise ValueError(f"the model's weights are on {model.device}, devices[0] is {self.dev0}")
        H = c.heads
        self.head_dev = [torch.device(devices[(h * tp // H) % len(devices)]) for h in range(H)]
        self.scale = 1.0 / math.sqrt(c.nope_dim + ROPE_DIM)
        # per layer, per head: contiguous weights on the head's device
        self.heads: list[list[dict[str, torch.Tensor]]] = []
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
        views = [self._view(s) for s in seqs] if self.kv.shared is not None else [None] * n
        for li in range(self.config.layers):
            pre = [self._pre(li, x[b], posb[b]) for b in range(blocks)]
            olat = torch.zeros(blocks * B, self.config.heads, KV_LORA_RANK, device=self.dev0)
            for i, s in enumerate(seqs):
                rec, qlat, qr = (t[i % B] for t in pre[i // B])
                olat[i] = self._attend(li, s, rec, qlat, qr, views[i])
            x = [self._post(li, x[b], olat[b * B:(b + 1) * B]) for b in range(blocks)]
            if between_layers is not None and li + 1 < self.config.layers:
                between_layers()
        logits = torch.cat([_rms(xb, self.model.ln_f) @ self.model.lm_head for xb in x])[:n]
        return logits.argmax(dim=-1).tolist(), logits

    # ---- the layer, in three parts ------------------------------------------------------------

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
        """``RefModel``'s RoPE of rows ``x [B, 64]`` at ``pos [B]``, on ``x``'s device."""
        inv = self.model._inv_freq.to(x.device)
        ang = pos.to(torch.float64)[:, None] * inv[None, :]
        cos, sin = ang.cos().float(), ang.sin().float()
        x1, x2 = x[..., : ROPE_DIM // 2], x[..., ROPE_DIM // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def _view(self, s: DecodeSeq) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One sequence's view of the shared caches for this step: the pages of its ranks that hold
        tokens (``[ranks, pages]`` rows of ``kv.shared``; a rank with a page fewer repeats its
        first), the mask of its tokens ``[ranks, 1, n_max]`` and ``n_max``, the most tokens a rank
        holds. The same for every layer; it depends on this sequence alone."""
        R, P, nb = self.dcp, self.config.page_tokens, self.kv.blocks_per_rank
        n = s.position + 1
        ranks = min(R, n)
        n_max = -(-n // R)
        pages = -(-n_max // P)
        host = s.pages if s.pages is not None else [t.tolist() for t in s.tables]
        rows = []
        for r in range(ranks):
            mine = host[r][: -(-rank_token_count(n, r, R) // P)]
            rows.append([r * nb + b for b in mine + [mine[0]] * (pages - len(mine))])
        counts = torch.tensor([rank_token_count(n, r, R) for r in range(ranks)], device=self.kv.devices[0])
        mask = torch.arange(n_max, device=self.kv.devices[0])[None, None, :] < counts[:, None, None]
        return torch.tensor(rows, dtype=torch.long, device=self.kv.devices[0]), mask, n_max

    def _attend(self, li: int, s: DecodeSeq, rec: torch.Tensor, qlat: torch.Tensor, qr: torch.Tensor,
                view: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
        """Write the new token's record on its rank, then the exact merge of every rank's partial
        attention of the query (``qlat [H, 512]``, ``qr [H, 64]``) over that rank's tokens. With
        ``view`` (all ranks on one device) every rank's partial comes from one batched product."""
        c, R, P = self.config, self.dcp, self.config.page_tokens
        t = s.position
        owner, local = t % R, t // R
        cache = self.kv.rank_caches[owner][li]
        blk = s.pages[owner][local // P] if s.pages is not None else int(s.tables[owner][local // P])
        cache[blk, local % P] = rec.to(cache.device)       # plain indexing: a copy, for every dtype
        if view is not None:
            return self._attend_shared(li, qlat, qr, *view)
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

    def _attend_shared(self, li: int, qlat: torch.Tensor, qr: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor,
                       n_max: int) -> torch.Tensor:
        """Every rank's partial attention in one batched product over ``[ranks, n_max]`` keys
        (a rank's missing last token masked), merged exactly across ranks in rank order."""
        c = self.config
        dev = self.kv.devices[0]
        ranks, pages = rows.shape
        keys = _read_pages(self.kv.shared[li], rows.reshape(-1)).view(ranks, pages * c.page_tokens, -1)
        keys = keys[:, :n_max].float()                                                # [ranks, n_max, 576]
        ck, kr = keys[..., :KV_LORA_RANK], keys[..., KV_LORA_RANK:]
        scores = (qlat.to(dev)[None] @ ck.transpose(1, 2) + qr.to(dev)[None] @ kr.transpose(1, 2)) * self.scale
        scores = scores.masked_fill(~mask, float("-inf"))                            # [ranks, H, n_max]
        mx = scores.max(dim=-1, keepdim=True).values                                  # every rank holds a token
        e = torch.exp(scores - mx)
        w = torch.exp(mx - mx.max(dim=0).values[None])                                # [ranks, H, 1]
        num = (w * (e @ ck)).sum(dim=0)
        den = (w * e.sum(dim=-1, keepdim=True)).sum(dim=0)
        return (num / den).to(self.dev0)

    def _post(self, li: int, x: torch.Tensor, olat: torch.Tensor) -> torch.Tensor:
        """Rows ``x [B, d]`` and their attention latents ``olat [B, H, 512]``: the output projection
        (per head, summed in head order), the residual, the FFN."""
        p = self.model.layers[li]
        o = torch.zeros_like(x)
        for h, (hw, dev) in enumerate(zip(self.heads[li], self.head_dev)):
            o = o + (olat[:, h].contiguous().to(dev) @ hw["w_uv"] @ hw["w_o"]).to(self.dev0)
        x = x + o
        return x + torch.nn.functional.silu(_rms(x, p["ln2"]) @ p["w1"]) @ p["w2"]
