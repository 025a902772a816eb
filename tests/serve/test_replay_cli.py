"""``kvpool replay`` against a stand-in server: its outputs (JSONL records, the summary with the
keys of ``kvpool sim run --json``), its ``error:`` lines for bad input, and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

from kvpool.cli import main
from kvpool.workload.records import SUMMARY_KEYS, RequestRecord

sys.path.insert(0, str(Path(__file__).parent))
from replay_standin import StandIn, serving  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "tests" / "data" / "traces" / "kv-cache-tester"
FAST = ["--set", "workload.idle_cap_s=0.01", "--token-scale", "1/64"]


def _kvpool(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def _outputs(out_dir: Path) -> tuple[list[dict], dict]:
    jsonl = list(out_dir.glob("replay-*.jsonl"))
    js = list(out_dir.glob("replay-*.json"))
    assert len(jsonl) == len(js) == 1
    lines = [json.loads(x) for x in jsonl[0].read_text().splitlines()]
    return lines, json.loads(js[0].read_text())


def test_an_agentx_replay_writes_records_and_the_simulators_summary(tmp_path, capsys):
    standin = StandIn(delay_s=0.002, fault=lambda n: "http500" if n in (4, 9) else None)
    with serving(standin) as url:
        code, out, err = _kvpool(["replay", "cpu-tiny", "--url", url, "--traces", str(TRACES), "--sessions", "2",
                                  "--duration", "1.5", *FAST, "--out", str(tmp_path), "--json"], capsys)
    assert code == 0, err
    lines, doc = _outputs(tmp_path)
    assert json.loads(out) == doc
    result = doc["results"][0]
    assert set(SUMMARY_KEYS) - {"rps"} <= set(result)
    assert result["sessions"] == 2 and result["duration_s"] == 1.5 and result["gpus"] == 4
    assert result["errors"] == 2 == doc["run"]["errors"]
    assert result["requests"] > 5 and 0 < result["share_gpu"] < 1 and result["share_computed"] > 0
    assert doc["provenance"]["serve"] == {"url": url, "token_scale": 1 / 64}
    record_keys = {f.name for f in fields(RequestRecord)} | {"ttft_s", "error"}
    assert all(set(line) == record_keys for line in lines)
    assert [line["key"] for line in lines] == list(range(len(lines))) and len(lines) == doc["run"]["dispatched"]
    assert sum(1 for line in lines if line["error"].startswith("HTTP 500")) == 2
    assert len(lines) == len(standin.requests)
    assert "2 of" in err and "requests failed" in err


def test_a_production_replay_prints_its_table(tmp_path, capsys):
    with serving(StandIn(delay_s=0.002)) as url:
        code, out, err = _kvpool(["replay", "cpu-tiny", "--url", url, "--traces", str(TRACES), "--rps", "20",
                                  "--duration", "1", "--set", "workload.lanes=4", *FAST, "--out", str(tmp_path)], capsys)
    assert code == 0, err
    lines, doc = _outputs(tmp_path)
    assert doc["results"][0]["rps"] == 20.0 and "sessions" not in doc["results"][0]
    assert set(SUMMARY_KEYS) - {"sessions"} <= set(doc["results"][0])
    assert 5 < len(lines) < 60 and {line["measured"] for line in lines} == {True, False}
    assert "rps" in out and "wrote" in err


@pytest.mark.parametrize("args, expect", [
    (["--url", "localhost:8000"], "--url 'localhost:8000': expected http://HOST:PORT"),
    (["--url", "http://127.0.0.1:1"], "--url http://127.0.0.1:1: cannot reach"),
    (["--traces", "/nonexistent/traces"], "--traces /nonexistent/traces: no such file or directory"),
    (["--token-scale", "0"], "--token-scale '0': must be a number or fraction > 0 and <= 1"),
    (["--token-scale", "1/0"], "--token-scale '1/0'"),
    (["--sessions", "0"], "--sessions 0"),
    (["--sessions", "2", "--rps", "1"], "give --sessions (AgentX lanes) or --rps"),
    (["--timeout", "-1"], "--timeout -1"),
])
def test_bad_input_is_one_error_line(tmp_path, capsys, args, expect):
    base = {"--url": "http://127.0.0.1:1", "--traces": str(TRACES)}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["replay", "cpu-tiny", "--out", str(tmp_path)] + [x for kv in base.items() for x in kv]
    code, out, err = _kvpool(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], err
    assert not list(tmp_path.glob("replay-*"))


def test_bad_traces_are_one_error_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = _kvpool(["replay", "cpu-tiny", "--url", "http://127.0.0.1:1", "--traces", str(bad),
                            "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {bad}: invalid JSON")


def test_ctrl_c_stops_and_writes_what_it_has(tmp_path):
    # the first 10 requests are answered; the later ones get no answer, so at Ctrl-C one is in flight
    standin = StandIn(delay_s=0.2, fault=lambda n: "hang" if n >= 10 else None, hang_s=120.0)
    kvpool = Path(sys.executable).parent / "kvpool"
    with serving(standin) as url:
        proc = subprocess.Popen([str(kvpool), "replay", "cpu-tiny", "--url", url, "--traces", str(TRACES),
                                 "--sessions", "3", "--duration", "600", *FAST, "--out", str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "COLUMNS": "100"})
        try:
            deadline = time.monotonic() + 60
            while len(standin.requests) < 11 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            assert len(standin.requests) >= 11
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    lines, doc = _outputs(tmp_path)
    assert doc["run"]["interrupted"] is True and doc["run"]["cancelled"] >= 1
    assert sum(1 for line in lines if line["error"] == "cancelled: interrupted") == doc["run"]["cancelled"]
    assert sum(1 for line in lines if not line["error"]) >= 3
