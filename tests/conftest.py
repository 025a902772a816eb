"""Shared pytest configuration: GPU tests are skipped where no GPU is present; Hypothesis has no
per-example deadline (examples are checked for behaviour, not timed: CI machines are shared and
noisy, and performance is measured by bench/)."""

from __future__ import annotations

import pytest
from hypothesis import settings

settings.register_profile("kvpool", deadline=None)
settings.load_profile("kvpool")


def _have_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config, items):
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA or ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
