"""A client nobody here wrote: AIPerf (``aiperf profile``) replays a Mooncake trace made by ``kvpool trace
convert`` against an OpenAI-compatible server, gets the right answers and writes its own TTFT/ITL report.

The trace: ``kvpool trace convert --to mooncake`` of two of the repository's kv-cache-tester traces
(two agent sessions, so rows share prefixes), the first ``ROWS`` rows scaled to the server's page
size by the rule ``kvpool replay`` applies (``workload.token_scale``: a 512-token block becomes
``PAGE_TOKENS`` tokens), outputs capped at ``MAX_OUTPUT_TOKENS``, ten times faster.

AIPerf is found at ``$KVPOOL_AIPERF`` (its ``aiperf`` executable), then ``.aiperf-venv/bin/aiperf``
in the checkout (``python3 -m venv .aiperf-venv && .aiperf-venv/bin/pip install aiperf==0.13.0``:
its own environment, as its pins differ from kvpool's), then beside this Python, then on ``PATH``; the tests are
skipped, saying so, when none is there. It runs offline: the tokenizer is
``backend/serve/tokenizer`` as a Hugging Face cache entry (``byte_tokenizer.write_hf_cache``) under
the test's folder, ``HF_HUB_OFFLINE=1``, no dataset cache outside the test's folder.

The server: ``kvpool serve cpu-tiny`` (real processes on loopback, ``serve_process.start_serve``;
every process it started is gone after its stop); every answer is checked against
``backend.serve.reference.reference_generate``, the no-cache recompute.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from serve_process import start_serve

from kvpool.backend.serve.byte_tokenizer import TOKENIZER_DIR, stale_files, tokenizer_files, write_hf_cache
from kvpool.backend.serve.model_config import EOS_TOKEN
from kvpool.cli import main as kvpool_main
from kvpool.workload.mooncake import MOONCAKE_BLOCK_TOKENS
from kvpool.workload.token_scale import scaled_block_tokens, scaled_prompt_tokens

ROOT = Path(__file__).resolve().parents[2]
KV_TRACES = ROOT / "tests" / "data" / "traces" / "kv-cache-tester"
SESSION_TRACES = ("trace_0001.json.gz", "trace_0002.json.gz")
ROWS = 12
PAGE_TOKENS = 16  # cpu-tiny's model.page_tokens
MAX_OUTPUT_TOKENS = 8
TIME_DIVISOR = 10
AIPERF_TIMEOUT_S = 240


def _find_aiperf() -> tuple[Path | None, str]:
    """The ``aiperf`` executable and its package version, or ``(None, why not)``."""
    candidates = [os.environ.get("KVPOOL_AIPERF"), ROOT / ".aiperf-venv" / "bin" / "aiperf",
                  Path(sys.executable).parent / "aiperf", shutil.which("aiperf")]
    for c in candidates:
        if c and Path(c).is_file():
            exe = Path(c)
            py = exe.parent / "python"
            probe = subprocess.run([str(py if py.exists() else sys.executable), "-c",
                                    "import aiperf, importlib.metadata as m; print(m.version('aiperf'))"],
                                   capture_output=True, text=True, timeout=60)
            if probe.returncode != 0:
                return None, f"{exe} is there but its Python cannot import aiperf"
            return exe, probe.stdout.strip()
    return None, ("aiperf is not installed (python3 -m venv .aiperf-venv && .aiperf-venv/bin/pip install "
                  "aiperf==0.13.0, or set KVPOOL_AIPERF to its aiperf executable)")


AIPERF, AIPERF_VERSION = _find_aiperf()
needs_aiperf = pytest.mark.skipif(AIPERF is None or not AIPERF_VERSION.startswith("0.13."),
                                  reason=AIPERF_VERSION if AIPERF is None else f"needs aiperf 0.13.x, found {AIPERF_VERSION}")


# -- the servers ---------------------------------------------------------------------------------


@dataclass
class ServerUnderTest:
    """An OpenAI-compatible server: ``url`` (no path), the model's name, and its answer for a prompt."""

    url: str
    model: str
    expected_text: Callable[[list[int], int], str]
    aiperf_args: list[str] = field(default_factory=list)


@pytest.fixture
def server(tmp_path) -> Iterator[ServerUnderTest]:
    """``kvpool serve cpu-tiny``; its answer for a prompt is the no-cache recompute's."""
    from kvpool.backend.serve.model_config import ref_config
    from kvpool.backend.serve.reference import reference_generate
    from kvpool.backend.serve.tokens import decode
    from kvpool.scenario.load import load_scenario

    scenario = load_scenario("cpu-tiny", [])
    config, dcp = ref_config(scenario), scenario.decode.dcp
    served = start_serve(tmp_path / "serve", [])
    try:
        with urllib.request.urlopen(f"{served.url}/health", timeout=30) as r:
            assert r.status == 200
        yield ServerUnderTest(served.url, scenario.model.name,
                              lambda ids, n: decode(reference_generate(config, ids, n, dcp)),
                              # ids >= 256 are not text: count output tokens as the server does
                              ["--use-server-token-count"])
    finally:
        status = served.stop()  # asserts every process of router.ready.json is gone
    assert status == 0, served.output()[-4000:]


# -- the trace -----------------------------------------------------------------------------------


def scaled_rows(rows: list[dict], page_tokens: int) -> list[dict]:
    """Mooncake rows with 512-token blocks scaled to ``page_tokens``-token blocks (``workload.token_scale``).

    A row's last hash id is dropped when rounding leaves its block no token (a partial block of
    fewer than half a scaled token); an id always stands for one block size, before and after.
    """
    f = page_tokens / MOONCAKE_BLOCK_TOKENS
    b = scaled_block_tokens(MOONCAKE_BLOCK_TOKENS, f)
    t0 = rows[0]["timestamp"]
    out = []
    for r in rows:
        n = scaled_prompt_tokens(r["input_length"], MOONCAKE_BLOCK_TOKENS, f)
        out.append({"timestamp": (r["timestamp"] - t0) // TIME_DIVISOR, "input_length": n,
                    "output_length": max(1, min(r["output_length"], MAX_OUTPUT_TOKENS)),
                    "hash_ids": r["hash_ids"][:-(-n // b)]})
    return out


def _kvpool(*argv: str) -> None:
    with pytest.raises(SystemExit) as e:
        kvpool_main(list(argv))
    assert (e.value.code or 0) == 0


@pytest.fixture
def trace_rows(tmp_path) -> tuple[Path, list[dict]]:
    src = tmp_path / "traces"
    src.mkdir()
    for name in SESSION_TRACES:
        shutil.copy(KV_TRACES / name, src / name)
    converted = tmp_path / "converted.jsonl"
    _kvpool("trace", "convert", str(src), "--to", "mooncake", "--out", str(converted), "--stagger-s", "1")
    rows = [json.loads(x) for x in converted.read_text().splitlines()]
    picked, lengths = [], set()
    for r in scaled_rows(rows, PAGE_TOKENS):  # distinct lengths: a prompt's length names its row
        if r["input_length"] not in lengths and len(picked) < ROWS:
            picked.append(r)
            lengths.add(r["input_length"])
    path = tmp_path / "aiperf-trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in picked))
    return path, picked


# -- the tests -----------------------------------------------------------------------------------


def test_shipped_tokenizer_is_the_generated_one_and_maps_bytes():
    assert stale_files(TOKENIZER_DIR) == []
    tok = tokenizer_files()["tokenizer.json"]
    assert sorted(tok["model"]["vocab"].values()) == list(range(256)) and tok["model"]["merges"] == []
    assert [(t["id"], t["content"], t["special"]) for t in tok["added_tokens"]] == [(EOS_TOKEN, "</s>", True)]
    config = tokenizer_files()["tokenizer_config.json"]
    assert not {"bos_token", "eos_token", "pad_token"} & set(config)  # no separator inside AIPerf's prompts


def test_scaled_rows_keep_one_block_size_per_hash_id():
    rows = [{"timestamp": 0, "input_length": 1030, "output_length": 3, "hash_ids": [1, 2, 3]},  # 6 tokens past 2 blocks
            {"timestamp": 20, "input_length": 1100, "output_length": 0, "hash_ids": [1, 2, 4]},
            {"timestamp": 40, "input_length": 512, "output_length": 99, "hash_ids": [1]}]
    out = scaled_rows(rows, 16)
    assert [(r["input_length"], r["hash_ids"], r["output_length"], r["timestamp"]) for r in out] == [
        (32, [1, 2], 3, 0), (34, [1, 2, 4], 1, 2), (16, [1], MAX_OUTPUT_TOKENS, 4)]


def _aiperf_env(tmp_path: Path) -> tuple[dict, str]:
    hf = tmp_path / "hf-cache"
    repo = write_hf_cache(hf)
    env = {**os.environ, "HF_HUB_CACHE": str(hf), "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "AIPERF_DATASET_MMAP_CACHE_ENABLED": "false", "NO_COLOR": "1"}
    return env, repo


@needs_aiperf
def test_aiperf_loads_the_tokenizer_offline_and_counts_bytes(tmp_path):
    env, repo = _aiperf_env(tmp_path)
    texts = ["ITUS I know thou", "  two  spaces\n\nnew line", "h\u00e9llo \u65e5\u672c", "tab\tend"]
    code = (
        "import json, sys\n"
        "from aiperf.common.tokenizer import Tokenizer\n"
        f"t = Tokenizer.from_pretrained({repo!r}, resolve_alias=False)\n"
        "texts = json.loads(sys.argv[1])\n"
        "print(json.dumps({'ids': [t.encode(s) for s in texts], 'back': [t.decode(list(s.encode())) for s in texts],"
        " 'sep': t.block_separation_token_id, 'vocab': t.vocab_size}))\n"
    )
    py = AIPERF.parent / "python"
    out = subprocess.run([str(py), "-c", code, json.dumps(texts)], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ids"] == [list(s.encode("utf-8")) for s in texts]
    assert got["back"] == texts and got["sep"] is None and got["vocab"] == 256


@needs_aiperf
@pytest.mark.slow
def test_aiperf_replays_a_converted_trace_and_reports_ttft_and_itl(tmp_path, server, trace_rows):
    trace, rows = trace_rows
    env, repo = _aiperf_env(tmp_path)
    art = tmp_path / "aiperf"
    argv = [str(AIPERF), "profile", "--model", server.model, "--url", server.url, "--endpoint-type", "completions",
            "--streaming", "--tokenizer", repo, "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
            "--fixed-schedule", "--isl-block-size", str(PAGE_TOKENS), "--extra-inputs", "ignore_eos:true",
            "--artifact-dir", str(art), "--export-level", "raw", "--random-seed", "7", "--ui-type", "none",
            "--no-gpu-telemetry", "--no-server-metrics", "--workers-max", "2", "--record-processors", "1",
            *server.aiperf_args]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=AIPERF_TIMEOUT_S, cwd=tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    n = len(rows)
    assert n == ROWS

    # AIPerf's own report: every request succeeded, TTFT and ITL for each, its token counts are the trace's
    summary = json.loads((art / "profile_export_aiperf.json").read_text())
    assert summary["is_complete"] is True and summary["was_cancelled"] is False
    assert summary["error_summary"] == []
    assert summary["request_count"]["avg"] == n and summary["completed_request_count"]["avg"] == n
    for metric in ("time_to_first_token", "inter_token_latency", "request_latency"):
        m = summary[metric]
        assert m["unit"] == "ms" and m["count"] == n and 0 < m["min"] <= m["p50"] <= m["max"], (metric, m)
    assert summary["input_sequence_length"]["sum"] == sum(r["input_length"] for r in rows)
    assert summary["output_sequence_length"]["sum"] == sum(r["output_length"] for r in rows)
    csv = (art / "profile_export_aiperf.csv").read_text()
    assert "Time to First Token" in csv and "Inter Token Latency" in csv

    # every request as sent and answered: the trace's row, the server's answer, the server's counts
    raw = [json.loads(x) for x in (art / "profile_export_raw.jsonl").read_text().splitlines()]
    assert len(raw) == n
    by_length = {r["input_length"]: r for r in rows}
    prompts: dict[int, bytes] = {}
    for rec in raw:
        assert rec["status"] == 200
        p = rec["payload"]
        ids = list(p["prompt"].encode("utf-8"))
        row = by_length[len(ids)]  # the prompt has the row's length in the server's tokens (bytes)
        assert p["max_tokens"] == row["output_length"] and p["ignore_eos"] is True and p["stream"] is True
        assert id(row) not in prompts
        prompts[id(row)] = bytes(ids)
        chunks = [json.loads(pk["value"]) for resp in rec["responses"] for pk in resp["packets"]
                  if pk["name"] == "data" and pk["value"] != "[DONE]"]
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        assert text == server.expected_text(ids, row["output_length"])
        usage = [c["usage"] for c in chunks if c.get("usage")][-1]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), row["output_length"])

    # the prompts are built from the hash ids, one page per id: equal ids, equal bytes
    blocks: dict[int, set[bytes]] = {}
    for row in rows:
        for k, h in enumerate(row["hash_ids"]):
            blocks.setdefault(h, set()).add(prompts[id(row)][k * PAGE_TOKENS:(k + 1) * PAGE_TOKENS])
    shared = [h for h in blocks if sum(h in r["hash_ids"] for r in rows) > 1]
    assert shared, "the trace's rows share no prefix"
    assert all(len(v) == 1 for v in blocks.values())
