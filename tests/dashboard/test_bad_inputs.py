"""AppTest of bad inputs typed or uploaded into the dashboard: each shows an error in the page that
names the input, never an exception, and leaves the scenario being edited as it was."""

from __future__ import annotations

import gzip
import json
import os

import pytest
from conftest import by_label, errors, press, set_plan, set_run

from kvpool.scenario import load_scenario, to_toml

BASE = to_toml(load_scenario("mi355x-1p1d"))


def _upload(at, name: str, data: bytes):
    at.file_uploader[0].set_value((name, data, "application/toml")).run()
    return at


BAD_UPLOADS = [
    ("deep.toml", ("[" + ".".join(["a"] * 3000) + "]\n").encode(), "tables and arrays nested more than 16 levels deep"),
    ("nested.toml", ("a = " + "[" * 3000 + "]" * 3000 + "\n").encode(), "not a usable TOML document: nested too deeply"),
    ("latin1.toml", BASE.replace('description = "', 'description = "\xff', 1).encode("latin-1"),
     "not UTF-8 text (byte 0xff at offset"),
    ("big.toml", b"#" * (2 << 20), "larger than 1048576 bytes"),
    ("twice.toml", (BASE + "\n[pool]\nparts = 2\n").encode(), "Cannot declare ('pool',) twice"),
    ("wide.toml", BASE.replace("\nseed = ", "\nseed = 0x" + "F" * 40 + " #", 1).encode(), "seed: an integer wider than 64 bits"),
]


def test_a_bad_upload_is_an_error_naming_the_file_and_keeps_the_scenario(app):
    for name, data, needle in BAD_UPLOADS:
        _upload(app, name, data)
        assert not app.exception, name
        errs = errors(app)
        assert len(errs) == 1 and errs[0].startswith(f"upload {name}: ") and needle in errs[0], errs
        assert "mi355x-1p1d" in app.subheader[0].value


def test_an_upload_with_a_byte_order_mark_and_crlf_loads(app):
    text = to_toml(load_scenario("h200-1p1d", ['name="mine"']))
    _upload(app, "bom.toml", b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    assert not app.exception and not errors(app)
    assert "mine" in app.subheader[0].value


@pytest.mark.parametrize("line, needle", [
    ("pool.parts=" + "[" * 40 + "1" + "]" * 40, "--set pool.parts: arrays or tables nested more than 16 levels deep"),
    ("cluster.numa_per_server=3", "cluster.numa_per_server (3) must divide cluster.gpus_per_server (8)"),
])
def test_a_bad_advanced_override_is_shown_and_disables_the_download(app, line, needle):
    by_label(app.text_area, "More overrides").set_value(line).run()
    assert not app.exception
    assert any(needle in e for e in errors(app)), errors(app)
    assert by_label(app.get("download_button"), "Download scenario TOML").disabled


@pytest.fixture
def bad_trace_files(tmp_path):
    """name -> (path, what the page's error says)."""
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b" " * (1 << 20), 9) * 80)  # 80 MiB of spaces in 80 gzip members
    twice = tmp_path / "twice.json"
    req = {"t": 0, "type": "n", "in": 64, "out": 8, "hash_ids": [1, 2, 3, 4]}
    twice.write_text(json.dumps({"id": "t", "block_size": 16, "requests": [req]})[:-1] + ', "id": "u"}')
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    return {"bomb": (bomb, "inflates past 64 MiB after gzip"),
            "twice": (twice, "key 'id' given twice in one JSON object"),
            "fifo": (fifo, "not a regular file (a FIFO, device or socket is not a trace)")}


@pytest.mark.parametrize("which", ["bomb", "twice", "fifo"])
def test_a_bad_trace_file_is_an_error_in_the_run_page(app, bad_trace_files, which):
    path, needle = bad_trace_files[which]
    by_label(app.text_area, "More overrides").set_value(f"workload.traces={json.dumps(str(path))}").run()
    app.switch_page("pages/run.py").run()
    set_run(app, "1", duration=20, synthetic=2, workers=1)
    press(app, "Run sweep")
    assert not app.exception
    errs = errors(app)
    assert any(str(path) in e and needle in e for e in errs), errs
    assert not app.dataframe


def test_a_huge_plan_range_is_a_short_error(app):
    app.switch_page("pages/plan.py").run()
    set_plan(app, hi=1e308, max_runs=3)
    assert not app.exception
    errs = [e for e in errors(app) if e.startswith("Variable: ")]
    assert len(errs) == 1 and "pool.gib_per_service=64..1e+308" in errs[0] and len(errs[0]) < 400, errs
