"""Sweeps on Ray (``sim.executor``): the same numbers as in-process runs, the CLI's --executor/--address,
clean errors. One local Ray runtime serves the whole module (started through ``sim.executor.runner``,
so its loopback-only start is what is tested); the CLI tests start their own or connect to it."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trace_builders import KV_TRACES
from kvpool.scenario.load import load_scenario
from kvpool.sim import executor as ex
from kvpool.sim import plan as pl
from kvpool.sim.report import public
from kvpool.sim.run import sweep

KVPOOL = shutil.which("kvpool", path=str(Path(sys.executable).parent)) or "kvpool"
TRACE = str(KV_TRACES / "trace_0002.json.gz")
SMALL = ["--duration", "300", "--traces", TRACE, "--set", "workload.warmup_requests=1"]
TIMING = ("wall_s", "cpu_s", "sim_s_per_wall_s")


def strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def cli(*args, env=None):
    return subprocess.run([KVPOOL, *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "160", **(env or {})})


def small():
    return load_scenario("mi355x-1p1d", ["workload.duration_s=300", "workload.warmup_requests=1"])


# What this process and its children listened on before the runtime started (earlier tests of the
# same pytest run may hold listeners of their own, e.g. an in-process transfer engine).
BEFORE: dict[str, set] = {}


@pytest.fixture(scope="module")
def cluster():
    """A local runtime as ``kvpool sim run --executor ray`` starts it; yields its GCS address."""
    import ray

    pids = _descendants(os.getpid()) | {os.getpid()}
    BEFORE["pids"] = pids
    BEFORE["sockets"] = {inode for inode, _ in _listening(pids)}
    with ex.runner("ray", workers=2) as r:
        assert r.executor == "ray" and ray.is_initialized()
        yield ray.get_runtime_context().gcs_address
    assert not ray.is_initialized()  # the runner shut down what it started


@pytest.fixture(scope="module")
def in_process():
    """The in-process reference rows of loads 3 and 4."""
    return sweep(small(), [3, 4], traces=TRACE, workers=1)


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _listening(pids: set[int]) -> list[tuple[str, str]]:
    """(inode, local address) of the TCP sockets in LISTEN state that ``pids`` hold (/proc/net/tcp, tcp6)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                out.append((f[9], f[1].split(":")[0]))
    return out


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::ffff:127.0.0.1, ::1


def test_local_runtime_listens_on_loopback_only(cluster):
    import ray

    assert cluster.startswith("127.0.0.1:")
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    assert ray.cluster_resources()["CPU"] == 2  # workers=2
    # the runtime's sockets: new ones of this process (the driver) and those of its new children
    pids = (_descendants(os.getpid()) - BEFORE["pids"]) | {os.getpid()}
    addrs = [a for inode, a in _listening(pids) if inode not in BEFORE["sockets"]]
    assert addrs and set(addrs) <= LOOPBACK, addrs


def test_ray_sweep_equals_in_process(cluster, in_process):
    done = []
    on_ray = sweep(small(), [3, 4], traces=TRACE, executor="ray", on_done=lambda load, r: done.append(load))
    assert sorted(done) == [3.0, 4.0]  # the progress callback fires once per finished load
    assert [r["sessions"] for r in on_ray] == [3, 4]
    assert strip(on_ray) == strip(in_process)


def test_plan_search_on_ray_equals_in_process(cluster):
    base = load_scenario("mi355x-1p1d", ["workload.duration_s=300", "workload.warmup_requests=1",
                                         "prefill.gpu_mem_utilization=0.472"])
    variable = pl.parse_vary("pool.gib_per_service=0..768", base)
    targets = [pl.parse_target("reuse>=0.9")]
    runs = {}
    for executor in ("local", "ray"):
        seen = []
        res = pl.search(base, variable, targets, load=3, traces=TRACE, workers=2, max_runs=5, executor=executor,
                        on_run=lambda v, _row, ok: seen.append(v))
        assert sorted(seen) == sorted(v for v, _, _ in res.explored)  # on_run once per point
        runs[executor] = (res.best, [(v, ok, {k: x for k, x in row.items() if k not in TIMING}) for v, row, ok in res.curve()])
    assert runs["ray"] == runs["local"]


def test_cli_run_starts_and_stops_its_own_local_runtime(tmp_path, in_process):
    t0 = time.perf_counter()
    r = cli("sim", "run", "mi355x-1p1d", "--sessions", "3,4", *SMALL, "--executor", "ray", "--workers", "2",
            "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "8.8.8.8" not in r.stderr, r.stderr
    rows = json.loads(r.stdout)["results"]
    assert strip(rows) == strip([public(x) for x in in_process])
    print(f"sim run --executor ray (local runtime): {time.perf_counter() - t0:.1f} s")


def test_cli_compare_and_plan_on_an_existing_cluster(tmp_path, cluster, in_process):
    no_pool = load_scenario("mi355x-1p1d", ["workload.duration_s=300", "workload.warmup_requests=1", "pool.gib_per_service=0"])
    path = tmp_path / "no-pool.toml"
    path.write_text(cli("scenario", "show", "mi355x-1p1d", "--toml", "--set", "pool.gib_per_service=0").stdout
                    .replace('name = "mi355x-1p1d"', 'name = "no-pool"'))
    r = cli("sim", "compare", "mi355x-1p1d", str(path), "--sessions", "3,4", *SMALL, "--executor", "ray",
            "--address", cluster, "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    arms = {k: strip(v) for k, v in json.loads(r.stdout)["arms"].items()}
    assert arms["mi355x-1p1d"] == strip([public(x) for x in in_process])
    reference = strip(public(x) for x in sweep(no_pool, [3, 4], traces=TRACE, workers=1))
    assert [{**x, "scenario": "no-pool"} for x in reference] == arms["no-pool"]
    assert arms["no-pool"][0]["share_pool"] == 0.0

    r = cli("sim", "plan", "mi355x-1p1d", "--target", "reuse>=0.9", "--vary", "pool.gib_per_service=0..768",
            "--load", "3", *SMALL, "--set", "prefill.gpu_mem_utilization=0.472", "--workers", "2", "--max-runs", "4",
            "--executor", "ray", "--address", cluster, "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["runs"] == len(res["curve"]) == 4 and res["best"] is not None


def test_bad_executor_address_and_missing_ray_are_one_line(tmp_path):
    base = ["sim", "run", "mi355x-1p1d", "--sessions", "3", *SMALL, "--out", str(tmp_path)]
    cases = [
        (["--executor", "dask"], "--executor 'dask': allowed: local, ray"),
        (["--address", "127.0.0.1:6379"], "--address '127.0.0.1:6379' needs --executor ray"),
        (["--executor", "ray", "--address", "127.0.0.1:1"], "cannot reach a Ray cluster at 127.0.0.1:1"),
    ]
    for args, needle in cases:
        t0 = time.perf_counter()
        r = cli(*base, *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert time.perf_counter() - t0 < 30, args  # no Ray retry loop
    for cmd in (["sim", "compare", "mi355x-1p1d", "h200-1p1d"], ["sim", "plan", "mi355x-1p1d", "--target", "reuse>=0.9",
                                                                 "--vary", "pool.gib_per_service=0..768"]):
        r = cli(*cmd, "--executor", "ray", "--address", "127.0.0.1:1", "--out", str(tmp_path))
        assert r.returncode == 2 and "cannot reach a Ray cluster at 127.0.0.1:1" in r.stderr, (cmd, r.stderr)
    # Ray missing: the same one line, naming the extra that installs it
    hide = ("import importlib.util as u, sys; f = u.find_spec; "
            "u.find_spec = lambda n, *a: None if n == 'ray' else f(n, *a); "
            "from kvpool.cli import main; sys.argv[0] = 'kvpool'; main()")
    r = subprocess.run([sys.executable, "-c", hide, *base, "--executor", "ray"], capture_output=True, text=True)
    assert r.returncode == 2 and "needs Ray, which is not installed: pip install 'kvpool[ray]'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_address_forms():
    assert ex._host_port("ray://10.0.0.5:10001") == ("10.0.0.5", 10001)
    assert ex._host_port("head") == ("head", ex.RAY_PORT)
    assert ex._host_port("[::1]:6380") == ("::1", 6380)
    assert ex._host_port("auto") is None
    with pytest.raises(ex.ExecutorError, match="port 'x' is not a number"):
        ex._host_port("127.0.0.1:x")


def test_unanswered_address_gives_up_within_the_timeout():
    import socket

    with socket.socket() as s:  # listening with a full backlog and never accepting: connects hang
        s.bind(("127.0.0.1", 0))
        s.listen(0)
        port = s.getsockname()[1]
        fillers = []
        try:
            for _ in range(4):
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex(("127.0.0.1", port))
                fillers.append(c)
            t0 = time.perf_counter()
            try:
                ex.probe(f"127.0.0.1:{port}", timeout_s=1.0)
            except ex.ExecutorError as e:
                assert "within 1 s" in str(e) or "cannot reach" in str(e)
            else:
                pytest.fail("probe accepted a port that never answers")
            assert time.perf_counter() - t0 < 5
        finally:
            for c in fillers:
                c.close()
