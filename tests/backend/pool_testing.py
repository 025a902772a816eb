"""Settings shared by the backend test modules and their fixtures (kept out of conftest.py so test
modules can import them by name)."""

from __future__ import annotations

import os

import pytest

from kvpool.backend.pool.launcher import PoolSpec
from kvpool.backend.pool.netns import netns_problem

MIB = 1 << 20
#: Read/exist lease of the test pools: above the longest batch read on a loaded 2-core machine.
LEASE_TTL_MS = 300
#: Client-side RPC timeout of the test process (a hung master fails calls after this).
TEST_RPC_TIMEOUT_MS = 1_000
#: The shared pool for contract tests: 2 services x 64 MiB.
SHARED_SPEC = PoolSpec(
    services=2, bytes_per_service=64 * MIB, lease_ttl_ms=LEASE_TTL_MS, client_ttl_s=2, rpc_timeout_ms=TEST_RPC_TIMEOUT_MS
)
#: Small pools for eviction tests (one service, so capacity is exact).
SMALL_POOL_BYTES = 32 * MIB
SMALL_SPEC = PoolSpec(
    services=1, bytes_per_service=SMALL_POOL_BYTES, lease_ttl_ms=LEASE_TTL_MS, client_ttl_s=2, rpc_timeout_ms=TEST_RPC_TIMEOUT_MS
)


def require_private_netns() -> None:
    """Fail (not skip) with the command to use when Mooncake would listen beyond loopback."""
    problem = netns_problem()
    if problem:
        pytest.fail(f"refusing to start Mooncake processes: {problem}", pytrace=False)
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    os.environ["MC_RPC_TIMEOUT_MS"] = str(TEST_RPC_TIMEOUT_MS)
