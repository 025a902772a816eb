"""Scaling a recorded workload's prompts down to a small model: the one rule both worlds apply.

Contract (pure functions; ``token_scale`` is the factor F, ``0 < F <= 1``):
    * ``scaled_block_tokens(block_tokens, F) = max(1, floor(block_tokens * F + 1/2))``: the
      tokens one recorded hash block stands for after scaling (a 64-token Weka block at F = 1/64
      is one token, a 512-token Mooncake block at F = 1/64 is eight).
    * ``scaled_prompt_tokens(in_tokens, block_tokens, F) = max(1, floor(in_tokens * b /
      block_tokens + 1/2))`` with ``b = scaled_block_tokens(block_tokens, F)``: a prompt's length
      after scaling. The effective factor is ``b / block_tokens`` (not F itself), so every whole
      recorded block keeps exactly ``b`` tokens and only the part past the last whole block is
      rounded: equal hash-id prefixes stay equal token prefixes.
    * Output lengths are not scaled (as ``workload.context_scale`` leaves them).
    * F = 1 is the identity: ``scaled_prompt_tokens(n, bt, 1) == n`` for every ``n >= 1``.
    * ``scale_workload(workload, F)``: the workload with every session's ``block_tokens`` and every
      request's ``in_tokens`` scaled as above (hash ids, outputs and timing unchanged); F = 1
      returns ``workload`` itself. This is ``workload.token_scale`` for both worlds: the simulator
      runs the scaled sessions (``sim.run.workload_for``) and ``kvpool replay`` sends their prompts
      (``backend.serve.prompts``: a scaled session's prompt at F = 1 is the recorded session's
      prompt at F, token for token).
"""

from __future__ import annotations

import dataclasses
import math

from kvpool.workload.model import Session, Workload


def check_token_scale(token_scale: float) -> float:
    """``token_scale`` when it is a finite number in (0, 1]; ``ValueError`` naming the range otherwise."""
    if not (isinstance(token_scale, (int, float)) and math.isfinite(token_scale) and 0 < token_scale <= 1):
        raise ValueError(f"token scale must be a number > 0 and <= 1, got {token_scale!r}")
    return float(token_scale)


def scaled_block_tokens(block_tokens: int, token_scale: float) -> int:
    """Tokens one recorded block of ``block_tokens`` stands for after scaling by ``token_scale``."""
    return max(1, math.floor(block_tokens * check_token_scale(token_scale) + 0.5))


def scaled_prompt_tokens(in_tokens: int, block_tokens: int, token_scale: float) -> int:
    """A recorded prompt of ``in_tokens`` (in blocks of ``block_tokens``) after scaling by ``token_scale``."""
    b = scaled_block_tokens(block_tokens, token_scale)
    return max(1, (2 * in_tokens * b + block_tokens) // (2 * block_tokens))  # exact: no float rounding


def scale_session(s: Session, token_scale: float) -> Session:
    """``s`` with its blocks and prompts scaled by ``token_scale`` (see the module contract)."""
    b = scaled_block_tokens(s.block_tokens, token_scale)
    reqs = tuple(dataclasses.replace(r, in_tokens=scaled_prompt_tokens(r.in_tokens, s.block_tokens, token_scale))
                 for r in s.requests)
    return dataclasses.replace(s, block_tokens=b, requests=reqs)


def scale_workload(workload: Workload, token_scale: float) -> Workload:
    """``workload`` with every session scaled by ``token_scale``; itself when ``token_scale`` is 1."""
    if check_token_scale(token_scale) == 1.0:
        return workload
    return Workload(tuple(scale_session(s, token_scale) for s in workload.sessions), workload.skipped)
