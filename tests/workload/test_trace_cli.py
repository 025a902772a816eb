"""``kvpool trace``: stats, synth, convert, and user errors without tracebacks."""

from __future__ import annotations

import json

import pytest
from trace_builders import KV_TRACES, MOONCAKE, req, spawn_join_trace, trace, write

from kvpool.cli import main
from kvpool.workload import load_workload, workload_stats
from kvpool.workload.synth import synthetic_workload


def _run(capsys, *argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out = capsys.readouterr()
    return e.value.code or 0, out.out, out.err


def test_stats_json_has_the_documented_keys(tmp_path, capsys):
    write(tmp_path / "a.json", spawn_join_trace())
    code, out, _ = _run(capsys, "trace", "stats", str(tmp_path), "--json")
    st = json.loads(out)
    assert code == 0
    for key in ("traces", "requests", "subagent_groups", "sessions_with_subagents_fraction", "input_tokens_all_p50",
                "input_tokens_main_p50", "input_tokens_sub_p50", "input_tokens_main_p90", "output_tokens_main_p50",
                "new_tokens_p50", "main_turns_per_session_p50", "pause_over_300s_fraction", "peak_context_p50",
                "reuse_ceiling"):  # fmt: skip
        assert key in st
    assert (st["traces"], st["requests"], st["subagent_groups"]) == (1, 7, 2)


def test_stats_table(tmp_path, capsys):
    write(tmp_path / "a.json", spawn_join_trace())
    code, out, _ = _run(capsys, "trace", "stats", str(tmp_path / "a.json"))
    assert code == 0 and "reuse_ceiling" in out
    st = workload_stats(load_workload(tmp_path / "a.json"))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines() if line.count("│") == 3}
    assert rows["subagent_requests_per_group_p50"] == f"{st['subagent_requests_per_group_p50']:.1f}" == "1.5"
    for key in ("traces", "requests", "subagent_groups", "subagent_groups_per_session_p50", "main_turns_per_session_p50"):
        assert float(st[key]).is_integer() and rows[key] == f"{int(st[key]):,}", (key, rows[key])  # a count: "3", not "3.0000"
    assert rows["reuse_ceiling"] == f"{st['reuse_ceiling']:.1%}"


def test_bad_trace_is_one_error_line_and_skip_bad_reports(tmp_path, capsys):
    doc = spawn_join_trace()
    del doc["requests"][3]["hash_ids"]
    write(tmp_path / "bad.json", doc)
    code, _, err = _run(capsys, "trace", "stats", str(tmp_path / "bad.json"))
    assert code == 2
    assert err.strip() == f"error: {tmp_path / 'bad.json'}: trace tj: requests[3]: field 'hash_ids' is missing"
    write(tmp_path / "good.json", {**spawn_join_trace(), "id": "ok"})
    code, out, err = _run(capsys, "trace", "stats", str(tmp_path), "--json", "--skip-bad")
    assert code == 0 and json.loads(out)["traces"] == 1
    assert "skipped:" in err and "requests[3]" in err


def test_synth_is_deterministic_and_readable(tmp_path, capsys):
    for name in ("a", "b"):
        code, _, _ = _run(capsys, "trace", "synth", "--preset", "kv-cache-tester", "--sessions", "3", "--seed", "5",
                          "--out", str(tmp_path / f"{name}.jsonl"))  # fmt: skip
        assert code == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    code, _, _ = _run(capsys, "trace", "synth", "--preset", "kv-cache-tester", "--sessions", "3", "--seed", "5",
                      "--out", str(tmp_path / "dir"))  # fmt: skip
    w1, w2 = load_workload(tmp_path / "a.jsonl"), load_workload(tmp_path / "dir")
    assert [s.requests for s in w1] == [s.requests for s in w2]
    code, _, err = _run(capsys, "trace", "synth", "--preset", "nope", "--sessions", "1", "--out", str(tmp_path / "x.jsonl"))
    assert code == 2 and "unknown preset 'nope'" in err
    # --context-scale: the simulator's workload.context_scale sessions, in a file
    code, _, _ = _run(capsys, "trace", "synth", "--preset", "kv-cache-tester", "--sessions", "3", "--seed", "5",
                      "--context-scale", "0.5", "--out", str(tmp_path / "half.jsonl"))  # fmt: skip
    assert code == 0
    half = load_workload(tmp_path / "half.jsonl")
    want = synthetic_workload("kv-cache-tester", 3, 5, context_scale=0.5)
    assert [s.requests for s in half] == [s.requests for s in want]
    assert [s.requests[0].in_tokens for s in half] != [s.requests[0].in_tokens for s in w1]
    code, _, err = _run(capsys, "trace", "synth", "--preset", "kv-cache-tester", "--sessions", "1",
                        "--context-scale", "0", "--out", str(tmp_path / "z.jsonl"))  # fmt: skip
    assert code == 2 and "--context-scale 0: must be > 0" in err


def test_convert_weka_to_mooncake_keeps_reuse_and_mooncake_roundtrips(tmp_path, capsys):
    write(tmp_path / "a.json", spawn_join_trace())
    code, _, _ = _run(capsys, "trace", "convert", str(tmp_path / "a.json"), "--to", "mooncake", "--out", str(tmp_path / "m.jsonl"))
    assert code == 0
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(rows) == 7 and all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)
    src = MOONCAKE / "synthetic_trace.jsonl"
    code, _, _ = _run(capsys, "trace", "convert", str(src), "--to", "weka", "--out", str(tmp_path / "w.jsonl"))
    assert code == 0
    code, _, _ = _run(capsys, "trace", "convert", str(tmp_path / "w.jsonl"), "--to", "mooncake", "--out", str(tmp_path / "back.jsonl"))
    assert code == 0
    orig = [json.loads(x) for x in src.read_text().splitlines()]
    back = [json.loads(x) for x in (tmp_path / "back.jsonl").read_text().splitlines()]
    assert back == orig
    st = workload_stats(load_workload(tmp_path / "w.jsonl"))
    assert st["reuse_ceiling"] == pytest.approx(0.640, abs=0.0005)  # the reference's 64.0 % block reuse


def _block_sizes(rows: list[dict], block: int = 512) -> dict[int, set[int]]:
    """hash id -> the token counts it stands for (a prompt's last id covers what its blocks leave)."""
    sizes: dict[int, set[int]] = {}
    for r in rows:
        m, n = len(r["hash_ids"]), r["input_length"]
        last = n - (m - 1) * block if m * block > n else block
        for i, h in enumerate(r["hash_ids"]):
            sizes.setdefault(h, set()).add(last if i == m - 1 else block)
    return sizes


def test_convert_to_mooncake_gives_each_hash_id_one_block_size(tmp_path, capsys):
    # two prompts with the same 64-token ids whose last 512-token blocks hold 88 and 108 tokens
    write(tmp_path / "p.json", trace("pp", [req(0.0, 600, list(range(1, 11))), req(10.0, 620, list(range(1, 11)))]))
    code, _, _ = _run(capsys, "trace", "convert", str(tmp_path / "p.json"), "--to", "mooncake", "--out", str(tmp_path / "m.jsonl"))
    assert code == 0
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["hash_ids"][0] for r in rows] == [0, 0]  # the full first block is still shared
    assert rows[0]["hash_ids"][1] != rows[1]["hash_ids"][1]
    assert all(len(s) == 1 for s in _block_sizes(rows).values())
    code, _, _ = _run(capsys, "trace", "convert", str(KV_TRACES), "--to", "mooncake", "--out", str(tmp_path / "kv.jsonl"))
    assert code == 0
    kv = [json.loads(x) for x in (tmp_path / "kv.jsonl").read_text().splitlines()]
    assert len(kv) > 100 and all(len(s) == 1 for s in _block_sizes(kv).values())
