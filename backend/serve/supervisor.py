"""The supervisor of ``kvpool serve``: starts every process of the plan, runs the router, stops them all.

Contract:
    * ``run(scenario, port=..., run_dir=..., devices=...) -> int``: builds the plan
      (``plan.build_plan``), writes it to ``run_dir/plan.json`` and runs ``Supervisor.main``; the
      exit status is 0 after a stop by SIGTERM/SIGINT, 1 when a process failed (start or serve).
    * Start: the router's port is bound first (``PortError`` when it cannot be), then the roles in
      ``plan.ROLES`` order (decode engines, prefill stages, prefill engines). Each child runs
      ``worker.argv(plan.path)`` in its own process group (``start_new_session``; on Linux it also
      gets SIGKILL when the supervisor dies), stdout and stderr to ``plan.log_path(name)``. The
      supervisor waits for every ready file of a role before it starts the next, at most
      ``ready_timeout_s`` in all; a child that exits first fails the start at once
      (``StartError``: its name, its exit status and the last ``LOG_TAIL_LINES`` lines of its
      log). Then every engine's ``GET /health`` must answer ``ok`` within the same bound.
    * Serve: the router (``backend.serve.router``) in this process's asyncio loop on
      127.0.0.1:PORT; ``run_dir/router.ready.json`` holds its URL, its pid, every child's pid and
      the pids of the Mooncake pool it started (``pool``). A pool process that dies is reported
      once and serving goes on: prefill computes what the pool cannot load.
      A child that exits while serving is reported on stderr by name with its exit status and
      its log's tail, and the supervisor shuts down (``on_worker_exit="shutdown"``, the only
      policy: a restarted engine's peers would have to reconnect to it).
    * Stop (SIGTERM, SIGINT, or a child's exit): new requests get 503, in-flight ones have
      ``serve.drain_s`` to finish (a second signal, even one that comes before the drain has begun,
      ends them at once, as the drain's end does: 503); then every child gets SIGTERM (to its
      process group, by its pid) and, after ``stop_timeout_s``, SIGKILL; every child is reaped before ``main`` returns, on
      every path (a failed start included).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

import aiohttp
from aiohttp import web

from kvpool.backend.serve.plan import ROLES, ServePlan, Worker, build_plan, write_ready
from kvpool.backend.serve.router import RUNNER_OPTIONS, Engines, Router, serve_runner
from kvpool.scenario.model import Scenario

if TYPE_CHECKING:
    from kvpool.backend.serve.pool_setup import ServePool

#: Longest the start may take: every ready file and every engine's first healthy answer, s.
READY_TIMEOUT_S = 300.0
#: Longest a child has between SIGTERM and SIGKILL, s.
STOP_TIMEOUT_S = 10.0
#: How often the supervisor looks for exited children, s.
WATCH_INTERVAL_S = 0.1
#: Longest the requests cut after the drain have to send their 503 answers, s.
CUT_WAIT_S = 2.0
#: Lines of a failed child's log shown in its report.
LOG_TAIL_LINES = 20
#: Shutdown bound of the router's HTTP server after the drain (connections still open then are closed), s.
HTTP_SHUTDOWN_S = 1.0

ON_WORKER_EXIT = ("shutdown",)

ArgvFor = Callable[[Worker, Path], list[str]]


class StartError(RuntimeError):
    """A process could not be started or did not become ready; the message names it."""


class PortError(StartError):
    """The router's port cannot be bound."""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a log (none when it cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            tail = deque(f.read().decode("utf-8", errors="replace").splitlines(), maxlen=lines)
    except OSError:
        return []
    return list(tail)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the supervisor dies (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class Child:
    worker: Worker
    proc: subprocess.Popen
    ready: dict | None = None

    @property
    def name(self) -> str:
        return self.worker.name

    def report(self, log: Path, when: str) -> str:
        code = self.proc.poll()
        status = _exit_text(code) if code is not None else "no exit status"
        lines = log_tail(log)
        tail = "".join(f"\n  | {line}" for line in lines) if lines else "\n  | (empty)"
        return f"{self.name} (pid {self.proc.pid}) exited with {status} {when}; last lines of {log}:{tail}"


def bind_port(port: int) -> socket.socket:
    """A socket bound to 127.0.0.1:``port`` (not listening yet: connections are refused until the router serves)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as e:
        sock.close()
        raise PortError(f"--port {port}: cannot listen on 127.0.0.1:{port} ({e.strerror or e})") from None
    return sock


class Supervisor:
    def __init__(self, plan: ServePlan, *, argv_for: ArgvFor | None = None, ready_timeout_s: float = READY_TIMEOUT_S,
                 stop_timeout_s: float = STOP_TIMEOUT_S, out: IO[str] | None = None, err: IO[str] | None = None,
                 pool: ServePool | None = None) -> None:
        self.plan = plan
        self.pool = pool  # a Mooncake pool it started or joined: its deaths are reported, not fatal
        self._pool_dead: set[str] = set()
        self.scenario: Scenario = plan.scenario_model()
        self.argv_for: ArgvFor = argv_for or (lambda w, p: w.argv(p))
        self.ready_timeout_s, self.stop_timeout_s = ready_timeout_s, stop_timeout_s
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.children: list[Child] = []
        self.router: Router | None = None
        self._stop = asyncio.Event()
        self._failure: str | None = None  # a child's exit report, once one exited while serving
        self._signal: str | None = None
        self._signals = 0              # SIGTERM/SIGINT received
        self._cut_by_signal = False

    # start --------------------------------------------------------------------------------------
    def _spawn(self, w: Worker) -> Child:
        log = self.plan.log_path(w.name)
        with log.open("ab") as f:
            proc = subprocess.Popen(self.argv_for(w, self.plan.path), stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        child = Child(w, proc)
        self.children.append(child)
        return child

    async def _wait_ready(self, child: Child, deadline: float) -> dict:
        path = self.plan.ready_path(child.name)
        while True:
            if path.exists():
                try:
                    return json.loads(path.read_text())
                except ValueError:
                    pass  # written atomically by write_ready; a partial file is not expected
            if child.proc.poll() is not None:
                raise StartError(child.report(self.plan.log_path(child.name), "before it was ready"))
            if self._stop.is_set():
                raise StartError("stopped by a signal before every process was ready")
            if time.monotonic() >= deadline:
                raise StartError(f"{child.name} (pid {child.proc.pid}) was not ready within {self.ready_timeout_s:g} s; "
                                 f"see {self.plan.log_path(child.name)}")
            await asyncio.sleep(0.05)

    async def start(self) -> None:
        """Start every process in role order and wait until each is ready and healthy (see the contract)."""
        deadline = time.monotonic() + self.ready_timeout_s
        Path(self.plan.run_dir).mkdir(parents=True, exist_ok=True)
        for w in self.plan.workers:
            self.plan.ready_path(w.name).unlink(missing_ok=True)
        for role in ROLES:
            started = [self._spawn(w) for w in self.plan.by_role(role)]
            for child in started:
                child.ready = await self._wait_ready(child, deadline)
        await self._wait_healthy(deadline)

    def engines(self) -> Engines:
        def of(role: str) -> tuple[tuple[str, str], ...]:
            kids = sorted((c for c in self.children if c.worker.role == role), key=lambda c: c.worker.instance)
            return tuple((c.name, str(c.ready["url"])) for c in kids)

        return Engines(prefill=of("prefill_engine"), decode=of("decode_engine"))

    async def _wait_healthy(self, deadline: float) -> None:
        pending = dict(self.engines().all())
        async with aiohttp.ClientSession() as http:
            while pending:
                for name, url in list(pending.items()):
                    try:
                        async with http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                            body = await r.json(content_type=None)
                        if r.status == 200 and isinstance(body, dict) and body.get("status") == "ok":
                            del pending[name]
                    except (aiohttp.ClientError, TimeoutError, ValueError):
                        pass
                for c in self.children:
                    if c.proc.poll() is not None:
                        raise StartError(c.report(self.plan.log_path(c.name), "before it was healthy"))
                if not pending:
                    return
                if self._stop.is_set():
                    raise StartError("stopped by a signal before every engine was healthy")
                if time.monotonic() >= deadline:
                    raise StartError(f"not healthy within {self.ready_timeout_s:g} s: {', '.join(sorted(pending))} "
                                     f"(GET /health did not answer ok)")
                await asyncio.sleep(0.1)

    # serve --------------------------------------------------------------------------------------
    def _children_problem(self) -> str | None:
        dead = [f"{c.name} exited ({_exit_text(c.proc.returncode)})" for c in self.children if c.proc.poll() is not None]
        return "; ".join(dead) or None

    def _report_pool(self) -> None:
        """A pool process that died is said once: prefill then recomputes what it cannot load."""
        if self.pool is None:
            return
        for name in self.pool.dead():
            if name not in self._pool_dead:
                self._pool_dead.add(name)
                self._say(self.err, f"kvpool serve: pool process {name} exited; prefill computes what the pool "
                                    f"cannot load")

    async def _watch(self) -> None:
        while not self._stop.is_set():
            self._report_pool()
            for c in self.children:
                if c.proc.poll() is not None:
                    self._failure = c.report(self.plan.log_path(c.name), "while serving")
                    self._stop.set()
                    return
            try:
                await asyncio.wait_for(self._stop.wait(), WATCH_INTERVAL_S)
            except TimeoutError:
                pass

    def _on_signal(self, signum: int) -> None:
        self._signals += 1
        self._signal = signal.Signals(signum).name
        self._stop.set()
        if self._signals >= 2:
            self._cut_if_second_signal()

    def _cut_if_second_signal(self) -> None:
        """A second signal does not wait for the drain: once the drain has begun (now, or when it
        begins, for a second signal that came before), the in-flight requests end now (503)."""
        if self._signals >= 2 and self.router is not None and self.router.draining and not self._cut_by_signal:
            self._cut_by_signal = True
            self._say(self.err, "kvpool serve: a second signal: ending the in-flight requests now (503)")
            self.router.cut_in_flight()

    async def main(self, port: int) -> int:
        """Start, serve until a signal or a child's exit, stop (see the contract); the exit status."""
        sock = bind_port(port)
        loop = asyncio.get_running_loop()
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(s, self._on_signal, s)
        runner: web.AppRunner | None = None
        try:
            try:
                await self.start()
            except StartError as e:
                if self._signal is not None:
                    self._say(self.err, f"kvpool serve: {e}")
                    return 0
                raise
            self.router = Router(self.scenario, self.engines(), healthy_children=self._children_problem)
            runner = serve_runner(self.router.app, handle_signals=False, shutdown_timeout=HTTP_SHUTDOWN_S,
                                  access_log=None, **RUNNER_OPTIONS)
            await runner.setup()
            site = web.SockSite(runner, sock, shutdown_timeout=HTTP_SHUTDOWN_S)
            await site.start()
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            self._announce(url)
            await self._watch()
            if self._failure is not None:
                self._say(self.err, f"error: {self._failure}")
            self.router.begin_drain()
            self._cut_if_second_signal()
            drained = await self.router.drain(self.scenario.serve.drain_s)
            if not drained:
                self._say(self.err, f"kvpool serve: {self.router.in_flight} request(s) still running after "
                                    f"serve.drain_s = {self.scenario.serve.drain_s:g} s; answering them 503")
                self.router.cut_in_flight()
                await self.router.drain(CUT_WAIT_S)
            return 1 if self._failure is not None else 0
        finally:
            if runner is not None:
                await runner.cleanup()
            sock.close()
            await self.stop_children()
            for s in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(s)

    def _announce(self, url: str) -> None:
        pids = {c.name: c.proc.pid for c in self.children}
        pool_pids = self.pool.pids() if self.pool is not None else []
        write_ready(Path(self.plan.run_dir) / "router.ready.json", {"url": url, "workers": pids, "pool": pool_pids})
        lines = [f"kvpool serve: {self.scenario.name} on {url} (run dir {self.plan.run_dir})",
                 f"  {'router':<18} {'router':<15} pid {os.getpid():<8} {'':<16} {url}"]
        for c in self.children:
            where = (c.ready.get("url") or c.ready.get("endpoint") or "") if c.ready else ""
            devs = ",".join(c.worker.devices) or "-"
            lines.append(f"  {c.name:<18} {c.worker.role:<15} pid {c.proc.pid:<8} {devs:<16} {where}")
        self._say(self.out, "\n".join(lines))

    def _say(self, stream: IO[str], text: str) -> None:
        print(text, file=stream, flush=True)

    # stop ---------------------------------------------------------------------------------------
    async def stop_children(self) -> None:
        """SIGTERM every child's process group, SIGKILL after ``stop_timeout_s``; reap them all."""
        for c in reversed(self.children):
            self._kill(c, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        while any(c.proc.poll() is None for c in self.children) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for c in self.children:
            if c.proc.poll() is None:
                self._say(self.err, f"kvpool serve: {c.name} (pid {c.proc.pid}) did not stop within "
                                    f"{self.stop_timeout_s:g} s of SIGTERM; sending SIGKILL")
            self._kill(c, signal.SIGKILL)  # the group too: anything the child started
        for c in self.children:
            c.proc.wait()

    @staticmethod
    def _kill(c: Child, sig: signal.Signals) -> None:
        try:
            os.killpg(c.proc.pid, sig)  # its own group: start_new_session made the child its leader
        except (ProcessLookupError, PermissionError):
            pass


def run(scenario: Scenario, *, port: int, run_dir: str | Path, devices: tuple[str, ...] | None = None,
        pool_address: str | None = None, argv_for: ArgvFor | None = None, ready_timeout_s: float = READY_TIMEOUT_S,
        stop_timeout_s: float = STOP_TIMEOUT_S) -> int:
    """Plan, start, serve and stop (see the module contract); raises ``StartError`` when the start fails.

    With ``serve.pool = "mooncake"`` the pool comes first: ``pool_setup.start_serve_pool`` joins
    ``pool_address`` or starts a local Mooncake pool (stopped after every child, on every path),
    and the plan carries its address. ``ServePoolError`` when it cannot.
    """
    pool = None
    if scenario.serve.pool == "mooncake":
        from kvpool.backend.serve.pool_setup import start_serve_pool

        pool = start_serve_pool(scenario, run_dir, pool_address)
    try:
        plan = build_plan(scenario, run_dir, port, devices, pool_address=pool.address if pool is not None else "")
        plan.write()
        sup = Supervisor(plan, argv_for=argv_for, ready_timeout_s=ready_timeout_s, stop_timeout_s=stop_timeout_s,
                         pool=pool)
        return asyncio.run(sup.main(port))
    finally:
        if pool is not None:
            pool.stop()
