"""The no-cache recompute that production mode's decode output must equal.

Contract:
    * ``reference_generate(config, prompt_ids, n_tokens, dcp) -> list[int]``: ``n_tokens`` greedy
      tokens after the prompt, with no GPU prefix cache, no pool and no hand-off transport. The
      whole prompt is prefilled with ``RefModel.prefill`` into fresh caches; its KV is placed
      directly in the DCP layout (token ``t`` on rank ``t mod dcp``, local index ``t // dcp``); the
      first token is the argmax of prefill's logits; every later token comes from a batch-1
      ``DecodeModel.step``. EOS does not stop it: it returns exactly ``n_tokens`` tokens.
    * A decode engine serving the same prompt gives exactly these tokens: its KV arrives through
      the hand-off bit for bit, and ``DecodeModel.step`` is batch-invariant.
    * ``recompute_generate(config, prompt_ids, n_tokens)``: the same tokens computed without any
      decode step at all, each one by ``RefModel.prefill`` of the whole sequence so far (slow; a
      check of the decode math: equal up to near-ties of the logits).
    * float32 compute, deterministic; on the CPU by default, with one intra-op thread while they run
      (the products are small: on shared cores more threads spin and cost tens of times the work).
      ``device="cuda:0"``: the same on a GPU, where it runs the kernels a decode engine on that GPU
      runs (fixed row blocks, all ranks on one device), so its tokens are the engine's bit for bit
      (as far as the GPU's products are deterministic for one shape), while a CPU run may differ
      from a GPU engine at near-ties of the logits.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch

from kvpool.backend.refmodel import RefConfig, RefModel
from kvpool.backend.serve.decode_model import DcpCaches, DecodeModel, DecodeSeq, rank_pages


@functools.lru_cache(maxsize=4)
def _model(config: RefConfig, device: str = "cpu") -> RefModel:
    return RefModel(config, device=device)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check(prompt_ids: Sequence[int], n_tokens: int, dcp: int) -> list[int]:
    prompt = [int(t) for t in prompt_ids]
    if not prompt or n_tokens <= 0 or dcp <= 0:
        raise ValueError(f"need a non-empty prompt, n_tokens > 0 and dcp > 0, got {len(prompt)}, {n_tokens}, {dcp}")
    return prompt


def place_dcp(config: RefConfig, caches: list[list[torch.Tensor]], table: torch.Tensor, n_prompt: int,
              kv: DcpCaches, rank_tables: list[torch.Tensor]) -> None:
    """Copy the first ``n_prompt`` tokens of prefill ``caches`` (stage-major, each stage's caches in
    ``RefConfig.stage_segments`` order, one page table) into the DCP layout ``kv`` (latents and
    indexer keys) through each rank's table ``rank_tables[r]``."""
    P, R = config.page_tokens, kv.dcp
    segments = [seg for s in range(len(config.stage_layers)) for seg in config.stage_segments(s)]
    layer_caches = [c for stage in caches for c in stage]
    pos = torch.arange(n_prompt)
    for r in range(R):
        mine = pos[pos % R == r]
        if mine.numel() == 0:
            continue
        local = mine // R
        dst_blk, dst_slot = rank_tables[r].cpu()[local // P], local % P
        src_blk, src_slot = table.cpu()[mine // P], mine % P
        dev_d, dev_s = kv.devices[r], layer_caches[0].device
        for (li, record), src in zip(segments, layer_caches):   # as bytes: indexing is defined for uint8 everywhere
            dst = kv.cache_of(r, li, record).view(torch.uint8)
            rows = src.view(torch.uint8)[src_blk.to(dev_s), src_slot.to(dev_s)]
            dst[dst_blk.to(dev_d), dst_slot.to(dev_d)] = rows.to(dev_d)


def reference_generate(config: RefConfig, prompt_ids: Sequence[int], n_tokens: int, dcp: int, *,
                       device: str = "cpu") -> list[int]:
    """See the module docstring."""
    prompt = _check(prompt_ids, n_tokens, dcp)
    if torch.device(device).type != "cpu":
        return _generate(config, prompt, n_tokens, dcp, device)
    with _one_thread():
        return _generate(config, prompt, n_tokens, dcp, device)


def _generate(config: RefConfig, prompt: list[int], n_tokens: int, dcp: int, device: str) -> list[int]:
    model = _model(config, device)
    P, n = config.page_tokens, len(prompt)
    total = n + n_tokens
    table = torch.arange(-(-n // P), device=device)
    caches = model.new_caches(table.numel())
    logits = model.prefill(prompt, caches, table)
    pages = [rank_pages(total, r, dcp, P) for r in range(dcp)]
    kv = DcpCaches(config, dcp, max(1, max(pages)), [device])
    rank_tables = [torch.arange(k, dtype=torch.long, device=device) for k in pages]
    place_dcp(config, caches, table, n, kv, rank_tables)
    step = DecodeModel(model, kv, [device])
    out = [int(logits.argmax(dim=-1))]
    while len(out) < n_tokens:
        nxt, _ = step.step([DecodeSeq(out[-1], n + len(out) - 1, rank_tables, [t.tolist() for t in rank_tables])])
        out.append(nxt[0])
    return out


def recompute_generate(config: RefConfig, prompt_ids: Sequence[int],
                       n_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Tokens and each token's logits ``[vocab]`` by full prefills only (see the module docstring)."""
    seq = _check(prompt_ids, n_tokens, 1)
    model = _model(config)
    P = config.page_tokens
    out, all_logits = [], []
    with _one_thread():
        for _ in range(n_tokens):
            table = torch.arange(-(-len(seq) // P))
            logits = model.prefill(seq, model.new_caches(table.numel()), table)[0]
            all_logits.append(logits)
            out.append(int(logits.argmax()))
            seq = seq + [out[-1]]
    return out, all_logits
