"""Chunked prefill's steps: which tokens of which requests the next step computes.

A prefill instance computes its requests' tokens in steps of at most ``prefill.max_batched_tokens``
tokens. A step takes the runnable requests in admission order, each request's next tokens up to
the budget left; a request whose tokens do not fit gets whole pages of them (the rest waits for a
later step), and packing stops when less than a page of budget is left.

With pipeline parallelism a step passes the stages one after another, and a stage works on a step
while the next stage works on the one before. A step that takes every runnable request keeps one
stage busy at a time; with ``prefill.spread_requests`` a step takes at most the runnable requests'
even share over the stages (``step_requests``), so that the steps after it fill the stages behind
it. A lone request's steps stay as they are (the calibration's prefill cells measure such steps).

Both worlds call these: the prefill engine's scheduler (``backend.serve.prefill_scheduler``, with
the model's page size) and the simulator's prefill instance (``sim.instances``, with the same page
size, in the engine's pipeline order).
"""

from __future__ import annotations

from collections.abc import Iterable


def step_requests(runnable_requests: int, stages: int, spread: bool) -> int:
    """How many of the ``runnable_requests`` (in admission order) the next step may take: all of
    them, or with ``spread`` their share over the ``stages``, rounded up."""
    if stages < 1:
        raise ValueError(f"step_requests: stages must be >= 1, got {stages}")
    return -(-runnable_requests // stages) if spread else runnable_requests


def pack_step(remaining_tokens: Iterable[int], budget_tokens: int, page_tokens: int) -> list[int]:
    """Tokens each request computes in the next step, for the requests' ``remaining_tokens`` (> 0,
    in admission order) and a step of ``budget_tokens``; the list is shorter than
    ``remaining_tokens`` when the requests after it take none."""
    if page_tokens < 1:
        raise ValueError(f"pack_step: page_tokens must be >= 1, got {page_tokens}")
    takes: list[int] = []
    left_tokens = budget_tokens
    for remaining in remaining_tokens:
        take = remaining if remaining <= left_tokens else left_tokens // page_tokens * page_tokens
        if take <= 0:
            break
        takes.append(take)
        left_tokens -= take
        if left_tokens < page_tokens:
            break
    return takes
