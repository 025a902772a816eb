"""Timing for the benchmarks: each run of a function is timed from and to idle devices.

``sync(dev)`` waits until ``dev`` (a CUDA or ROCm device; the CPU has nothing to wait for) is idle;
``times_s(fn, devices, reps)`` is the wall time of each of ``reps`` runs of ``fn``, every device of
``devices`` idle before and after each. The scripts take ``min`` (the limit a copy reaches) or the
median (a step's typical time) of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def times_s(fn: Callable[[], object], devices: Sequence[torch.device], reps: int) -> list[float]:
    """Seconds of each of ``reps`` runs of ``fn`` (see the module docstring)."""
    out = []
    for _ in range(reps):
        for d in devices:
            sync(d)
        t0 = time.perf_counter()
        fn()
        for d in devices:
            sync(d)
        out.append(time.perf_counter() - t0)
    return out
