"""Inputs found by a campaign of bad and odd inputs that the earlier suites did not try: each ends
in one ``error:`` line naming the flag or file (exit status 2), and writes nothing."""

import os

import pytest

from kvpool.cli import main

LONG = "b" * 300  # longer than a file system allows one name to be (255 bytes)


def run(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def one_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    return lines[0]


@pytest.mark.parametrize("argv, flag", [
    (["sim", "run", "cpu-tiny", "--duration", "5", "--out", LONG], "--out"),
    (["sim", "compare", "cpu-tiny", LONG, "--duration", "5"], "scenario"),
    (["sim", "plan", LONG, "--target", "reuse>=1", "--vary", "pool.parts=1..2"], "scenario"),
    (["scenario", "validate", LONG + ".toml"], "scenario"),
    (["scenario", "show", LONG], "scenario"),
    (["trace", "synth", "--preset", "kv-cache-tester", "--sessions", "1", "--out", LONG], "--out"),
    (["trace", "synth", "--preset", "kv-cache-tester", "--sessions", "1", "--out", LONG + ".jsonl"], "--out"),
    (["trace", "convert", "src.jsonl", "--to", "weka", "--out", f"x/{LONG}.jsonl"], "--out"),
    (["trace", "convert", "src.jsonl", "--to", "weka", "--out", f"{LONG}.jsonl"], "--out"),
    (["trace", "convert", LONG, "--to", "weka", "--out", "src.jsonl"], "trace"),
    (["replay", "cpu-tiny", "--url", "http://127.0.0.1:9", "--out", LONG], "--out"),
    (["serve", "cpu-tiny", "--port", "0", "--run-dir", LONG], "--run-dir"),
])
def test_a_name_longer_than_the_file_system_allows_is_a_clean_error(capsys, tmp_path, monkeypatch, argv, flag):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src.jsonl").write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n')
    code, _, err = run(capsys, *argv)
    line = one_error(err)
    assert code == 2 and line.startswith(f"error: {flag} ") and "255" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.jsonl"]


def test_a_path_longer_than_the_system_allows_is_a_clean_error(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "sim", "run", "cpu-tiny", "--out", "/".join(["d" * 200] * 25))
    assert code == 2 and "longer than 4095 bytes" in one_error(err)


@pytest.mark.parametrize("command", ["convert", "synth"])
def test_a_dangling_link_at_the_output_is_not_replaced_without_force(capsys, tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src.jsonl").write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n')
    link = tmp_path / "out.jsonl"
    link.symlink_to(tmp_path / "elsewhere.jsonl")
    argv = (["trace", "convert", "src.jsonl", "--to", "weka", "--out", "out.jsonl"] if command == "convert" else
            ["trace", "synth", "--preset", "kv-cache-tester", "--sessions", "1", "--out", "out.jsonl"])
    code, _, err = run(capsys, *argv)
    assert code == 2 and "--out out.jsonl: exists" in one_error(err)
    assert link.is_symlink() and os.readlink(link) == str(tmp_path / "elsewhere.jsonl")
    assert not (tmp_path / "elsewhere.jsonl").exists()


@pytest.mark.parametrize("mode, vary, other", [
    ("agentx", "workload.rps=0.1..1", "replay"),
    ("replay", "workload.sessions=2..8", "agentx"),
])
def test_plan_refuses_to_vary_the_load_of_the_other_workload_mode(capsys, tmp_path, monkeypatch, mode, vary, other):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "sim", "plan", "cpu-tiny", "--set", f"workload.mode={mode}", "--target", "reuse>=0.5",
                       "--vary", vary, "--duration", "10", "--max-runs", "2", "--workers", "1")
    line = one_error(err)
    assert code == 2 and f"--vary '{vary}'" in line and f"workload.mode={other}" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, label", [
    (["--devices", "cuda:99"], "--devices cuda:99: cuda:99 is not on this machine"),
    (["--devices", "cpu,cuda:250"], "--devices cpu,cuda:250: cuda:250 is not on this machine"),
    (["--set", "serve.devices=['cpu','cuda:999']"], "serve.devices cpu,cuda:999: cuda:999 is not on this machine"),
])
def test_serve_refuses_a_cuda_device_the_machine_lacks_before_starting_a_worker(capsys, tmp_path, monkeypatch,
                                                                                argv, label):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "serve", "cpu-tiny", "--port", "0", "--run-dir", "rd", *argv)
    assert code == 2 and one_error(err).startswith(f"error: {label}")
    assert list(tmp_path.iterdir()) == []


def test_serve_run_dir_that_cannot_be_created_is_a_clean_error(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    for where in ("/proc/self/x", "file/sub"):
        code, _, err = run(capsys, "serve", "cpu-tiny", "--port", "0", "--run-dir", where)
        assert code == 2 and one_error(err).startswith(f"error: --run-dir {where}: cannot create")


@pytest.mark.parametrize("sizes", [
    ["serve.d_model=65536", "serve.ffn_dim=1048576"],
    ["serve.vocab=1048576", "serve.d_model=65536", "serve.heads=1024"],
])
def test_serve_refuses_a_reference_model_larger_than_the_machines_memory(capsys, tmp_path, monkeypatch, sizes):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("kvpool.cli.serve.physical_memory_bytes", lambda: 64 << 30, raising=False)
    sets = [a for s in sizes for a in ("--set", s)]
    code, _, err = run(capsys, "serve", "cpu-tiny", "--port", "0", "--run-dir", "rd", *sets)
    line = one_error(err)
    assert code == 2 and "the reference model's weights take" in line and "serve.d_model 65536" in line
    assert list(tmp_path.iterdir()) == []


def test_the_weight_size_is_what_the_reference_model_allocates():
    from kvpool.backend.refmodel import RefModel
    from kvpool.backend.serve.model_config import ref_config
    from kvpool.scenario import load_scenario

    config = ref_config(load_scenario("cpu-tiny", ["serve.heads=3", "serve.ffn_dim=700", "serve.vocab=1000",
                                                   "serve.nope_dim=32", "serve.v_dim=48"]))
    m = RefModel(config)
    tensors = [t for layer in m.layers for t in layer.values()] + [m.embed, m.lm_head, m.ln_f]
    assert config.weight_bytes == sum(t.numel() * t.element_size() for t in tensors)


def test_serve_refuses_cpu_workers_whose_paged_kv_exceeds_the_machines_memory(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("kvpool.cli.serve.physical_memory_bytes", lambda: 64 << 30)
    code, _, err = run(capsys, "serve", "cpu-tiny", "--port", "0", "--run-dir", "rd",
                       "--set", "serve.prefill_kv_tokens=16777216", "--set", "serve.decode_kv_tokens=16777216",
                       "--set", "prefill.instances=2", "--set", "cluster.gpus_per_server=6",
                       "--set", "cluster.numa_per_server=3")
    line = one_error(err)
    assert code == 2 and "paged KV takes 216.0 GiB" in line and "serve.decode_kv_tokens 16777216" in line
    assert "64.0 GiB of memory" in line
    assert list(tmp_path.iterdir()) == []


def test_serve_refuses_a_run_dir_holding_files_it_did_not_write(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rd").mkdir()
    (tmp_path / "rd" / "plan.json").write_text("keep")
    code, _, err = run(capsys, "serve", "cpu-tiny", "--port", "0", "--run-dir", "rd")
    assert code == 2 and one_error(err).startswith("error: --run-dir rd: not empty (1 entries, e.g. plan.json)")
    assert (tmp_path / "rd" / "plan.json").read_text() == "keep"


@pytest.mark.parametrize("flag, value", [("--sessions", "\u0662"), ("--sessions", "1_0"), ("--rps", "0\u066b5"),
                                         ("--rps", "1_0.5"), ("--sessions", "\uff12")])
def test_loads_are_ascii_numbers_without_separators(capsys, tmp_path, monkeypatch, flag, value):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "sim", "run", "cpu-tiny", flag, value, "--duration", "5")
    assert code == 2 and one_error(err).startswith(f"error: {flag} {value!r}: {value!r} is not a")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out", ["x.json", "x.gz", "x.json.gz"])
def test_synth_refuses_a_file_like_out_that_would_become_a_directory(capsys, tmp_path, monkeypatch, out):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "trace", "synth", "--preset", "kv-cache-tester", "--sessions", "1", "--out", out)
    assert code == 2 and one_error(err).startswith(f"error: --out {out}: a file name, but not .jsonl")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("trace_id", ["", "   "])
def test_a_weka_trace_with_an_empty_id_is_refused(capsys, tmp_path, monkeypatch, trace_id):
    import json

    monkeypatch.chdir(tmp_path)
    doc = {"id": trace_id, "block_size": 64, "requests": [{"t": 0.0, "type": "n", "in": 64, "out": 1, "hash_ids": [1]}]}
    (tmp_path / "t.json").write_text(json.dumps(doc))
    code, _, err = run(capsys, "trace", "stats", "t.json")
    line = one_error(err)
    assert code == 2 and "t.json" in line and "field 'id' is" in line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind, needle", [("device", "not a regular file"), ("fifo", "not a regular file"),
                                          ("directory", "not a regular file"), ("deep", "nested too deeply"),
                                          ("large", "larger than 16 MiB")])
def test_a_calibration_file_that_is_no_file_is_one_error_not_an_endless_read(capsys, tmp_path, monkeypatch, kind, needle):
    """cost.calibration is read before any run: /dev/zero, a FIFO, a directory, JSON nested past the
    parser's depth and a file past the bound are one error naming cost.calibration, in the bound."""
    monkeypatch.chdir(tmp_path)
    path = {"device": "/dev/zero", "fifo": str(tmp_path / "cal.fifo"), "directory": str(tmp_path),
            "deep": str(tmp_path / "deep.json"), "large": str(tmp_path / "large.json")}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "deep":
        (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "large":
        with open(path, "wb") as f:
            f.truncate((16 << 20) + 1)
    for argv in (["scenario", "validate", "cpu-tiny"], ["sim", "run", "cpu-tiny", "--duration", "5", "--out", "o"]):
        code, _, err = run(capsys, *argv, "--set", f"cost.calibration='{path}'")
        line = one_error(err)
        assert code == 2 and "cost.calibration" in line and needle in line, line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv", [
    ["sim", "compare", "cpu-tiny", "cpu-tiny", "--duration", "5", "--out", "gone"],
    ["sim", "run", "cpu-tiny", "--duration", "5", "--out", "gone/sub"],
    ["trace", "synth", "--preset", "kv-cache-tester", "--sessions", "1", "--out", "gone/s.jsonl"],
])
def test_an_output_folder_that_is_a_link_to_nothing_is_one_error_before_any_work(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    os.symlink("missing_target", "gone")
    code, _, err = run(capsys, *argv)
    line = one_error(err)  # the error is the only line: nothing was built or run first
    assert code == 2 and "--out" in line and "link to missing_target, which does not exist" in line, line
    assert sorted(os.listdir(tmp_path)) == ["gone"]


@pytest.mark.parametrize("command", [["sim", "run", "cpu-tiny"], ["sim", "compare", "cpu-tiny", "h200-tiny"]])
def test_an_unreachable_cluster_is_one_error_before_the_workload_is_built(capsys, tmp_path, monkeypatch, command):
    """The executor is checked (and a cluster reached) before the synthetic workload is built, so
    the error is the only line, with nothing built or written."""
    pytest.importorskip("ray")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, _, err = run(capsys, *command, "--duration", "5", "--set", "workload.synthetic_sessions=5",
                       "--executor", "ray", "--address", "127.0.0.1:9", "--json")
    line = one_error(err)
    assert code == 2 and "--address 127.0.0.1:9" in line, line
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()
