"""The Mooncake pool of ``kvpool serve`` (``serve.pool = "mooncake"``): started here, or joined.

Contract:
    * ``start_serve_pool(scenario, run_dir, address) -> ServePool``, called by the supervisor before
      it starts any stage; the plan then carries ``ServePool.address`` (``plan.pool_address``).
        - ``address`` given (``--pool-address``, a pool started by ``kvpool pool up``): it is parsed
          (``backend.pool.address``) and its master must accept a TCP connection within
          ``ANSWER_WAIT_S``; nothing is started (``pids()`` is empty, ``stop()`` does nothing).
        - ``address`` ``None``: a local pool (``backend.pool.launcher.start_local_pool``, logs and
          ready files in ``run_dir/pool``) of ``cluster.servers * pool.services_per_server`` store
          services of ``pool.gib_per_service`` GiB each -- the same DRAM the embedded pool gets --,
          with the master's eviction at ``pool.high_watermark`` / ``pool.evict_ratio``
          (``pool_spec``; Mooncake's master has no eviction-order setting, so
          ``pool.eviction_policy`` is not passed on). The start is bounded by the launcher's
          ``PoolSpec`` waits.
      Both ways the stages' Mooncake clients open listeners on every interface, so both are refused
      outside a private network namespace (``netns.check_listeners``, no override: the stages'
      clients would refuse too) before anything starts.
      Every failure is one ``ServePoolError`` whose text names the setting or the process at fault.
    * ``ServePool.address``: ``mooncake://HOST:RPC?metrics=M`` (text, for the plan).
      ``ServePool.pids()``: every process it started (master and services), for the supervisor's
      accounting. ``ServePool.stop()``: services, then the master, each SIGTERM then SIGKILL after
      ``PoolSpec.stop_timeout_s``; idempotent.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from kvpool.backend.pool.address import PoolAddress
from kvpool.backend.pool.launcher import LocalPool, PoolSpec, PoolStartError, start_local_pool
from kvpool.backend.pool.netns import PublicListenersRefused, check_listeners
from kvpool.scenario.model import Scenario

GIB = 1 << 30
#: Bound on a joined pool's master accepting a TCP connection.
ANSWER_WAIT_S = 3.0


class ServePoolError(RuntimeError):
    """The pool could not be started or joined (the text names the cause)."""


@dataclass
class ServePool:
    """The pool the deployment uses: ``local`` when this process started it, else ``None``."""

    address: str
    local: LocalPool | None = None

    def pids(self) -> list[int]:
        if self.local is None:
            return []
        procs = ([self.local.master] if self.local.master is not None else []) + list(self.local.services)
        return [p.pid for p in procs]

    def dead(self) -> list[str]:
        """Names of the processes it started that have exited."""
        return [] if self.local is None else self.local.dead()

    def stop(self) -> None:
        if self.local is not None:
            self.local.stop()


def pool_spec(scenario: Scenario, **overrides) -> PoolSpec:
    """The local pool of ``scenario`` (see the module docstring); ``overrides`` set other ``PoolSpec`` fields."""
    p = scenario.pool
    services = scenario.cluster.servers * p.services_per_server
    if services < 1 or not p.gib_per_service > 0:
        raise ServePoolError(
            "serve.pool is mooncake but the scenario's pool is empty: cluster.servers x pool.services_per_server "
            f"= {services} services of pool.gib_per_service = {p.gib_per_service:g} GiB; both must be > 0")
    try:
        return PoolSpec(**{"services": services, "bytes_per_service": int(p.gib_per_service * GIB),
                           "eviction_high_watermark": p.high_watermark, "eviction_ratio": p.evict_ratio, **overrides})
    except ValueError as e:
        raise ServePoolError(f"pool: {e}") from None


def start_serve_pool(scenario: Scenario, run_dir: str | Path, address: str | None, *,
                     spec: PoolSpec | None = None) -> ServePool:
    """Join the pool at ``address`` or start one for ``scenario`` (``spec``: instead of ``pool_spec(scenario)``)."""
    try:
        check_listeners(False, "set serve.pool=embedded (no Mooncake processes)")
    except PublicListenersRefused as e:
        raise ServePoolError(f"serve.pool is mooncake: {e}") from None
    if address is not None:
        return ServePool(_joined(address).url())
    spec = spec or pool_spec(scenario)
    try:
        local = start_local_pool(spec, Path(run_dir) / "pool")
    except PoolStartError as e:
        raise ServePoolError(f"the Mooncake pool did not start: {e}") from None
    return ServePool(local.address.url(), local)


def _joined(address: str) -> PoolAddress:
    try:
        addr = PoolAddress.parse(address)
    except ValueError as e:
        raise ServePoolError(f"--pool-address: {e}") from None
    try:
        socket.create_connection((addr.host, addr.rpc_port), timeout=ANSWER_WAIT_S).close()
    except OSError as e:
        raise ServePoolError(f"--pool-address {address}: no Mooncake master answers at {addr.master} "
                             f"within {ANSWER_WAIT_S:g} s ({e}); start one with 'kvpool pool up'") from None
    return addr


__all__ = ["ANSWER_WAIT_S", "ServePool", "ServePoolError", "pool_spec", "start_serve_pool"]
