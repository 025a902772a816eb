"""KV pools behind one small interface (``Pool``): the in-process ``EmbeddedPool`` (default) and
``MooncakePool`` on a real Mooncake Store, plus the launcher of a local Mooncake pool
(``kvpool pool up``) and the reader of its master's metrics (``kvpool pool status``).

Modules (each states its contract in its docstring):
    api            ``Pool`` protocol, ``Status``, ``BufferRef``, ``PoolStats``; the optional
                   ``ArenaPool`` capability (``lease_read`` / ``reserve_write``: objects lent in place)
    arena          the embedded pool's arena: memory mapped once (pinned with a GPU), extents, copies
    buffers        registering host memory (bytearray / numpy / CPU torch tensor), batch checks
    embedded       ``EmbeddedPool`` evicting with ``kvpool.policy.eviction.GroupedPool``, bytes in one arena
    mooncake       ``MooncakePool`` (imports ``mooncake.store`` only when constructed)
    address        ``PoolAddress`` (``mooncake://HOST:RPC?metrics=M``)
    launcher       ``start_local_pool``: ``mooncake_master`` + N store-service processes
    store_service  the store-service process (``python -m kvpool.backend.pool.store_service``)
    metrics        ``read_master_metrics`` from the master's ``/metrics``
    netns          ``netns_problem``: is this a private network namespace? ``check_listeners``: the
                   decision to start Mooncake listeners (refused outside one unless allowed)

Nothing here imports torch or mooncake at import time.
"""

from kvpool.backend.pool.address import PoolAddress
from kvpool.backend.pool.api import ArenaPiece, ArenaPool, ArenaRead, ArenaWrite, BufferRef, Pool, PoolStats, Status
from kvpool.backend.pool.embedded import EmbeddedPool


def __getattr__(name: str):
    if name in ("MooncakePool", "PutRetry", "PoolUnavailable"):
        from kvpool.backend.pool import mooncake

        return getattr(mooncake, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ArenaPiece",
    "ArenaPool",
    "ArenaRead",
    "ArenaWrite",
    "BufferRef",
    "EmbeddedPool",
    "MooncakePool",
    "Pool",
    "PoolAddress",
    "PoolStats",
    "PoolUnavailable",
    "PutRetry",
    "Status",
]
