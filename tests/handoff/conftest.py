"""Fixtures of the handoff tests: spawn-started decode-rank and prefill-stage processes on loopback.

Mooncake's listeners bind every address, so these tests refuse (fail, not skip) to run outside a
private network namespace whose only interface is ``lo``:

    unshare -n sh -c 'ip link set lo up; exec .venv/bin/python -m pytest tests/handoff -q'
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterator

import pytest

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from handoff_workers import Geom, call, decode_main, prefill_main  # noqa: E402


def require_private_netns() -> None:
    from kvpool.backend.pool.netns import netns_problem

    problem = netns_problem()
    if problem:
        pytest.fail(problem)


class Cluster:
    """Decode-rank and prefill-stage processes of one test; all stopped (then killed) at teardown."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[mp.Process] = []
        self.conns: list = []

    def _spawn(self, target, *args):
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        self.procs.append(p)
        self.conns.append(parent)
        return p, parent

    @staticmethod
    def _started(p, parent, timeout_s: float = 90.0) -> tuple:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"worker {p.pid} did not start within {timeout_s} s")
        kind, value = parent.recv()
        if kind != "ok":
            raise RuntimeError(value)
        return p, parent, value

    def decodes(self, g: Geom, kind: str, ranks: int | None = None, **opts) -> list[tuple]:
        """Start decode ranks (in parallel); each (process, conn, endpoint)."""
        spawned = [self._spawn(decode_main, r, g, kind, opts) for r in range(g.ranks if ranks is None else ranks)]
        return [self._started(p, c) for p, c in spawned]

    def prefills(self, g: Geom, kind: str, endpoints: list[str], stages: int | None = None, **opts) -> list[tuple]:
        """Start prefill stages attached to ``endpoints`` (in parallel); each (process, conn, name)."""
        spawned = [self._spawn(prefill_main, s, g, kind, endpoints, opts)
                   for s in range(g.stages if stages is None else stages)]
        return [self._started(p, c) for p, c in spawned]

    def stop(self) -> None:
        for p, conn in zip(self.procs, self.conns):
            if p.is_alive():
                try:
                    conn.send(("stop",))
                except (BrokenPipeError, OSError):
                    pass
        for p in self.procs:
            p.join(3)
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture(scope="module")
def handoff_cluster() -> Iterator[tuple[Geom, list, list]]:
    """2 decode ranks x 2 prefill stages over Mooncake TCP for the healthy-path tests of a module:
    (geometry, decode conns, prefill conns). Requests may shrink tokens/start/write size."""
    require_private_netns()
    c = Cluster()
    g = Geom(tokens=1100, slots=32)
    try:
        decodes = c.decodes(g, "mooncake")
        prefills = c.prefills(g, "mooncake", [ep for _, _, ep in decodes])
        yield g, [x[1] for x in decodes], [x[1] for x in prefills]
    finally:
        c.stop()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    require_private_netns()
    c = Cluster()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def run_request() -> Callable:
    """Expect a request on every decode conn, send it from every prefill conn, return
    (stage reports or error dicts, decode results or error strings)."""

    def run(decodes, prefills, rid: str, seed: int = 0, target: str = "a", send_timeout_s: float = 30.0,
            wait_timeout_s: float = 30.0, **over):
        """``over``: per-request Geom fields (tokens, token_start, max_write_bytes) and max_inflight."""
        geom = {k: v for k, v in over.items() if k != "max_inflight"}
        for conn in decodes:
            call(conn, ("expect", rid, seed, geom))
        for conn in prefills:
            conn.send(("send", rid, seed, target, send_timeout_s, over))
        reports = []
        for conn in prefills:
            if not conn.poll(send_timeout_s + 10):
                raise TimeoutError("prefill did not answer")
            reports.append(conn.recv()[1])
        results = []
        for conn in decodes:
            try:
                results.append(call(conn, ("wait", rid, wait_timeout_s), wait_timeout_s + 10))
            except RuntimeError as exc:
                results.append(str(exc))
        return reports, results

    return run
