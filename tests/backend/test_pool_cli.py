"""``kvpool pool up`` / ``kvpool pool status`` as a user runs them, plus the launcher's small parts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.backend.pool import netns
from kvpool.backend.pool.address import PoolAddress
from kvpool.backend.pool.launcher import PoolSpec
from kvpool.backend.pool.metrics import MetricsUnavailable, metrics_from_text, read_master_metrics

from pool_testing import require_private_netns

KVPOOL = [sys.executable, "-c", "from kvpool.cli import main; main()"]
MIB = 1 << 20


def start_pool_up(tmp_path: Path, *args: str, prelude: str = "") -> tuple[subprocess.Popen, dict[str, str]]:
    """Run ``kvpool pool up`` and read its banner until 'ready' (bounded)."""
    code = f"{prelude}\nfrom kvpool.cli import main; main()"
    argv = [sys.executable, "-c", code, "pool", "up", "--services", "2", "--gib-per-service", "0.0625",
            "--client-ttl-s", "2", "--work-dir", str(tmp_path / "pool"), "--state-file", str(tmp_path / "state.json"), *args]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    banner: dict[str, str] = {}
    deadline = time.monotonic() + 30
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if ":" in line:
            k, v = line.split(":", 1)
            banner[k.strip()] = v.strip()
        if line.startswith("ready"):
            return proc, banner
    proc.kill()
    pytest.fail(f"pool up did not become ready: {banner} {proc.stderr.read() if proc.stderr else ''}")


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    "stop_signal, outside_namespace",
    [(signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["sigterm-in-namespace", "ctrl-c-looks-outside"],
)
def test_pool_up_serves_status_and_stops_cleanly(tmp_path: Path, stop_signal: int, outside_namespace: bool) -> None:
    """``outside_namespace`` makes ``pool up`` believe eth0 exists: with --allow-public-listeners
    it must warn but work (its processes still start inside this test's namespace)."""
    require_private_netns()
    fake = "import socket; socket.if_nameindex = lambda: [(1, 'lo'), (2, 'eth0')]" if outside_namespace else ""
    extra = ("--allow-public-listeners",) if outside_namespace else ()
    proc, banner = start_pool_up(tmp_path, *extra, prelude=fake)
    try:
        addr = PoolAddress.parse(banner["address"])
        assert addr.host == "127.0.0.1" and addr.metrics_port
        state = json.loads((tmp_path / "state.json").read_text())
        assert state["address"] == addr.url()

        out = subprocess.run([*KVPOOL, "pool", "status", "--address", addr.url(), "--json"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        assert status["capacity_bytes"] == 2 * 64 * MIB and status["key_count"] == 0
        assert len(status["segments"]) == 2
        # without --address, status finds the pool through the state file 'pool up' wrote
        out = subprocess.run([*KVPOOL, "pool", "status", "--state-file", str(tmp_path / "state.json")], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert "capacity   128.00 MiB (2 services)" in out.stdout and "evictions" in out.stdout
        service_pids = [json.loads(p.read_text())["pid"] for p in sorted((tmp_path / "pool").glob("service*.ready.json"))]
        assert len(service_pids) == 2
    finally:
        proc.send_signal(stop_signal)
        rc = proc.wait(timeout=30)
    stdout, stderr = proc.communicate(timeout=5)
    assert rc == 0, stderr
    assert "kvpool pool: stopped" in stdout
    if outside_namespace:
        assert "warning: network interfaces other than lo are visible (eth0)" in stderr and "unshare -n" in stderr
    else:
        assert "warning" not in stderr
    assert not (tmp_path / "state.json").exists()
    assert not port_open(addr.rpc_port) and not port_open(addr.metrics_port or 0)
    for pid in service_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_pool_up_stops_everything_and_fails_when_a_service_dies(tmp_path: Path) -> None:
    require_private_netns()
    proc, banner = start_pool_up(tmp_path)
    addr = PoolAddress.parse(banner["address"])
    victim = json.loads((tmp_path / "pool" / "service0.ready.json").read_text())["pid"]
    os.kill(victim, signal.SIGKILL)
    try:
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    _, stderr = proc.communicate(timeout=5)
    assert rc == 2 and "error: pool process(es) exited unexpectedly: service0" in stderr
    assert not port_open(addr.rpc_port)  # the master was stopped too
    assert not (tmp_path / "state.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["pool", "up", "--gib-per-service", "0"], "--gib-per-service 0: must be a finite number > 0 and <= 65536"),
        (["pool", "up", "--gib-per-service", "inf"], "--gib-per-service inf: must be a finite number > 0"),
        (["pool", "up", "--gib-per-service", "100000"], "--gib-per-service 100000: must be a finite number > 0 and <= 65536"),
        (["pool", "up", "--services", "0"], "error: --services: services must be in 1..64"),
        (["pool", "up", "--gib-per-service", "60000"], "exceeds the memory available"),
        (["pool", "up", "--client-ttl-s", "99999999999999999999"], "--client-ttl-s: client_ttl_s must be in 1..86400"),
        (["pool", "up", "--lease-ttl-ms", "1e9"], "Invalid value for '--lease-ttl-ms'"),
        (["pool", "up", "--rpc-timeout-ms", "1000000000"], "rpc_timeout_ms must be in 100..600000"),
        (["pool", "up", "--work-dir", "/dev/null"], "--work-dir /dev/null: exists and is not a directory"),
        (["pool", "up", "--state-file", "/dev"], "--state-file /dev: is a directory"),
        (["pool", "status", "--timeout-s", "nan"], "--timeout-s nan: must be a finite number of seconds > 0 and <= 600"),
        (["pool", "status", "--address", "mooncake://127.0.0.1:1?metrics=1", "--timeout-s", "1e9"], "--timeout-s 1e+09"),
        (["pool", "up", "--eviction-ratio", "1.5"], "error: --eviction-ratio: eviction_ratio must be in (0, 1]"),
        (["pool", "status", "--address", "http://x:1"], "bad pool address"),
        (["pool", "status", "--address", "127.0.0.1:1"], "has no metrics port"),
        (["pool", "status", "--address", "mooncake://127.0.0.1:1?metrics=1"], "no answer from http://127.0.0.1:1/metrics"),
        (["pool", "status", "--state-file", "/nonexistent/state.json"], "no running pool recorded"),
    ],
)
def test_user_mistakes_are_one_line_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error: ") and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_netns_problem_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
    problem = netns.netns_problem()
    assert problem and "eth0" in problem and "unshare -n sh -c 'ip link set lo up" in problem
    monkeypatch.setattr(netns.socket, "if_nameindex", lambda: [(1, "lo")])
    monkeypatch.setattr(netns, "interface_up", lambda name: False)
    assert "loopback interface is down" in (netns.netns_problem() or "")


def test_fixtures_refuse_to_start_mooncake_outside_a_private_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
    with pytest.raises(pytest.fail.Exception, match="refusing to start Mooncake processes.*unshare -n"):
        require_private_netns()


def test_mooncake_clients_and_the_launcher_refuse_public_listeners_unless_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside a private namespace ``MooncakePool`` and ``start_local_pool`` refuse before starting
    anything; ``allow_public_listeners=True`` gets past the check (here to the absent master)."""
    from kvpool.backend.pool import MooncakePool, PoolUnavailable
    from kvpool.backend.pool.launcher import free_port, start_local_pool

    monkeypatch.setattr(netns.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(netns.PublicListenersRefused, match=r"refusing to start: .*\(eth0\).*allow_public_listeners=True"):
        MooncakePool(address)
    with pytest.raises(PoolUnavailable, match="no Mooncake master answers"):
        MooncakePool(address, allow_public_listeners=True, connect_timeout_s=0.5)
    with pytest.raises(netns.PublicListenersRefused, match="allow_public_listeners=True"):
        start_local_pool(PoolSpec(services=1, bytes_per_service=64 * MIB), tmp_path / "pool")
    assert not (tmp_path / "pool").exists()


def test_check_listeners_decides_and_names_how_to_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "netns_problem", lambda *_: None)
    assert netns.check_listeners(False, "say so") is None
    monkeypatch.setattr(netns, "netns_problem", lambda *_: "eth0 is visible.")
    assert netns.check_listeners(True, "say so") == "eth0 is visible."
    with pytest.raises(netns.PublicListenersRefused) as refused:
        netns.check_listeners(False, "say so")
    assert str(refused.value) == "refusing to start: eth0 is visible. Or say so to start anyway."


def _namespace(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make this process see a network namespace of ``names`` (each up)."""
    monkeypatch.setattr(netns.socket, "if_nameindex", lambda: list(enumerate(names, start=1)))
    monkeypatch.setattr(netns, "interface_up", lambda name: name in names)


def test_a_namespace_of_lo_and_the_listen_interfaces_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    _namespace(monkeypatch, "lo", "ib0")
    assert netns.netns_problem(("ib0",)) is None
    assert "other than lo are visible (ib0)" in (netns.netns_problem() or "")
    _namespace(monkeypatch, "lo", "ib0", "eth0")
    problem = netns.netns_problem(("ib0",)) or ""
    assert "other than lo and the listen interfaces (ib0) are visible (eth0)" in problem
    assert "KVPOOL_LISTEN_INTERFACES" in problem
    assert netns.netns_problem(("ib1",)) == ("listen interface(s) 'ib1' are not in this network namespace "
                                            "(its interfaces: eth0, ib0, lo).")


def test_check_listeners_reads_the_listen_interfaces_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    _namespace(monkeypatch, "lo", "ib0", "ib1")
    monkeypatch.delenv(netns.LISTEN_ENV, raising=False)
    with pytest.raises(netns.PublicListenersRefused, match=r"\(ib0, ib1\)"):
        netns.check_listeners(False, "say so")
    monkeypatch.setenv(netns.LISTEN_ENV, " ib1, ib0,,ib1 ")
    assert netns.listen_interfaces_from_env() == ("ib1", "ib0")
    assert netns.check_listeners(False, "say so") is None
    with pytest.raises(netns.PublicListenersRefused, match=r"visible \(ib1\)"):
        netns.check_listeners(False, "say so", ["ib0"])  # an explicit list wins over the environment


def test_pool_up_with_listen_interfaces_refuses_a_namespace_holding_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvpool.backend.pool import launcher
    from kvpool.cli import main

    def must_not_start(*_a: object, **_k: object) -> None:
        raise AssertionError("pool up started a pool")

    _namespace(monkeypatch, "lo", "ib0", "wlan0")
    monkeypatch.delenv(netns.LISTEN_ENV, raising=False)
    monkeypatch.setattr(launcher, "start_local_pool", must_not_start)
    state = tmp_path / "state.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["pool", "up", "--services", "1", "--gib-per-service", "0.0625", "--state-file", str(state),
              "--listen-interface", "ib0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: refusing to start: network interfaces other than lo and the listen interfaces "
                          "(ib0) are visible (wlan0)") and "give --allow-public-listeners" in err, err
    assert not state.exists()


def test_pool_up_passes_its_listen_interfaces_to_the_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvpool.backend.pool import launcher
    from kvpool.cli import main

    seen: list[object] = []

    def record(*_a: object, **k: object) -> None:
        seen.append(k.get("listen_interfaces"))
        raise launcher.PoolStartError("not started in this test")

    _namespace(monkeypatch, "lo", "ib0")
    monkeypatch.setattr(launcher, "start_local_pool", record)
    with pytest.raises(SystemExit) as exit_info:
        main(["pool", "up", "--services", "1", "--gib-per-service", "0.0625", "--state-file", str(tmp_path / "s.json"),
              "--listen-interface", "ib0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and seen == [("ib0",)], (seen, err)
    assert err.splitlines()[0] == "note: the store services' Mooncake listeners are reachable on ib0"


def test_pool_address_round_trip_and_errors() -> None:
    a = PoolAddress("127.0.0.1", 5000, 5001)
    assert PoolAddress.parse(a.url()) == a and a.master == "127.0.0.1:5000"
    assert a.metrics_url == "http://127.0.0.1:5001"
    assert PoolAddress.parse("127.0.0.1:5000") == PoolAddress("127.0.0.1", 5000, None)
    for bad in ["127.0.0.1", "mooncake://h:1?metrics=x", "mooncake://h:1?foo=2", "mooncake://h:99999"]:
        with pytest.raises(ValueError):
            PoolAddress.parse(bad)


def test_pool_spec_validates() -> None:
    with pytest.raises(ValueError, match="services"):
        PoolSpec(services=0)
    with pytest.raises(ValueError, match="bytes_per_service"):
        PoolSpec(bytes_per_service=1000)
    assert PoolSpec(services=3, bytes_per_service=64 * MIB).capacity_bytes == 192 * MIB


def test_metrics_parser_reads_mooncake_text() -> None:
    text = """# HELP master_key_count keys
master_total_capacity_bytes 134217728
master_allocated_bytes 2097152
segment_allocated_bytes{segment="127.0.0.1:13573"} 2097152
segment_total_capacity_bytes{segment="127.0.0.1:13573"} 67108864
segment_total_capacity_bytes{segment="127.0.0.1:13043"} 67108864
master_key_count 2
master_successful_evictions_total 3
master_evicted_key_count 7
master_evicted_size_bytes 7340032
junk line
"""
    m = metrics_from_text(text)
    assert (m.capacity_bytes, m.used_bytes, m.key_count) == (134217728, 2097152, 2)
    assert (m.eviction_passes, m.evicted_key_count, m.evicted_bytes) == (3, 7, 7340032)
    assert [(s.segment, s.used_bytes) for s in m.segments] == [("127.0.0.1:13043", 0), ("127.0.0.1:13573", 2097152)]
    assert m.to_pool_stats().used_fraction == pytest.approx(2097152 / 134217728)
    with pytest.raises(MetricsUnavailable, match="master_total_capacity_bytes"):
        metrics_from_text("master_key_count 1\n")
    with pytest.raises(MetricsUnavailable, match="no answer"):
        read_master_metrics("http://127.0.0.1:1", timeout_s=1.0)


def test_pool_up_outside_a_private_namespace_refuses_without_the_flag(tmp_path: Path) -> None:
    fake = "import socket; socket.if_nameindex = lambda: [(1, 'lo'), (2, 'eth0')]"
    code = f"{fake}\nfrom kvpool.cli import main; main()"
    r = subprocess.run([sys.executable, "-c", code, "pool", "up", "--services", "1", "--gib-per-service", "0.0625",
                        "--work-dir", str(tmp_path / "pool")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: refusing to start: network interfaces other than lo are visible (eth0)")
    assert "--allow-public-listeners" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "pool").exists()


def _pool_up_in_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], state: Path,
                        *args: str) -> str:
    """Run ``pool up`` in this process up to the point where it would start the pool (which fails
    the test); return its one ``error:`` line."""
    from kvpool.backend.pool import launcher
    from kvpool.cli import main

    def must_not_start(*_a: object, **_k: object) -> None:
        raise AssertionError("pool up started a pool")

    monkeypatch.setattr(netns, "netns_problem", lambda *_: None)
    monkeypatch.setattr(launcher, "start_local_pool", must_not_start)
    with pytest.raises(SystemExit) as exit_info:
        main(["pool", "up", "--services", "1", "--gib-per-service", "0.0625", "--state-file", str(state), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: --state-file ") and len(err.strip().splitlines()) == 1, err
    return err


def test_pool_up_refuses_a_state_file_it_did_not_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    precious = tmp_path / "notes.json"
    precious.write_text("precious\n")
    err = _pool_up_in_process(monkeypatch, capsys, precious)
    assert "exists and was not written by this run" in err and "--force" in err
    assert precious.read_text() == "precious\n"
    # the record of a pool up that still runs (this process) is refused too
    live = tmp_path / "live.json"
    live.write_text(json.dumps({"address": "mooncake://127.0.0.1:1?metrics=2", "pid": os.getpid(), "work_dir": "w"}))
    err = _pool_up_in_process(monkeypatch, capsys, live)
    assert f"records the pool of process {os.getpid()}, which is still running" in err
    (tmp_path / "dir").mkdir()
    assert "is a directory" in _pool_up_in_process(monkeypatch, capsys, tmp_path / "dir")
    dangling = tmp_path / "link.json"
    dangling.symlink_to(tmp_path / "nowhere")
    assert "was not written by this run" in _pool_up_in_process(monkeypatch, capsys, dangling)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "link.json", "live.json", "notes.json"]


def _ended_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return p.pid


@pytest.mark.parametrize("before", ["stale-record", "user-file-forced"])
def test_pool_up_writes_its_state_file_and_removes_only_its_own(tmp_path: Path, before: str) -> None:
    """A record left by a pool up that has ended is replaced; a user's file only with --force. The
    file holds this run's record while it runs, and is removed on exit only if it still does."""
    require_private_netns()
    state = tmp_path / "state.json"
    if before == "stale-record":
        state.write_text(json.dumps({"address": "mooncake://127.0.0.1:1?metrics=2", "pid": _ended_pid(), "work_dir": "w"}))
    else:
        state.write_text("precious\n")
    proc, banner = start_pool_up(tmp_path, *(["--force"] if before == "user-file-forced" else []))
    try:
        record = json.loads(state.read_text())
        assert record == {"address": banner["address"], "pid": proc.pid, "work_dir": str(tmp_path / "pool")}
        assert sorted(p.name for p in tmp_path.iterdir()) == ["pool", "state.json"]  # no temporary left
        if before == "stale-record":  # someone else's file now stands there: it must survive the exit
            other = tmp_path / "other.json"
            other.write_text(json.dumps({**record, "note": "not pool up's"}))
            os.replace(other, state)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    _, stderr = proc.communicate(timeout=5)
    assert rc == 0, stderr
    if before == "stale-record":
        assert json.loads(state.read_text())["note"] == "not pool up's"
    else:
        assert not state.exists()


def test_pool_up_help_says_where_mooncake_listens() -> None:
    r = subprocess.run([*KVPOOL, "pool", "up", "--help"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0 and "0.0.0.0" in r.stdout and "--allow-public-listeners" in r.stdout
