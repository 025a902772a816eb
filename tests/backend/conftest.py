"""Fixtures for the backend tests: real Mooncake pools started by the same launcher as ``kvpool pool up``.

Mooncake's transfer-engine listeners bind the wildcard address, so these fixtures refuse (fail,
not skip) to start Mooncake processes unless the test session runs in a private network
namespace whose only interface is ``lo``:

    unshare -n sh -c 'ip link set lo up; exec .venv/bin/python -m pytest tests/backend -q'

Pools are small (64 MiB services, 32 MiB for eviction tests) with short leases and client TTLs,
so the suite stays fast on a 2-core machine.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.backend.pool import EmbeddedPool, Pool
from kvpool.backend.pool.launcher import LocalPool, PoolSpec, start_local_pool

from pool_testing import MIB, SHARED_SPEC, SMALL_POOL_BYTES, SMALL_SPEC, TEST_RPC_TIMEOUT_MS, require_private_netns

POOL_KINDS = ["embedded", "mooncake"]


@pytest.fixture(scope="session")
def shared_mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPool]:
    """One master + 2 store services for the whole session (contract tests use unique keys)."""
    require_private_netns()
    pool = start_local_pool(SHARED_SPEC, tmp_path_factory.mktemp("shared-pool"))
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture
def local_pool_factory(tmp_path: Path) -> Iterator[Callable[[PoolSpec], LocalPool]]:
    """Start dedicated pools for one test (fault tests kill their processes); all stopped after."""
    started: list[LocalPool] = []

    def start(spec: PoolSpec) -> LocalPool:
        require_private_netns()
        pool = start_local_pool(spec, tmp_path / f"pool{len(started)}")
        started.append(pool)
        return pool

    yield start
    for pool in reversed(started):
        pool.stop()


@pytest.fixture
def mooncake_client_factory() -> Iterator[Callable[..., Pool]]:
    """``MooncakePool`` clients closed after the test."""
    from kvpool.backend.pool.mooncake import MooncakePool

    clients: list[MooncakePool] = []

    def make(address, **kw) -> MooncakePool:
        require_private_netns()
        client = MooncakePool(address, rpc_timeout_ms=TEST_RPC_TIMEOUT_MS, **kw)
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.close()


@pytest.fixture(params=POOL_KINDS)
def pool_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def pool(pool_kind: str, request: pytest.FixtureRequest) -> Iterator[Pool]:
    """A pool of each kind with room to spare (embedded 128 MiB; the shared Mooncake pool)."""
    if pool_kind == "embedded":
        p: Pool = EmbeddedPool(128 * MIB)
        yield p
        p.close()
    else:
        shared = request.getfixturevalue("shared_mooncake")
        yield request.getfixturevalue("mooncake_client_factory")(shared.address)


@pytest.fixture
def small_pool(pool_kind: str, request: pytest.FixtureRequest) -> Iterator[Pool]:
    """A 32 MiB pool of each kind, fresh per test, for full-pool and eviction tests."""
    if pool_kind == "embedded":
        p: Pool = EmbeddedPool(SMALL_POOL_BYTES)
        yield p
        p.close()
    else:
        local = request.getfixturevalue("local_pool_factory")(SMALL_SPEC)
        yield request.getfixturevalue("mooncake_client_factory")(local.address)


@pytest.fixture
def keyspace() -> str:
    """A unique key prefix per test, so tests sharing a pool never see each other's objects."""
    return f"t-{uuid.uuid4().hex[:12]}"
