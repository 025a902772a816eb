"""Decode tests' batch: prompts prefilled by the reference model and placed in one instance's DCP
caches, each sequence on its own shuffled pages (``Batch``)."""

from __future__ import annotations

import torch

from kvpool.backend.refmodel import RefConfig
from kvpool.backend.serve.decode_model import DcpCaches, DecodeModel, DecodeSeq, rank_pages
from kvpool.backend.serve.reference import _model, place_dcp


class Batch:
    """``run(rows, steps)`` decodes the sequences ``rows`` together, from the prompts' KV (latents
    and indexer records) each time. Each rank's pages are a permutation seeded ``seed + rank``;
    ``spare_blocks`` more than the sequences need."""

    def __init__(self, cfg: RefConfig, ps: list[list[int]], dcp: int, steps: int, tp: int = 1,
                 share: bool = True, devices: list[str] | None = None, *, seed: int = 40,
                 spare_blocks: int = 3) -> None:
        self.model = _model(cfg)
        P = cfg.page_tokens
        need = [[rank_pages(len(p) + steps + 1, r, dcp, P) for r in range(dcp)] for p in ps]
        blocks = max(sum(n[r] for n in need) for r in range(dcp)) + spare_blocks
        self.kv = DcpCaches(cfg, dcp, blocks, ["cpu"], share=share)
        perm = [torch.randperm(blocks, generator=torch.Generator().manual_seed(seed + r)) for r in range(dcp)]
        taken = [0] * dcp
        self.tables, self.first = [], []
        for p, n in zip(ps, need):
            tables = []
            for r in range(dcp):
                tables.append(perm[r][taken[r]:taken[r] + n[r]].to(torch.long))
                taken[r] += n[r]
            table = torch.arange(-(-len(p) // P))
            caches = self.model.new_caches(table.numel())
            logits = self.model.prefill(p, caches, table)
            place_dcp(cfg, caches, table, len(p), self.kv, tables)
            self.tables.append(tables)
            self.first.append(int(logits.argmax()))
        self.ps = ps
        self.snapshot = [[c.clone() for c in self.kv.handoff_caches(r)] for r in range(dcp)]
        self.step = DecodeModel(self.model, self.kv, devices or ["cpu"] * tp, tp=tp)

    def run(self, rows: list[int], steps: int) -> tuple[dict[int, list[int]], dict[int, list[torch.Tensor]]]:
        for r, saved in enumerate(self.snapshot):
            for c, s in zip(self.kv.handoff_caches(r), saved):
                c.copy_(s)
        toks = {i: [self.first[i]] for i in rows}
        logits = {i: [] for i in rows}
        for _ in range(steps):
            seqs = [DecodeSeq(toks[i][-1], len(self.ps[i]) + len(toks[i]) - 1, self.tables[i]) for i in rows]
            nxt, lg = self.step.step(seqs)
            for k, i in enumerate(rows):
                toks[i].append(nxt[k])
                logits[i].append(lg[k].clone())
        return toks, logits
