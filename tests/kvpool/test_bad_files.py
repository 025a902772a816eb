"""Bad files given to every command that reads one: trace files (gzip bombs, truncated or corrupt
gzip, text that is not UTF-8, a JSON key given twice, deep nesting, times past any trace), scenario
files (not UTF-8, a key or table given twice, deep nesting), file names with control characters,
pool state files, synthetic workload cache entries, and damaged copies of good files (cut, a byte
flipped, bytes inserted). Each ends in exit status 2 with ``error:`` lines naming the file and what
is wrong (one line; a scenario: one per problem), and nothing written; a byte-order mark and CRLF
line ends are read as the text they frame."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fuzz_inputs import PROFILE, assert_clean, cli

from kvpool.workload import load as trace_load

SCENARIO = "mi355x-1p1d"
SMALL_RUN = ("--sessions", "1", "--duration", "20", "--set", "workload.synthetic_sessions=2")


def _trace(tid: str = "t1") -> dict:
    req = {"t": 0, "type": "n", "in": 64, "out": 8, "hash_ids": [1, 2, 3, 4]}
    return {"id": tid, "block_size": 16, "requests": [req, {**req, "t": 5}]}


def _bomb(inflated_bytes: int) -> bytes:
    """A gzip file of ``inflated_bytes`` spaces (about 1000 times smaller)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    piece = b" " * (1 << 20)
    return b"".join([z.compress(piece) for _ in range(inflated_bytes >> 20)] + [z.flush()])


@pytest.fixture(scope="module")
def bad_traces(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (file, what its error line says)."""
    d = tmp_path_factory.mktemp("bad-traces")
    text = json.dumps(_trace())
    gz = gzip.compress(text.encode())
    bomb = _bomb(trace_load.MIN_INFLATED_BOUND_BYTES + (16 << 20))
    crc = bytearray(gz)
    crc[-6] ^= 0xFF
    files = {
        "bomb.json.gz": (bomb, "inflates past 64 MiB after gzip; allowed: 200 times its"),
        "bomb.jsonl.gz": (bomb, "(a gzip bomb is not a trace)"),
        "truncated.json.gz": (gz[: len(gz) // 2], "truncated or corrupt gzip file"),
        "crc.json.gz": (bytes(crc), "truncated or corrupt gzip file (CRC check failed"),
        "latin1.json": (text.replace('"t1"', '"t\xff1"').encode("latin-1"), "not UTF-8 text (byte 0xff at offset 9)"),
        "latin1.jsonl": (text.replace('"t1"', '"t\xff1"').encode("latin-1") + b"\n",
                         "line 1: not UTF-8 text (byte 0xff at offset 9)"),
        "dup-id.json": ((text[:-1] + ', "id": "t9"}').encode(), "key 'id' given twice in one JSON object"),
        "dup-in.jsonl": ((text.replace('"in": 64', '"in": 64, "in": 7', 1) + "\n").encode(),
                         "line 1: key 'in' given twice in one JSON object"),
        "dup-mooncake.jsonl": (b'{"timestamp": 0, "input_length": 1024, "input_length": 9, "output_length": 16, '
                               b'"hash_ids": [1, 2]}\n', "line 1: key 'input_length' given twice"),
        "deep.json": (("[" * 50_000 + "]" * 50_000).encode(), "JSON nested too deeply"),
        "deep.jsonl": (('{"a":' * 50_000 + "1" + "}" * 50_000 + "\n").encode(), "line 1: JSON nested too deeply"),
    }
    out = {}
    for name, (data, needle) in files.items():
        (d / name).write_bytes(data)
        out[name] = (d / name, needle)
    return out


BAD_TRACES = ["bomb.json.gz", "bomb.jsonl.gz", "truncated.json.gz", "crc.json.gz", "latin1.json", "latin1.jsonl",
              "dup-id.json", "dup-in.jsonl", "dup-mooncake.jsonl", "deep.json", "deep.jsonl"]


def _one_error(result, *needles: str) -> str:
    assert_clean(result, needles[:1])
    code, _, err, _ = result
    assert code == 2, err
    line = next(x for x in err.splitlines() if x.startswith("error:"))
    assert all(n in line for n in needles), (needles, line)
    return line


def test_the_inflated_bound_follows_the_size_on_disk():
    mib = 1 << 20
    assert trace_load.inflated_bound_bytes(1000) == 64 * mib
    assert trace_load.inflated_bound_bytes(mib) == 200 * mib
    assert trace_load.inflated_bound_bytes(1 << 30) == 4 << 30


@pytest.mark.parametrize("name", BAD_TRACES)
def test_trace_stats_of_a_bad_file_is_one_error_naming_it(bad_traces, name):
    path, needle = bad_traces[name]
    line = _one_error(cli("trace", "stats", str(path), "--json"), str(path), needle)
    assert line.startswith(f"error: {path}: ")


@pytest.mark.parametrize("name", ["bomb.json.gz", "truncated.json.gz", "latin1.jsonl", "dup-id.json", "deep.json"])
def test_trace_convert_of_a_bad_file_writes_nothing(bad_traces, tmp_path, name):
    path, needle = bad_traces[name]
    out = tmp_path / "new" / "converted.jsonl"
    _one_error(cli("trace", "convert", str(path), "--to", "mooncake", "--out", str(out)), str(path), needle)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("how", ["--traces", "workload.traces"])
@pytest.mark.parametrize("name", ["bomb.jsonl.gz", "crc.json.gz", "latin1.json", "dup-in.jsonl", "deep.jsonl"])
def test_sim_run_on_a_bad_trace_file_writes_nothing(bad_traces, tmp_path, name, how):
    path, needle = bad_traces[name]
    out = tmp_path / "out"
    given = ("--traces", str(path)) if how == "--traces" else ("--set", f"workload.traces={json.dumps(str(path))}")
    _one_error(cli("sim", "run", SCENARIO, *SMALL_RUN, *given, "--out", str(out), "--json"), str(path), needle)
    assert not out.exists()


def test_sim_compare_and_plan_on_a_bad_trace_file_write_nothing(bad_traces, tmp_path):
    path, needle = bad_traces["dup-id.json"]
    out = tmp_path / "out"
    _one_error(cli("sim", "compare", SCENARIO, "h200-1p1d", "--sessions", "1", "--duration", "20",
                   "--traces", str(path), "--out", str(out), "--json"), str(path), needle)
    _one_error(cli("sim", "plan", SCENARIO, "--target", "reuse>=0.5", "--vary", "pool.gib_per_service=64..768",
                   "--duration", "20", "--traces", str(path), "--out", str(out), "--json"), str(path), needle)
    assert not out.exists()


def test_a_gzip_bomb_stops_at_the_bound_without_inflating_it_all(tmp_path):
    """300 gzip members of 1 MiB of spaces each (a 300 KiB file of 300 MiB): memory stays near the bound."""
    import tracemalloc

    member = gzip.compress(b" " * (1 << 20), 9)
    path = tmp_path / "members.json.gz"
    path.write_bytes(member * 300)
    assert path.stat().st_size < 400 << 10
    tracemalloc.start()
    try:
        with pytest.raises(trace_load.TraceError) as e:
            trace_load.load_workload(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert e.value.file == str(path) and "inflates past 64 MiB" in e.value.message
    assert peak < (64 + 32) << 20, peak  # the bound and one piece, never the 300 MiB


def test_a_byte_order_mark_and_crlf_line_ends_read_as_the_plain_file(tmp_path):
    plain = json.dumps(_trace()).encode()
    two = plain + b"\n" + json.dumps(_trace("t2")).encode() + b"\n"
    files = {"plain.json": plain, "bom.json": b"\xef\xbb\xbf" + plain, "plain.jsonl": two,
             "bom-crlf.jsonl": b"\xef\xbb\xbf" + two.replace(b"\n", b"\r\n")}
    stats = {}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        code, out, err, _ = cli("trace", "stats", str(tmp_path / name), "--json")
        assert code == 0, err
        stats[name] = json.loads(out)
    assert stats["bom.json"] == stats["plain.json"] and stats["bom-crlf.jsonl"] == stats["plain.jsonl"]
    assert stats["plain.jsonl"] != stats["plain.json"]


# -- scenario files -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_toml() -> str:
    code, text, err, _ = cli("scenario", "show", SCENARIO, "--toml")
    assert code == 0, err
    return text


def _bad_scenarios(base: str) -> dict[str, tuple[bytes, str]]:
    assert "[pool]\n" in base and 'description = "' in base
    return {
        "latin1.toml": (base.replace('description = "', 'description = "\xff', 1).encode("latin-1"),
                        "not UTF-8 text (byte 0xff at offset"),
        "dup-key.toml": (base.replace("[pool]\n", "[pool]\nparts = 1\nparts = 2\n", 1).encode(),
                         "not valid TOML: Cannot overwrite a value (at line"),
        "dup-table.toml": ((base + "\n[pool]\nparts = 3\n").encode(), "Cannot declare ('pool',) twice"),
        "deep-array.toml": (base.replace('description = "', "x = " + "[" * 20_000 + "]" * 20_000
                                         + '\ndescription = "', 1).encode(), "not a usable TOML document: nested too deeply"),
        "deep-inline.toml": (("a = " + "{b = " * 5000 + "1" + "}" * 5000 + "\n").encode(), "nested too deeply"),
        "deep-dotted.toml": (("[" + ".".join(["a"] * 2000) + "]\n").encode(),
                             "tables and arrays nested more than 16 levels deep"),
        "nul.toml": (b'name = "a\x00b"\n', "Illegal character"),
    }


@pytest.mark.parametrize("name", ["latin1.toml", "dup-key.toml", "dup-table.toml", "deep-array.toml",
                                  "deep-inline.toml", "deep-dotted.toml", "nul.toml"])
def test_a_bad_scenario_file_is_one_error_naming_it_in_every_command(base_toml, tmp_path, name):
    data, needle = _bad_scenarios(base_toml)[name]
    path = tmp_path / name
    path.write_bytes(data)
    out = tmp_path / "out"
    for argv in (("scenario", "validate", str(path)), ("scenario", "show", str(path), "--json"),
                 ("sim", "run", str(path), *SMALL_RUN, "--out", str(out), "--json"),
                 ("sim", "compare", SCENARIO, str(path), "--sessions", "1", "--out", str(out)),
                 ("sim", "plan", str(path), "--target", "reuse>=0.5", "--vary", "pool.gib_per_service=64..768",
                  "--out", str(out))):
        line = _one_error(cli(*argv), str(path), needle)
        assert line.startswith(f"error: {path}: "), (argv, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_a_key_given_twice_is_shown_with_its_line(base_toml, tmp_path):
    path = tmp_path / "dup.toml"
    path.write_text(base_toml.replace("[pool]\n", "[pool]\nparts = 1\nparts = 2\n", 1))
    _one_error(cli("scenario", "validate", str(path)), str(path), "): 'parts = 2'")


def test_a_deep_set_value_is_one_error_naming_the_field():
    deep = "[" * 40 + "1" + "]" * 40
    _one_error(cli("scenario", "show", SCENARIO, "--set", f"pool.parts={deep}"), "--set pool.parts",
               "nested more than 16 levels deep")


def test_a_byte_order_mark_and_crlf_read_as_the_plain_scenario(base_toml, tmp_path):
    shown = {}
    for name, data in {"plain.toml": base_toml.encode(), "bom.toml": b"\xef\xbb\xbf" + base_toml.encode(),
                       "crlf.toml": base_toml.replace("\n", "\r\n").encode()}.items():
        (tmp_path / name).write_bytes(data)
        code, out, err, _ = cli("scenario", "show", str(tmp_path / name), "--json")
        assert code == 0, err
        shown[name] = json.loads(out)["scenario"]
    assert shown["bom.toml"] == shown["plain.toml"] == shown["crlf.toml"]


# -- the pool's state file ------------------------------------------------------------------------

@pytest.mark.parametrize("text", ['{"address": "127.0.0.1:1", "pid": 1, "work_dir": "w", "pid": 2}',
                                  '{"address": 5, "pid": 1, "work_dir": "w"}', "[" * 50_000, "\xff", ""])
def test_pool_status_of_a_state_file_it_did_not_write_names_the_file(tmp_path, text):
    state = tmp_path / "state.json"
    state.write_bytes(text.encode("latin-1"))
    _one_error(cli("pool", "status", "--state-file", str(state)), f"state file {state}: not a record of 'kvpool pool up'",
               "give --address")
    assert state.read_bytes() == text.encode("latin-1")


def test_pool_status_of_a_bad_recorded_address_names_the_state_file(tmp_path):
    state = tmp_path / "state.json"
    state.write_text('{"address": "x:y", "pid": 1, "work_dir": "w"}')
    _one_error(cli("pool", "status", "--state-file", str(state)), f"state file {state}: address: bad pool address 'x:y'")


# -- names that are not plain text ------------------------------------------------------------------

@pytest.mark.parametrize("odd, shown", [("a\nb", "a\\nb"), ("a\x1b[31mb", "a\\x1b[31mb"), ("a\rb", "a\\rb")])
def test_a_file_name_with_control_characters_is_shown_escaped_on_one_line(tmp_path, odd, shown):
    trace = tmp_path / f"{odd}.json"
    trace.write_text("x")
    scenario = tmp_path / f"{odd}.toml"
    scenario.write_text("seed = -1\n")
    for argv, needle in ((("trace", "stats", str(trace), "--json"), f"{shown}.json: invalid JSON"),
                         (("sim", "run", SCENARIO, *SMALL_RUN, "--traces", str(trace), "--out", str(tmp_path / "o")),
                          f"{shown}.json: invalid JSON"),
                         (("scenario", "validate", str(scenario)), f"{shown}.toml: name: required field is missing"),
                         (("scenario", "validate", str(tmp_path / f"{odd}-none.toml")), f"{shown}-none.toml: no such")):
        code, out, err, _ = cli(*argv)
        assert code == 2 and needle in err, (argv, err)
        assert all(line.startswith("error: ") for line in err.splitlines() if line.strip()), err
        assert "\x1b" not in err and "\r" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("row, needle", [
    ({"timestamp": 1e300, "input_length": 1024, "output_length": 16, "hash_ids": [1, 2]},
     "line 1: field 'timestamp' must be a number >= 0 and <= 1e+13 (ms), got 1e+300"),
    ({"timestamp": 1.7e12, "input_length": 1024, "output_length": 16, "hash_ids": [1, 2]}, None),  # epoch ms
])
def test_a_mooncake_timestamp_past_any_trace_is_refused(tmp_path, row, needle):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(row) + "\n")
    r = cli("trace", "stats", str(path), "--json")
    if needle is None:
        assert r[0] == 0 and json.loads(r[1])["traces"] == 1, r[2]
    else:
        _one_error(r, str(path), needle)


def test_a_subagent_duration_past_any_trace_is_refused(tmp_path):
    req = {"t": 0, "type": "n", "in": 64, "out": 8, "hash_ids": [1, 2, 3, 4]}
    sub = {"t": 1, "type": "subagent", "duration_ms": 1e300, "requests": [dict(req, t=1)]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"id": "t", "block_size": 16, "requests": [req, sub]}))
    _one_error(cli("trace", "stats", str(path), "--json"), str(path), "field 'duration_ms' must be a number >= 0 and <= 1e+13")


# -- the synthetic workload cache -------------------------------------------------------------------

class _Planted:
    """A pickle that creates a file when it is loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("mode, content", [(0o666, "planted"), (0o644, "list")])
def test_a_cache_entry_nobody_may_trust_or_that_is_no_workload_is_generated_again(tmp_path, monkeypatch, mode, content):
    import pickle

    from kvpool.sim import run as sim_run
    from kvpool.workload.model import Workload

    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    path = sim_run._synthetic_path("agentx-062126", 2, 3)
    path.parent.mkdir(parents=True)
    marker = tmp_path / "ran"
    path.write_bytes(pickle.dumps(_Planted(marker) if content == "planted" else [1, 2]))
    path.chmod(mode)
    w = sim_run._load_or_generate("agentx-062126", 2, 3, 1.0, None)
    assert isinstance(w, Workload) and len(w.sessions) == 2
    assert not marker.exists()
    assert isinstance(pickle.loads(path.read_bytes()), Workload)  # replaced by the generated one


# -- damaged copies of good files ---------------------------------------------------------------------


def _damaged(data: bytes, how: str, at: float, byte: int) -> bytes:
    k = min(len(data) - 1, int(at * len(data)))
    if how == "cut":
        return data[:k]
    if how == "flip":
        return data[:k] + bytes([data[k] ^ (byte or 1)]) + data[k + 1:]
    return data[:k] + bytes([byte]) * 7 + data[k:]


DAMAGE = dict(how=st.sampled_from(["cut", "flip", "insert"]), at=st.floats(0, 1), byte=st.integers(0, 255))


@settings(settings.get_profile(PROFILE), max_examples=settings.get_profile(PROFILE).max_examples * 2)
@given(layout=st.sampled_from(["json", "json.gz", "jsonl", "jsonl.gz"]), **DAMAGE)
def test_a_damaged_trace_file_is_an_error_naming_it_or_valid_stats(tmp_path_factory, layout, how, at, byte):
    d = tmp_path_factory.mktemp("damaged")
    text = (json.dumps(_trace()) + "\n" + json.dumps(_trace("t2")) + "\n").encode()
    if layout == "json":
        text = json.dumps([_trace(), _trace("t2")]).encode()
    data = gzip.compress(text) if layout.endswith(".gz") else text
    path = d / f"t.{layout}"
    path.write_bytes(_damaged(data, how, at, byte))
    assert_clean(cli("trace", "stats", str(path), "--json"), (str(path),))


@settings(settings.get_profile(PROFILE), max_examples=settings.get_profile(PROFILE).max_examples * 2)
@given(**DAMAGE)
def test_a_damaged_scenario_file_is_errors_naming_it_or_valid(tmp_path_factory, base_toml, how, at, byte):
    path = tmp_path_factory.mktemp("damaged") / "s.toml"
    path.write_bytes(_damaged(base_toml.encode(), how, at, byte))
    code, out, err, took = cli("scenario", "show", str(path), "--json")
    assert "Traceback" not in err and took < 30, err
    if code == 0:
        json.loads(out)
        return
    lines = [line for line in err.splitlines() if line.strip()]  # one line per problem, each naming the file
    assert code == 2 and lines and all(line.startswith(f"error: {path}: ") for line in lines), err


@pytest.mark.parametrize("field, text", [("description", "a\\u001b[31mred"), ("description", "two\\nlines"),
                                         ("name", "a\\u009bb"), ("model.name", "a\\tb")])
def test_a_label_with_control_characters_is_refused_before_anything_prints_it(field, text):
    r = cli("scenario", "show", SCENARIO, "--set", f'{field}="{text}"')
    line = _one_error(r, f"{field}: value ", "has a control character", "without control characters")
    assert "\x1b" not in r[1] + r[2] and "\x9b" not in r[1] + r[2] and line.isprintable()


def test_a_trace_path_with_an_escape_is_shown_escaped_in_tables(tmp_path):
    path = tmp_path / "e\x1b[31mx.json"
    path.write_text(json.dumps(_trace()))
    for argv in (("trace", "stats", str(path)),
                 ("sim", "run", SCENARIO, "--traces", str(path), "--sessions", "1", "--duration", "20",
                  "--out", str(tmp_path / "o"))):
        code, out, err, _ = cli(*argv)
        assert code == 0, err
        assert "\x1b" not in out + err and "e\\x1b[31mx.json" in out, out
