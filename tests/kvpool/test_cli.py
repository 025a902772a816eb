"""The kvpool CLI front door, run as a real subprocess (the installed console script)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

KVPOOL = shutil.which("kvpool", path=str(Path(sys.executable).parent)) or "kvpool"


def run(*args, check=False):
    return subprocess.run([KVPOOL, *args], capture_output=True, text=True, check=check,
                          env={**os.environ, "COLUMNS": "120"})


def test_help_lists_every_group():
    out = run("--help", check=True).stdout
    for group in ("scenario", "trace", "sim", "pool", "serve", "dashboard"):
        assert group in out


@pytest.mark.parametrize("group", ["scenario", "trace", "sim", "pool", "serve", "dashboard"])
def test_every_group_has_help(group):
    r = run(group, "--help")
    assert r.returncode == 0 and "Usage: kvpool " + group in r.stdout


def test_show_json_has_the_documented_keys():
    d = json.loads(run("scenario", "show", "mi355x-1p1d", "--json", check=True).stdout)
    for key in ("kv_bytes_per_token", "pool_capacity_bytes", "pool_capacity_tokens",
                "prefill_gpu_kv_capacity_tokens", "handoff_writes_naive", "handoff_writes_batched"):
        assert key in d
    assert d["kv_bytes_per_token"] == 48_672
    assert d["pool_capacity_bytes"] == 1.5 * (1 << 40)
    assert (d["handoff_writes_naive"], d["handoff_writes_batched"]) == (163_840, 12)
    assert d["scenario"]["name"] == "mi355x-1p1d"


def test_show_text_and_set():
    out = run("scenario", "show", "mi355x-1p1d", "--set", "pool.gib_per_service=384", check=True).stdout
    assert "48,672" in out and "768.00 GiB" in out and "163,840 naive writes vs 12 writes" in out
    head = out.splitlines()[0]
    assert head == "mi355x-1p1d with --set pool.gib_per_service=384"  # the header shows the override
    assert "2 x 384 GiB per server" in out and "description as written, before those overrides" in out


@pytest.mark.parametrize("command", ["dashboard", "serve"])
def test_commands_without_sub_commands_show_none(command):
    r = run(command, "--help")
    assert r.returncode == 0 and r.stdout.startswith(f"Usage: kvpool {command} [OPTIONS]")
    assert "COMMAND" not in r.stdout


def test_help_texts_show_brackets_as_written():
    out = run("sim", "compare", "--help", check=True).stdout
    assert "arms: {NAME: [results]}" in " ".join(out.split())


def test_units_of_plan_variables():
    from kvpool.cli.sim import unit_of, with_unit

    assert with_unit("pool.gib_per_service", 350.815) == "350.815 GiB"
    assert [unit_of(f) for f in ("workload.sessions", "workload.rps", "workload.duration_s", "ttft_p90_s",
                                 "throughput_per_gpu_tok_s", "reuse")] == ["sessions", "requests/s", "s", "s", "tok/s", ""]


def test_validate_ok_and_broken_file(tmp_path):
    assert run("scenario", "validate", "mi350x-6p2d-split", check=True).stdout.strip() == "ok: mi350x-6p2d-split"
    bad = tmp_path / "bad.toml"
    text = run("scenario", "show", "mi355x-1p1d", "--toml", check=True).stdout
    bad.write_text(text.replace("gib_per_service = 768.0", "gib_per_service = -5"))
    r = run("scenario", "validate", str(bad))
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: {bad}: pool.gib_per_service: value -5: "
                                "Input should be greater than or equal to 0 (DRAM each service contributes, GiB; "
                                "allowed: a finite number, >= 0 and <= 65536)")
    assert "Traceback" not in r.stderr


def test_bad_set_is_one_clear_line():
    r = run("scenario", "show", "mi355x-1p1d", "--set", "pool.nope=1")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: --set 'pool.nope=1': pool has no field 'nope'")


def test_list():
    assert "mi355x-1p1d" in run("scenario", "list", check=True).stdout


def test_version():
    assert run("--version", check=True).stdout.startswith("kvpool ")
