"""Shared pytest configuration: GPU tests are skipped where no GPU is present; Hypothesis has no
per-example deadline (examples are checked for behaviour, not timed: CI machines are shared and
noisy, and performance is measured by bench/); every temporary folder of the session is removed at
its end.

Temporary folders: the session sets ``TMPDIR`` (and ``RAY_TMPDIR``) to a fresh folder of its own,
so the ``pymp-*`` folders of ``multiprocessing`` (the local executor's process pools, in this
process and in every ``kvpool`` subprocess a test starts) and the ``ray/session_*`` folders of a
local Ray runtime land there, and removes it when the session ends. pytest's own ``tmp_path``
folders stay where they are (``PYTEST_DEBUG_TEMPROOT``), kept for inspection as pytest keeps them.
The folder's name is short: Ray puts Unix sockets under it, whose paths are limited to 107 bytes.

``one_torch_thread``: a fixture that runs its test with one torch intra-op thread (tiny products on
shared cores: more threads spin and cost up to 40x), restoring the count after it."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import settings

settings.register_profile("kvpool", deadline=None)
settings.load_profile("kvpool")


_TEMP_VARS = ("TMPDIR", "RAY_TMPDIR", "PYTEST_DEBUG_TEMPROOT")


def pytest_configure(config):
    system = tempfile.gettempdir()
    session = tempfile.mkdtemp(prefix="kvpool-tests-", dir=system)
    config.stash[_SAVED] = ({k: os.environ.get(k) for k in _TEMP_VARS}, session)
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", system)
    os.environ["TMPDIR"] = os.environ["RAY_TMPDIR"] = session
    tempfile.tempdir = None  # read TMPDIR again


def pytest_unconfigure(config):
    saved, session = config.stash.get(_SAVED, ({}, None))
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    tempfile.tempdir = None
    if session:
        shutil.rmtree(session, ignore_errors=True)


_SAVED = pytest.StashKey[tuple]()


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


@pytest.fixture
def one_torch_thread():
    """See the module docstring."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
