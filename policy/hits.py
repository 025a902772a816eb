"""Hit computation: which part of a prompt comes from the GPU, which from the pool, which is computed.

Contract (ATOM's all-stage rule, ``reference/atom-connector.md`` section 2):
    * ``gpu_hit_tokens`` is the prefix the prefill GPU's prefix cache holds; it counts in whole pages.
    * Per stage, the pool run is the number of leading chunks that stage's objects are present for.
      The pool prefix is the **minimum** run over stages, in whole chunks: a chunk that only some
      stages hold is unusable ("stranded").
    * A load starts at the GPU hit rounded up to a chunk boundary (never below the GPU hit; the
      tokens between the GPU hit and that boundary are computed) and ends at the pool prefix.
    * A load shorter than ``min_load_tokens`` is not worth it: those tokens are computed instead.
    * The last prompt token is always computed, from the start of its page (prefill computes
      whole pages from a page boundary): a hit -- GPU or pool -- ends at or before that page, so
      ``computed_tokens >= 1`` for every non-empty prompt.
    * ``gpu_tokens + pool_tokens + computed_tokens == prompt_tokens`` always.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class HitResult:
    """Where a prompt's tokens come from.

    Attributes:
        gpu_tokens: tokens reused from the prefill GPU's prefix cache.
        pool_tokens: tokens loaded from the pool (chunks ``load_first_chunk .. load_end_chunk-1``).
        computed_tokens: tokens prefill computes.
        load_first_chunk: first chunk loaded from the pool (meaningful when ``pool_tokens > 0``).
        load_end_chunk: one past the last chunk loaded.
        pool_prefix_chunks: chunks every stage holds, from chunk 0.
        stranded_objects: objects held beyond the common prefix by some stages only.
    """

    gpu_tokens: int
    pool_tokens: int
    computed_tokens: int
    load_first_chunk: int = 0
    load_end_chunk: int = 0
    pool_prefix_chunks: int = 0
    stranded_objects: int = 0

    @property
    def prompt_tokens(self) -> int:
        return self.gpu_tokens + self.pool_tokens + self.computed_tokens

    @property
    def load_chunks(self) -> int:
        return self.load_end_chunk - self.load_first_chunk if self.pool_tokens else 0


def leading_run(present: Sequence[bool] | np.ndarray) -> int:
    """Length of the run of ``True`` from index 0 (numpy bool arrays are scanned in C)."""
    if isinstance(present, np.ndarray):
        if present.size == 0:
            return 0
        misses = np.flatnonzero(~present.astype(bool, copy=False))
        return int(misses[0]) if misses.size else int(present.size)
    n = 0
    for p in present:
        if not p:
            break
        n += 1
    return n


def compute_hits(
    prompt_tokens: int,
    gpu_hit_tokens: int,
    stage_present: Sequence[Sequence[bool]] | None,
    *,
    chunk_tokens: int = 256,
    page_tokens: int = 16,
    min_load_tokens: int = 0,
    stage_runs: Sequence[int] | None = None,
) -> HitResult:
    """Split a prompt into GPU / pool / computed tokens.

    Args:
        prompt_tokens: prompt length.
        gpu_hit_tokens: prefix held by the GPU prefix cache (rounded down to whole pages here).
        stage_present: ``stage_present[s][c]`` is whether stage ``s`` holds chunk ``c`` in the pool,
            for the prompt's full chunks (``None`` or empty: no pool).
        chunk_tokens: tokens per chunk (a multiple of ``page_tokens``).
        page_tokens: tokens per GPU page.
        min_load_tokens: loads shorter than this are recomputed instead.
        stage_runs: instead of ``stage_present``, each stage's leading run (``leading_run`` of its
            row) when the caller has them already (the simulated pool counts them in place).
    """
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    if chunk_tokens <= 0 or page_tokens <= 0 or chunk_tokens % page_tokens:
        raise ValueError(f"chunk_tokens {chunk_tokens} must be a positive multiple of page_tokens {page_tokens}")
    if prompt_tokens == 0:
        return HitResult(0, 0, 0)
    last = prompt_tokens - 1  # the last token is always computed
    gpu = min(max(0, gpu_hit_tokens), last) // page_tokens * page_tokens

    if stage_runs is not None:
        runs = list(stage_runs)
    elif isinstance(stage_present, np.ndarray) and stage_present.ndim == 2 and stage_present.size:
        # [stage, chunk] in one array: every stage's leading run in a few vector operations
        miss = ~stage_present.astype(bool, copy=False)
        runs = np.where(miss.any(axis=1), miss.argmax(axis=1), stage_present.shape[1]).tolist()
    else:
        runs = [leading_run(p) for p in stage_present] if stage_present is not None and len(stage_present) else []
    common = min(runs) if runs else 0
    common = min(common, prompt_tokens // chunk_tokens)
    stranded = sum(r - common for r in runs) if runs else 0

    first_chunk = -(-gpu // chunk_tokens)  # ceil: a load starts on a chunk boundary at/after the GPU hit
    pool_end = min(common * chunk_tokens, last // page_tokens * page_tokens)
    pool = max(0, pool_end - first_chunk * chunk_tokens)
    if pool < max(1, min_load_tokens):
        return HitResult(gpu, 0, prompt_tokens - gpu, 0, 0, common, stranded)
    return HitResult(gpu, pool, prompt_tokens - gpu - pool, first_chunk, common, common, stranded)
