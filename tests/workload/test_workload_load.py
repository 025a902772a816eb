"""Loaders: every layout, and bad input named by file, trace id and request."""

from __future__ import annotations

import gzip
import json

import pytest
from trace_builders import CORPUS_MOONCAKE, MOONCAKE, needs_corpus, req, spawn_join_trace, trace, write

from kvpool.workload import TraceError, load_workload


def _ids(w):
    return sorted(s.id for s in w)


def test_single_file_gz_directory_and_jsonl(tmp_path):
    a, b = spawn_join_trace(), trace("plain", [req(0.0, 100), req(5.0, 200)])
    d = tmp_path / "dir"
    d.mkdir()
    write(d / "a.json", a)
    write(d / "b.json.gz", b, gz=True)
    assert _ids(load_workload(d / "a.json")) == ["tj"]
    assert _ids(load_workload(d / "b.json.gz")) == ["plain"]
    assert _ids(load_workload(d)) == ["plain", "tj"]
    jl = tmp_path / "traces.jsonl"
    jl.write_text(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    w = load_workload(jl)
    assert _ids(w) == ["plain", "tj"]
    assert w.by_id("tj").requests == load_workload(d / "a.json").by_id("tj").requests


def test_fast_and_plain_json_paths_agree(tmp_path):
    doc = spawn_join_trace()
    compact = write(tmp_path / "c.json", doc)
    spaced = tmp_path / "s.json"
    spaced.write_text(json.dumps(doc, indent=3))
    x, y = load_workload(compact).sessions[0], load_workload(spaced).sessions[0]
    assert x.requests == y.requests
    assert all((x.block_ids(i) == y.block_ids(i)).all() for i in range(len(x.requests)))


def test_mooncake_jsonl_rows_share_one_global_timeline():
    w = load_workload(MOONCAKE / "synthetic_trace.jsonl")
    assert len(w) == 3993
    s = w.sessions[0]
    assert s.hash_scope == "global" and s.block_tokens == 512
    ts = [x.requests[0].t_s for x in w]
    assert ts == sorted(ts) and ts[-1] == pytest.approx(1022, abs=1)


def _error(path, **kw) -> TraceError:
    with pytest.raises(TraceError) as e:
        load_workload(path, **kw)
    return e.value


@pytest.mark.parametrize(
    ("mutate", "where", "words"),
    [
        (lambda d: d["requests"][1].pop("in"), "requests[1]", "field 'in' is missing"),
        (lambda d: d["requests"][0].update(t=-1.0), "requests[0]", "'t' must be a number >= 0"),
        (lambda d: d["requests"][3].update(t=5.0), "requests[3]", "t decreases"),
        (lambda d: d["requests"][2]["requests"][1].update(hash_ids=[10]), "requests[2].requests[1]", "hash_ids has 1 blocks"),
        (lambda d: d["requests"][5].update(hash_ids=[1, 2, 3, "x", 5]), "requests[5]", "non-negative integers"),
        (lambda d: d["requests"][5].update(hash_ids=[1, 2, 3, -4, 5]), "requests[5]", "non-negative"),
        (lambda d: d["requests"][1].update(out=2.5), "requests[1]", "'out' must be an integer"),
    ],
)
def test_malformed_requests_name_file_trace_and_request(tmp_path, mutate, where, words):
    doc = spawn_join_trace()
    mutate(doc)
    f = write(tmp_path / "bad.json", doc)
    e = _error(f)
    assert (e.file, e.trace_id, e.request) == (str(f), "tj", where)
    assert words in e.message
    assert str(f) in str(e) and "trace tj" in str(e) and where in str(e)


def test_truncated_gzip_and_wrong_json(tmp_path):
    raw = gzip.compress(json.dumps(spawn_join_trace()).encode())
    f = tmp_path / "t.json.gz"
    f.write_bytes(raw[: len(raw) // 2])
    e = _error(f)
    assert e.file == str(f) and "truncated or corrupt gzip" in e.message
    g = tmp_path / "w.json"
    g.write_text('{"id": "x", "requests": [')
    assert "invalid JSON" in _error(g).message
    jl = tmp_path / "t.jsonl"
    jl.write_text(json.dumps(spawn_join_trace()) + "\n{oops\n")
    e = _error(jl)
    assert e.request == "line 2" and "invalid JSON" in e.message


def test_missing_trace_fields(tmp_path):
    doc = spawn_join_trace()
    del doc["block_size"]
    e = _error(write(tmp_path / "x.json", doc))
    assert e.trace_id == "tj" and "block_size" in e.message


def test_skip_bad_loads_the_rest_and_reports_what_was_skipped(tmp_path):
    good = write(tmp_path / "a.json", spawn_join_trace())
    bad_doc = trace("broken", [req(0.0, 128, [1, 2]), req(1.0, 128, [1])])
    write(tmp_path / "b.json", bad_doc)
    (tmp_path / "c.json.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    w = load_workload(tmp_path, skip_bad=True)
    assert _ids(w) == ["tj"]
    assert [(x.trace_id, x.request) for x in w.skipped] == [("broken", "requests[1]"), (None, None)]
    assert w.skipped[1].file.endswith("c.json.gz")
    assert good.exists()


def test_mooncake_bad_row_names_the_line(tmp_path):
    f = tmp_path / "m.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 10, "input_length": 1100, "output_length": 5, "hash_ids": [0]},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    e = _error(f)
    assert e.request == "line 2" and "hash_ids has 1 blocks" in e.message


@needs_corpus(CORPUS_MOONCAKE / "conversation_trace.jsonl")
def test_mooncake_conversation_block_reuse_matches_the_reference():
    from kvpool.workload import workload_stats

    st = workload_stats(load_workload(CORPUS_MOONCAKE / "conversation_trace.jsonl"))
    assert st["requests"] == 12031 and st["input_tokens_all_p50"] == 6909
    assert st["reuse_ceiling"] == pytest.approx(1 - 182_790 / 288_500, abs=1e-4)  # 36.6 %
