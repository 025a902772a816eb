"""Start and stop a local Mooncake pool: one ``mooncake_master`` plus N memory-only store services.

``kvpool pool up`` and the pytest fixtures both use this module.

Contract:
    * Every process gets ``MC_TCP_BIND_ADDRESS=127.0.0.1`` and a short ``MC_RPC_TIMEOUT_MS``;
      the master gets ``--rpc_address=127.0.0.1 --metrics_host=127.0.0.1`` and two free ports
      (from binding ``("127.0.0.1", 0)``); metadata is ``P2PHANDSHAKE`` (no metadata server).
      Mooncake's transfer-engine listeners still bind the wildcard address, so
      ``start_local_pool`` refuses to start outside a private network namespace
      (``netns.check_listeners``: ``PublicListenersRefused``) unless ``allow_public_listeners=True``.
    * Each process runs in its own session with stdin closed and stdout+stderr in a log file
      under ``work_dir``; errors quote the log's tail.
    * ``start_local_pool`` returns only when the master accepts TCP connections and every service
      has reported ``rc == 0`` in its ready file; each wait is bounded (``PoolSpec``) and a child
      that exits early fails the start at once. On any failure everything started is stopped.
    * ``LocalPool.stop()`` stops services, then the master: SIGTERM, a bounded wait, then SIGKILL.
      It is idempotent. Fault-injection helpers (``kill_service``, ``kill_master``,
      ``pause_master``/``resume_master``, ``start_master``) act on single processes by PID.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.backend.pool.address import PoolAddress
from kvpool.backend.pool.netns import check_listeners

LOCALHOST = "127.0.0.1"
GIB = 1 << 30
MIB = 1 << 20


class PoolStartError(RuntimeError):
    """A pool process did not become ready (the message quotes its log)."""


@dataclass(frozen=True)
class PoolSpec:
    """What to start.

    Attributes:
        services: memory-only store services (one per NUMA node in production).
        bytes_per_service: memory each service contributes.
        eviction_high_watermark: master's ``--eviction_high_watermark_ratio``.
        eviction_ratio: master's ``--eviction_ratio``.
        lease_ttl_ms: master's ``--default_kv_lease_ttl`` (reads and exist checks lease objects
            for this long; leased objects are not evicted).
        client_ttl_s: master's ``--client_ttl`` (a killed service's keys still "exist" this long).
        rpc_timeout_ms: ``MC_RPC_TIMEOUT_MS`` of every process (a hung master fails calls after it).
        rpc_threads: master's ``--rpc_thread_num``.
        master_ready_timeout_s: bound on the master accepting connections.
        service_ready_timeout_s: bound on each service's ready report.
        stop_timeout_s: bound on each process exiting after SIGTERM before SIGKILL.
    """

    services: int = 2
    bytes_per_service: int = GIB
    eviction_high_watermark: float = 0.90
    eviction_ratio: float = 0.05
    lease_ttl_ms: int = 10_000
    client_ttl_s: int = 10
    rpc_timeout_ms: int = 2_000
    rpc_threads: int = 2
    master_ready_timeout_s: float = 20.0
    service_ready_timeout_s: float = 60.0
    stop_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if not 1 <= self.services <= 64:
            raise ValueError(f"services must be in 1..64, got {self.services}")
        if self.bytes_per_service < MIB:
            raise ValueError(f"bytes_per_service must be >= 1 MiB, got {self.bytes_per_service}")
        if not 0.0 < self.eviction_high_watermark <= 1.0:
            raise ValueError(f"eviction_high_watermark must be in (0, 1], got {self.eviction_high_watermark}")
        if not 0.0 < self.eviction_ratio <= 1.0:
            raise ValueError(f"eviction_ratio must be in (0, 1], got {self.eviction_ratio}")
        if not 1 <= self.lease_ttl_ms <= 3_600_000:
            raise ValueError(f"lease_ttl_ms must be in 1..3600000 (an hour), got {self.lease_ttl_ms}")
        if not 1 <= self.client_ttl_s <= 86_400:
            raise ValueError(f"client_ttl_s must be in 1..86400 (a day), got {self.client_ttl_s}")
        if not 100 <= self.rpc_timeout_ms <= 600_000:
            raise ValueError(f"rpc_timeout_ms must be in 100..600000 (ten minutes), got {self.rpc_timeout_ms}")

    @property
    def capacity_bytes(self) -> int:
        return self.services * self.bytes_per_service


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def mooncake_env(rpc_timeout_ms: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a Mooncake process: advertise 127.0.0.1, fail hung RPCs quickly."""
    env = dict(os.environ if base is None else base)
    env["MC_TCP_BIND_ADDRESS"] = LOCALHOST
    env["MC_RPC_TIMEOUT_MS"] = str(rpc_timeout_ms)
    return env


def master_binary() -> str:
    """``mooncake_master`` next to this interpreter (a venv), else on PATH."""
    here = Path(sys.executable).parent / "mooncake_master"
    if here.exists():
        return str(here)
    for d in os.environ.get("PATH", "").split(os.pathsep):
        cand = Path(d) / "mooncake_master"
        if cand.exists():
            return str(cand)
    raise PoolStartError(
        "mooncake_master not found next to the Python interpreter or on PATH; "
        "install the backend extra (pip install 'kvpool[backend]')"
    )


def log_tail(path: Path, max_bytes: int = 2000) -> str:
    """The last ``max_bytes`` of a log file ('' if missing)."""
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-max_bytes:].decode(errors="replace")


@dataclass
class ManagedProcess:
    """One child process with its log file."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit status."""
        if self.alive():
            self.signal(signal.SIGCONT)  # a paused process cannot handle SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=timeout_s)
        return self.popen.returncode


def _spawn(name: str, argv: list[str], env: dict[str, str], log_path: Path) -> ManagedProcess:
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return ManagedProcess(name, popen, log_path)


@dataclass
class LocalPool:
    """A running master and its store services. Use as a context manager or call ``stop()``."""

    spec: PoolSpec
    address: PoolAddress
    work_dir: Path
    master: ManagedProcess | None = None
    services: list[ManagedProcess] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)
    _master_starts: int = 0

    # -- master ------------------------------------------------------------------------------
    def master_argv(self) -> list[str]:
        s = self.spec
        return [
            master_binary(),
            f"--rpc_port={self.address.rpc_port}",
            f"--rpc_address={LOCALHOST}",
            f"--metrics_host={LOCALHOST}",
            f"--metrics_port={self.address.metrics_port}",
            f"--rpc_thread_num={s.rpc_threads}",
            f"--default_kv_lease_ttl={s.lease_ttl_ms}ms",
            f"--client_ttl={s.client_ttl_s}",
            f"--eviction_high_watermark_ratio={s.eviction_high_watermark}",
            f"--eviction_ratio={s.eviction_ratio}",
        ]

    def start_master(self) -> None:
        """Start (or restart, on the same ports) the master and wait until it accepts connections."""
        if self.master is not None and self.master.alive():
            raise PoolStartError("the master is already running")
        self._master_starts += 1
        log = self.work_dir / f"master.{self._master_starts}.log"
        self.master = _spawn("master", self.master_argv(), mooncake_env(self.spec.rpc_timeout_ms), log)
        deadline = time.monotonic() + self.spec.master_ready_timeout_s
        while True:
            if not self.master.alive():
                raise PoolStartError(
                    f"mooncake_master exited with status {self.master.popen.returncode}; log {log}:\n{log_tail(log)}"
                )
            if _accepts(LOCALHOST, self.address.rpc_port) and _accepts(LOCALHOST, self.address.metrics_port or 0):
                return
            if time.monotonic() > deadline:
                raise PoolStartError(
                    f"mooncake_master did not accept connections on {self.address.master} within "
                    f"{self.spec.master_ready_timeout_s:.0f} s; log {log}:\n{log_tail(log)}"
                )
            time.sleep(0.05)

    def kill_master(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the master (SIGKILL: it dies; with SIGKILL, also reap it)."""
        if self.master is None:
            return
        self.master.signal(sig)
        if sig == signal.SIGKILL:
            self.master.popen.wait(timeout=self.spec.stop_timeout_s)

    def pause_master(self, timeout_s: float = 2.0) -> None:
        """SIGSTOP the master and wait until every thread of it is stopped (a hung master)."""
        self.kill_master(signal.SIGSTOP)
        if self.master is None:
            return
        deadline = time.monotonic() + timeout_s
        while not _all_threads_stopped(self.master.pid):
            if time.monotonic() > deadline:
                raise PoolStartError(f"the master (pid {self.master.pid}) did not stop within {timeout_s} s")
            time.sleep(0.01)

    def resume_master(self) -> None:
        self.kill_master(signal.SIGCONT)

    # -- services ----------------------------------------------------------------------------
    def start_services(self, count: int) -> None:
        """Start ``count`` more store services and wait until each reports ready."""
        started: list[tuple[ManagedProcess, Path]] = []
        for _ in range(count):
            i = len(self.services)
            ready = self.work_dir / f"service{i}.ready.json"
            ready.unlink(missing_ok=True)
            argv = [
                sys.executable, "-m", "kvpool.backend.pool.store_service",
                "--master", self.address.master,
                "--segment-bytes", str(self.spec.bytes_per_service),
                "--ready-file", str(ready),
            ]  # fmt: skip
            proc = _spawn(f"service{i}", argv, mooncake_env(self.spec.rpc_timeout_ms), self.work_dir / f"service{i}.log")
            self.services.append(proc)
            started.append((proc, ready))
        deadline = time.monotonic() + self.spec.service_ready_timeout_s
        for proc, ready in started:
            self.segments.append(_wait_ready(proc, ready, deadline, self.spec.service_ready_timeout_s))

    def kill_service(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to service ``index`` (SIGKILL: its keys linger until the client TTL)."""
        proc = self.services[index]
        proc.signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            proc.popen.wait(timeout=self.spec.stop_timeout_s)

    # -- whole pool --------------------------------------------------------------------------
    def dead(self) -> list[str]:
        """Names of processes that have exited."""
        procs = ([self.master] if self.master else []) + self.services
        return [p.name for p in procs if not p.alive()]

    def stop(self) -> None:
        """Stop services (all at once: each ``close()`` takes ~2 s), then the master. Idempotent."""
        for proc in self.services:
            proc.signal(signal.SIGCONT)
            proc.signal(signal.SIGTERM)
        for proc in reversed(self.services):
            proc.stop(self.spec.stop_timeout_s)
        if self.master is not None:
            self.master.stop(self.spec.stop_timeout_s)

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in state T (stopped), from ``/proc/PID/task/*/stat``."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = []
        for tid in tasks:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            states.append(stat[stat.rindex(")") + 2])
    except (OSError, ValueError):
        return False
    return bool(states) and all(st in "Tt" for st in states)


def _accepts(host: str, port: int) -> bool:
    if not port:
        return True
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait_ready(proc: ManagedProcess, ready: Path, deadline: float, timeout_s: float) -> str:
    while True:
        if ready.exists():
            report = json.loads(ready.read_text())
            if report.get("rc") != 0:
                raise PoolStartError(
                    f"{proc.name}: setup returned {report.get('rc')}; log {proc.log_path}:\n{log_tail(proc.log_path)}"
                )
            return str(report["segment"])
        if not proc.alive():
            raise PoolStartError(
                f"{proc.name} exited with status {proc.popen.returncode} before reporting ready; "
                f"log {proc.log_path}:\n{log_tail(proc.log_path)}"
            )
        if time.monotonic() > deadline:
            raise PoolStartError(
                f"{proc.name} did not report ready within {timeout_s:.0f} s; "
                f"log {proc.log_path}:\n{log_tail(proc.log_path)}"
            )
        time.sleep(0.05)


def start_local_pool(
    spec: PoolSpec, work_dir: Path | str | None = None, *, allow_public_listeners: bool = False,
    listen_interfaces: Sequence[str] | None = None,
) -> LocalPool:
    """Start a master and ``spec.services`` store services on 127.0.0.1; return when all are ready.

    ``work_dir`` holds the logs and ready files (a new temporary directory if ``None``).
    Outside a private network namespace the store services' transfer engines would listen on every
    interface: ``PublicListenersRefused`` is raised before anything starts, unless
    ``allow_public_listeners`` is true or the namespace holds only ``lo`` and ``listen_interfaces``
    (``None``: ``KVPOOL_LISTEN_INTERFACES``; ``netns.check_listeners``). On failure every process started is stopped and
    ``PoolStartError`` is raised.
    """
    check_listeners(allow_public_listeners, "pass allow_public_listeners=True", listen_interfaces)
    wd = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="kvpool-pool-"))
    wd.mkdir(parents=True, exist_ok=True)
    rpc_port = free_port()
    metrics_port = free_port()
    while metrics_port == rpc_port:
        metrics_port = free_port()
    pool = LocalPool(spec=spec, address=PoolAddress(LOCALHOST, rpc_port, metrics_port), work_dir=wd)
    try:
        pool.start_master()
        pool.start_services(spec.services)
    except BaseException:
        pool.stop()
        raise
    return pool
