"""Where simulator points run: in this process, in worker processes, or on a Ray cluster.

Contract:
    * ``EXECUTORS``: ``local`` (this machine: in-process for one worker, else worker processes) and
      ``ray`` (tasks on a Ray cluster). The choice never changes a result: every point is
      deterministic (``sim.run.run_point``), so the same seed gives the same numbers anywhere.
    * ``check(executor, address)`` raises ``ExecutorError`` (one line, naming the flag and what is
      allowed) for an unknown executor, an ``address`` without ``ray``, or Ray not installed.
    * ``runner(executor, workers=, address=)`` is a context manager yielding a ``Runner`` whose
      ``map(fn, tasks, on_done)`` runs ``fn(task)`` for every task, calls ``on_done(i, result)`` as each
      finishes (in completion order) and returns the results in task order. ``fn`` must be a module-
      level function and the tasks picklable.
    * Progress inside a task: ``map(fn, tasks, on_done, on_progress)`` calls ``fn(task, report)``
      and delivers each ``report(value)`` as ``on_progress(i, value)`` in the calling thread.
      In-process, ``report`` is that call. In worker processes it puts ``(i, value)`` on a queue of
      a ``multiprocessing.Manager`` (a small server process, which ignores Ctrl-C), and ``map``
      drains the queue every ``PROGRESS_POLL_S`` while it waits for results, and before it hands
      on a finished task's result, so a task's reports all come before its ``on_done``; ``value``
      must be picklable. Ray tasks run as ``fn(task)`` and report nothing until they finish
      (``on_done``): a channel back from a cluster's nodes would be a Ray actor, more machinery
      than a progress bar is worth. Without ``on_progress``, ``fn(task)`` everywhere.
    * ``local``: ``workers <= 1`` or a single task runs in-process; otherwise a process pool of
      ``min(workers, len(tasks))`` per ``map`` call.
    * Ctrl-C (or any error) during a ``map`` in worker processes leaves no process behind and does
      not wait for the remaining tasks: the workers are stopped, the queue's server is shut down,
      and the ``KeyboardInterrupt`` (or the error) reaches the caller. A Ctrl-C that comes while
      those processes start is held back until their cleanup is in place, then delivered.
    * ``ray`` with ``address`` (``host:port`` of the head's GCS, ``ray://host:port`` for Ray Client, or
      ``auto``): connects to that cluster, after checking within ``connect_timeout_s`` that something
      listens there (Ray itself would retry for minutes); the nodes need kvpool installed; an
      address on 127.0.0.0/8 or localhost is joined as node 127.0.0.1. Without ``address``: starts
      a private local Ray runtime bound to 127.0.0.1 only (no dashboard, no usage stats), whoever
      imported Ray first, with ``workers`` CPUs (0: the cores). On exit it disconnects, which stops
      a runtime it started; a Ray session that was already open in this process is used and left
      open.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from functools import partial
from typing import Any

EXECUTORS = ("local", "ray")
RAY_PORT = 6379  # Ray's default GCS port, when an address names only the host
INSTALL_HINT = "pip install 'kvpool[ray]' (or pip install 'ray>=2.9')"


class ExecutorError(ValueError):
    """An executor that cannot run: the message names the flag, the value and what is allowed."""


def check(executor: str, address: str | None = None) -> None:
    """Fail early (before any simulation) on an executor that cannot run; see the module docstring."""
    if executor not in EXECUTORS:
        raise ExecutorError(f"--executor {executor!r}: allowed: {', '.join(EXECUTORS)}")
    if address is not None and executor != "ray":
        raise ExecutorError(f"--address {address!r} needs --executor ray")
    if executor == "ray" and importlib.util.find_spec("ray") is None:  # found, not imported (an import is slow)
        raise ExecutorError(f"--executor ray needs Ray, which is not installed: {INSTALL_HINT}")


def _host_port(address: str) -> tuple[str, int] | None:
    """The TCP endpoint an address names, or None for ``auto``/``local`` (resolved by Ray itself)."""
    a = address.strip()
    if a in ("auto", "local"):
        return None
    if a.startswith("ray://"):
        a = a[len("ray://"):]
    a = a.rstrip("/")
    if a.startswith("["):  # [ipv6]:port
        host, _, rest = a[1:].partition("]")
        port = rest.lstrip(":")
    elif a.count(":") == 1:
        host, port = a.split(":")
    else:
        host, port = a, ""
    if not host:
        raise ExecutorError(f"--address {address!r}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        return host, int(port) if port else RAY_PORT
    except ValueError:
        raise ExecutorError(f"--address {address!r}: port {port!r} is not a number") from None


def _on_loopback(address: str) -> bool:
    """Whether ``address`` names a cluster on this host's loopback (not a Ray Client address,
    whose driver is not a node)."""
    hp = _host_port(address)
    return hp is not None and not address.strip().startswith("ray://") and (
        hp[0] == "localhost" or hp[0] == "::1" or hp[0].startswith("127."))


def probe(address: str, timeout_s: float) -> None:
    """Raise ``ExecutorError`` unless something accepts TCP connections at ``address`` within ``timeout_s``."""
    hp = _host_port(address)
    if hp is None:
        return
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            pass
    except socket.timeout:
        raise ExecutorError(f"--address {address}: no answer from {hp[0]}:{hp[1]} within {timeout_s:g} s; "
                            "is the Ray head running there (ray start --head)?") from None
    except OSError as e:
        raise ExecutorError(f"--address {address}: cannot reach a Ray cluster at {hp[0]}:{hp[1]} "
                            f"({e.strerror or e}); is the Ray head running there (ray start --head)?") from None


class Runner:
    """Runs batches of tasks; see the module docstring."""

    def __init__(self, executor: str, workers: int):
        self.executor = executor
        self.workers = workers

    def map(self, fn: Callable[..., Any], tasks: Sequence[Any],
            on_done: Callable[[int, Any], None] | None = None,
            on_progress: Callable[[int, Any], None] | None = None) -> list:
        results: dict[int, Any] = {}

        def done(i: int, r: Any) -> None:
            results[i] = r
            if on_done:
                on_done(i, r)

        if self.executor == "ray":
            import ray

            remote = ray.remote(num_cpus=1)(fn)
            refs = {remote.remote(t): i for i, t in enumerate(tasks)}
            pending = list(refs)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                done(refs[ready[0]], ray.get(ready[0]))
        elif self.workers <= 1 or len(tasks) <= 1:
            for i, t in enumerate(tasks):
                done(i, fn(t) if on_progress is None else fn(t, partial(on_progress, i)))
        else:
            _map_in_processes(fn, tasks, min(self.workers, len(tasks)), done, on_progress)
        return [results[i] for i in range(len(tasks))]


PROGRESS_POLL_S = 0.2  # how often ``map`` drains the worker processes' progress queue


def _map_in_processes(fn: Callable[..., Any], tasks: Sequence[Any], workers: int, done: Callable[[int, Any], None],
                      on_progress: Callable[[int, Any], None] | None) -> None:
    """``Runner.map`` over a pool of ``workers`` processes (see the module docstring)."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from multiprocessing import Manager

    with ExitStack() as stack:
        with _ctrl_c_held_back():  # the processes start (the pool's on its first submit), their cleanup registered
            queue = stack.enter_context(Manager()).Queue() if on_progress else None
            pool = stack.enter_context(_stopped_on_error(
                ProcessPoolExecutor(max_workers=workers, initializer=_stop_quietly_on_ctrl_c)))
            futs = {pool.submit(fn, t, *([_QueueReport(queue, i)] if queue else [])): i for i, t in enumerate(tasks)}
        pending = set(futs)
        while pending:
            finished, pending = wait(pending, timeout=PROGRESS_POLL_S if queue else None, return_when=FIRST_COMPLETED)
            if queue is not None:
                _drain(queue, on_progress)
            for f in sorted(finished, key=futs.__getitem__):
                done(futs[f], f.result())


@contextmanager
def _ctrl_c_held_back() -> Iterator[None]:
    """A Ctrl-C during the block is delivered when it ends (to the SIGINT handler in place before).

    Processes start inside it: a Ctrl-C that lands inside ``Manager()`` after its server process has
    started but before its shutdown is registered would leave that process (which ignores Ctrl-C)
    running, and this process would wait for it at exit forever; a pool's worker forked after the
    terminal's SIGINT never gets it. Outside the main thread (where no handler can be set) and
    where SIGINT's handler was not set from Python, the block runs as is."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)


@contextmanager
def _stopped_on_error(pool) -> Iterator[Any]:
    """``pool`` (a ``ProcessPoolExecutor``) for the block. On leaving it normally the pool shuts down
    as usual; on an error or a Ctrl-C its queued tasks are cancelled and its workers terminated at
    once (a plain shutdown would run every queued task first, and a worker forked after the
    terminal's SIGINT never got it)."""
    try:
        yield pool
    except BaseException:
        for process in list((pool._processes or {}).values()):  # the executor offers no public handle on them
            process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)  # its manager thread finds them gone and reaps them
        raise
    pool.shutdown(wait=True)


class _QueueReport:
    """A worker process's ``report(value)``: puts ``(task index, value)`` on the parent's queue."""

    def __init__(self, queue, index: int) -> None:
        self.queue, self.index = queue, index

    def __call__(self, value: Any) -> None:
        self.queue.put((self.index, value))


def _drain(queue, on_progress: Callable[[int, Any], None]) -> None:
    """Deliver every report waiting on ``queue``, in the order they were put."""
    from queue import Empty

    while True:
        try:
            index, value = queue.get_nowait()
        except Empty:
            return
        on_progress(index, value)


def _stop_quietly_on_ctrl_c() -> None:
    """A sweep's worker process ends at once, without a traceback, on Ctrl-C (the terminal sends
    SIGINT to every process of the group); the parent, which holds the outputs, reports it."""
    import signal

    signal.signal(signal.SIGINT, lambda *_: os._exit(130))


def _import_ray():
    """Import Ray with usage stats off (they would call home), unless the user set this already."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    return ray


@contextmanager
def _loopback_node(ray) -> Iterator[None]:
    """While a private runtime starts: Ray takes 127.0.0.1 as this node's address, the way it does
    on a single-node Windows or macOS host, so every server it starts binds to loopback, and it
    never probes a route to 8.8.8.8. Ray reads its switch (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER) once,
    at import, and whoever imported Ray first may have set it; so the constant itself is switched
    for the start and restored after (``_node_ip_address`` alone still lets the GCS pick the host's
    routed address)."""
    from ray._private import ray_constants

    was = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = was


@contextmanager
def runner(executor: str = "local", *, workers: int = 1, address: str | None = None,
           connect_timeout_s: float = 10.0) -> Iterator[Runner]:
    """A ``Runner`` for ``executor``; with ``ray``, connect or start a local runtime for the duration."""
    check(executor, address)
    if executor != "ray":
        yield Runner(executor, workers)
        return
    import logging

    ray = _import_ray()
    if ray.is_initialized():  # a session this process already holds (e.g. the caller's): use it, leave it open
        yield Runner("ray", workers)
        return
    if address is not None:
        probe(address, connect_timeout_s)
        kwargs: dict[str, Any] = {"address": address}
    else:
        # a private runtime: every server on loopback only, no dashboard, a small object store
        # (results are small dicts), as many CPUs as workers
        kwargs = {"address": "local", "num_cpus": workers if workers > 0 else (os.cpu_count() or 1),
                  "include_dashboard": False, "_node_ip_address": "127.0.0.1",
                  "object_store_memory": 128 * 1024 * 1024}
    try:
        # a private runtime, or a cluster on loopback, which this node joins as 127.0.0.1
        with _loopback_node(ray) if address is None or _on_loopback(address) else nullcontext():
            ray.init(**kwargs, log_to_driver=False, logging_level=logging.ERROR)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError, SystemExit) as e:
        ray.shutdown()
        what = f"connect to the Ray cluster at {address}" if address is not None else "start a local Ray runtime"
        lines = str(e).strip().splitlines()
        why = lines[0] if lines and not lines[0].isdigit() else type(e).__name__  # SystemExit carries a status
        raise ExecutorError(f"--executor ray: cannot {what}: {why}") from None
    try:
        yield Runner("ray", workers)
    finally:
        ray.shutdown()
