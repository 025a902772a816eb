"""``kvpool pool``: start and inspect a real Mooncake Store pool on 127.0.0.1 (master + store services).

``kvpool pool up`` starts ``mooncake_master`` and N memory-only store services (the seed's "one Store
service per NUMA node") through ``kvpool.backend.pool.launcher`` -- the same code the pytest
fixtures use --, waits until all are ready, prints the address to use, records it in a state file
and stops everything cleanly on Ctrl-C or SIGTERM. ``kvpool pool status`` reads the master's
metrics endpoint: capacity, use, keys, evictions.

The state file: ``pool up`` refuses one that exists unless ``--force`` (or it is the record of a
``pool up`` whose process has ended), writes it atomically once the pool is ready, and on exit
removes it only while it is still the file this run wrote with this run's content.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

import typer

from kvpool.cli.common import UserError

app = typer.Typer(help="Start and inspect a real Mooncake Store pool: a master on 127.0.0.1 and store services, whose Mooncake listeners bind every interface (see pool up --help).", no_args_is_help=True, rich_markup_mode=None)

GIB = 1 << 30
MAX_GIB_PER_SERVICE = 65_536  # as pool.gib_per_service in a scenario
MAX_TIMEOUT_S = 600.0


def default_state_file() -> Path:
    """Where ``pool up`` records the running pool's address for ``pool status``."""
    return Path(tempfile.gettempdir()) / f"kvpool-pool-{os.getuid()}.json"


def _mem_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


STATE_KEYS = frozenset({"address", "pid", "work_dir"})
MAX_STATE_BYTES = 64 << 10


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    record = dict(pairs)
    if len(record) != len(pairs):
        raise ValueError("a key given twice")
    return record


def _read_state(path: Path) -> dict | None:
    """The pool record in ``path`` (a regular file, not a link, of at most 64 KiB, a JSON object of
    exactly ``STATE_KEYS``, each once: a string address and work_dir, a positive integer pid), else ``None``."""
    try:
        if path.is_symlink() or not path.is_file():
            return None
        with path.open("rb") as f:
            data = f.read(MAX_STATE_BYTES + 1)
        record = json.loads(data, object_pairs_hook=_unique_keys) if len(data) <= MAX_STATE_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or set(record) != STATE_KEYS:
        return None
    if not isinstance(record["address"], str) or not isinstance(record["work_dir"], str):
        return None
    pid = record["pid"]
    return record if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _state_file_replaceable(state: Path, force: bool) -> bool:
    """Whether ``pool up`` may write ``state``: ``False`` when nothing is there (create it, never
    replacing), ``True`` to replace it (``--force``, or a record of a ``pool up`` that has ended);
    a ``UserError`` otherwise."""
    from kvpool.outputs import output_file

    output_file(state, "--state-file", create=False)  # not a folder; its folder is writable or can be made
    if not os.path.lexists(state):
        return False
    if force:
        return True
    record = _read_state(state)
    if record is not None and not _process_runs(record["pid"]):
        return True  # left behind by a pool up that was killed
    why = (f"records the pool of process {record['pid']}, which is still running" if record is not None
           else "exists and was not written by this run")
    raise UserError(f"--state-file {state}: {why}; give another --state-file, or --force to overwrite it")


def _write_state(state: Path, text: str, replace: bool) -> tuple[int, int]:
    """Write ``text`` to ``state`` atomically; return the written file's (device, inode)."""
    from kvpool.outputs import atomic_path

    try:
        with atomic_path(state, replace=replace) as tmp:
            tmp.write_text(text)
    except FileExistsError:
        raise UserError(f"--state-file {state}: appeared while the pool started; give another --state-file, "
                        "or --force to overwrite it") from None
    except OSError as e:
        raise UserError(f"--state-file {state}: cannot write it: {e.strerror or e}") from None
    st = os.lstat(state)
    return st.st_dev, st.st_ino


def _remove_state(state: Path, text: str, written: tuple[int, int]) -> None:
    """Remove ``state`` if it is still the file this run wrote and holds ``text``."""
    try:
        st = os.lstat(state)
        if (st.st_dev, st.st_ino) == written and state.read_text() == text:
            state.unlink()
    except (OSError, ValueError):
        pass


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@app.command()
def up(
    services: int = typer.Option(2, "--services", help="Memory-only store services (one per NUMA node in production)."),
    gib_per_service: float = typer.Option(1.0, "--gib-per-service", help="GiB each service contributes (e.g. 0.0625 = 64 MiB)."),
    eviction_high_watermark: float = typer.Option(0.90, "--eviction-high-watermark", help="Pool use fraction that starts eviction (0-1]."),
    eviction_ratio: float = typer.Option(0.05, "--eviction-ratio", help="Fraction of objects one eviction pass frees (0-1]."),
    lease_ttl_ms: int = typer.Option(10_000, "--lease-ttl-ms", help="Read/exist lease: leased objects are not evicted."),
    client_ttl_s: int = typer.Option(10, "--client-ttl-s", help="Seconds a dead service's keys still count as existing."),
    rpc_timeout_ms: int = typer.Option(2_000, "--rpc-timeout-ms", help="MC_RPC_TIMEOUT_MS: a hung master fails calls after this."),
    work_dir: Path = typer.Option(None, "--work-dir", help="Logs and ready files (default: a new temporary directory)."),
    state_file: Path = typer.Option(
        None, "--state-file",
        help="Where to record the address for 'pool status' (default: in the temp dir). An existing file is "
             "refused unless --force; it is removed on exit if it still holds this run's record."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing --state-file."),
    allow_public_listeners: bool = typer.Option(
        False, "--allow-public-listeners",
        help="Start even outside a private network namespace, where the store services' Mooncake listeners "
             "are reachable on every interface of this machine."),
    listen_interfaces: list[str] = typer.Option(
        [], "--listen-interface", metavar="NAME",
        help="An interface the store services' Mooncake listeners may be reachable on (repeatable; "
             "default: KVPOOL_LISTEN_INTERFACES, comma-separated). pool up then starts only in a network namespace "
             "holding lo and exactly these interfaces, and refuses one holding any other."),
) -> None:
    """Start a master and N store services; stop them on Ctrl-C or SIGTERM.

    Where it listens: the master (RPC) and its metrics on 127.0.0.1. Each store service runs
    Mooncake's transfer engine, whose handshake and data listeners bind every interface (0.0.0.0
    and [::]) whatever MC_TCP_BIND_ADDRESS says. So pool up refuses to start outside a private
    network namespace whose only interface is lo (unshare -n sh -c 'ip link set lo up; exec
    kvpool pool up ...'), or in one holding only lo and the interfaces named with
    --listen-interface (the listeners are then reachable on those), unless
    --allow-public-listeners is given."""
    from kvpool.backend.pool.launcher import PoolSpec, PoolStartError, start_local_pool
    from kvpool.backend.pool.netns import PublicListenersRefused, check_listeners, listen_interfaces_from_env

    if not (math.isfinite(gib_per_service) and 0 < gib_per_service <= MAX_GIB_PER_SERVICE):
        raise UserError(f"--gib-per-service {gib_per_service:g}: must be a finite number > 0 and <= {MAX_GIB_PER_SERVICE}")
    if work_dir is not None:
        from kvpool.outputs import output_dir

        output_dir(work_dir, "--work-dir", create=False)
    state = state_file or default_state_file()
    replace = _state_file_replaceable(state, force)
    try:
        spec = PoolSpec(
            services=services,
            bytes_per_service=int(gib_per_service * GIB),
            eviction_high_watermark=eviction_high_watermark,
            eviction_ratio=eviction_ratio,
            lease_ttl_ms=lease_ttl_ms,
            client_ttl_s=client_ttl_s,
            rpc_timeout_ms=rpc_timeout_ms,
        )
    except ValueError as e:  # "FIELD must ...": name the flag that sets FIELD
        field = str(e).split(" ", 1)[0]
        flag = {"bytes_per_service": "--gib-per-service"}.get(field, "--" + field.replace("_", "-"))
        raise UserError(f"{flag}: {e}") from None
    avail = _mem_available_bytes()
    if avail is not None and spec.capacity_bytes > avail:
        raise UserError(
            f"{services} services x {gib_per_service} GiB = {_fmt_bytes(spec.capacity_bytes)} exceeds the "
            f"memory available on this machine ({_fmt_bytes(avail)}); lower --services or --gib-per-service"
        )
    listen = tuple(dict.fromkeys(n.strip() for n in listen_interfaces if n.strip())) or listen_interfaces_from_env()
    try:
        problem = check_listeners(allow_public_listeners, "give --allow-public-listeners", listen)
    except PublicListenersRefused as e:
        raise UserError(str(e)) from None
    if problem:
        typer.echo(f"warning: {problem}", err=True)
    elif listen:
        typer.echo(f"note: the store services' Mooncake listeners are reachable on {', '.join(listen)}", err=True)

    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            pool = start_local_pool(spec, work_dir, allow_public_listeners=allow_public_listeners,
                                    listen_interfaces=listen)
        except PoolStartError as e:
            raise UserError(f"the pool did not start: {e}") from None
        record = json.dumps({"address": pool.address.url(), "pid": os.getpid(), "work_dir": str(pool.work_dir)})
        written: tuple[int, int] | None = None
        try:
            written = _write_state(state, record, replace)
            typer.echo(
                f"kvpool pool: master {pool.address.master}, {spec.services} services x "
                f"{_fmt_bytes(spec.bytes_per_service)} = {_fmt_bytes(spec.capacity_bytes)}"
            )
            typer.echo(f"address: {pool.address.url()}")
            typer.echo(f"metrics: {pool.address.metrics_url}/metrics")
            typer.echo(f"logs: {pool.work_dir}")
            typer.echo("ready; Ctrl-C or SIGTERM stops the pool")
            sys.stdout.flush()
            failed: list[str] = []
            while not stop.wait(0.5):
                failed = pool.dead()
                if failed:
                    break
        finally:
            pool.stop()
            if written is not None:
                _remove_state(state, record, written)
        if failed:
            raise UserError(f"pool process(es) exited unexpectedly: {', '.join(failed)}; logs in {pool.work_dir}")
        typer.echo("kvpool pool: stopped")
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@app.command()
def status(
    address: str = typer.Option(None, "--address", help="mooncake://HOST:RPC?metrics=PORT (default: the pool 'pool up' recorded)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    state_file: Path = typer.Option(None, "--state-file", help="The state file 'pool up' wrote (default: in the temp dir)."),
    timeout_s: float = typer.Option(2.0, "--timeout-s", help="Bound on the metrics request."),
) -> None:
    """Capacity, use, keys and evictions from the master's metrics endpoint."""
    from kvpool.backend.pool.address import PoolAddress
    from kvpool.backend.pool.metrics import MetricsUnavailable, read_master_metrics

    if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise UserError(f"--timeout-s {timeout_s:g}: must be a finite number of seconds > 0 and <= {MAX_TIMEOUT_S:g}")
    state_record = None
    if address is None:
        state = state_record = state_file or default_state_file()
        record = _read_state(state)
        if record is None and os.path.lexists(state):
            raise UserError(
                f"state file {state}: not a record of 'kvpool pool up' (a regular file of at most "
                f"{MAX_STATE_BYTES >> 10} KiB holding one JSON object with {', '.join(sorted(STATE_KEYS))}); "
                "give --address, or the state file pool up wrote")
        if record is None:
            raise UserError(
                f"no --address given and no running pool recorded in {state}; start one with 'kvpool pool up'"
            )
        address = record["address"]
    try:
        addr = PoolAddress.parse(address)
    except ValueError as e:
        where = "--address" if state_record is None else f"state file {state_record}: address"
        raise UserError(f"{where}: {e}") from None
    if addr.metrics_url is None:
        raise UserError(f"address {address!r} has no metrics port; use mooncake://HOST:RPC?metrics=PORT")
    try:
        m = read_master_metrics(addr.metrics_url, timeout_s)
    except MetricsUnavailable as e:
        raise UserError(f"{e} (is the pool running, and in this network namespace?)") from None
    if as_json:
        typer.echo(json.dumps({"address": addr.url(), **m.to_dict()}, indent=2))
        return
    pct = 100.0 * m.used_bytes / m.capacity_bytes if m.capacity_bytes else 0.0
    typer.echo(f"pool       {addr.url()}")
    typer.echo(f"capacity   {_fmt_bytes(m.capacity_bytes)} ({len(m.segments)} services)")
    typer.echo(f"used       {_fmt_bytes(m.used_bytes)} ({pct:.1f} %)")
    typer.echo(f"keys       {m.key_count}")
    typer.echo(f"evictions  {m.eviction_passes} passes, {m.evicted_key_count} keys, {_fmt_bytes(m.evicted_bytes)}")
    for seg in m.segments:
        typer.echo(f"  service {seg.segment}: {_fmt_bytes(seg.used_bytes)} of {_fmt_bytes(seg.capacity_bytes)}")
