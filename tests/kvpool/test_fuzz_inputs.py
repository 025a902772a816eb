"""Property-based tests of every input edge: scenario overrides of every model field, CLI flags,
trace documents and ``sim plan``'s targets and ranges.

For each generated input the command (run in-process through ``kvpool.cli.main``) ends in one of
two ways: exit status 2 with exactly one ``error:`` line that names the field, flag or file; or
exit status 0 with output that is valid JSON (NaN and Infinity refused). Never a traceback, never
longer than a bound. The profile is small (``derandomize``, capped examples) so the suite stays
within the test budget; ``HYPOTHESIS_PROFILE=nightly`` runs many more examples.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import time
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from kvpool.cli import main
from kvpool.scenario.model import Scenario

settings.register_profile("ci", max_examples=25, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("nightly", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
BOUND_S = 30.0  # no single command may take longer


def cli(*argv: str) -> tuple[int, str, str, float]:
    """(exit status, stdout, stderr, seconds) of ``kvpool ARGV`` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(argv))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, out.getvalue(), err.getvalue(), time.monotonic() - t0


def _strict_json(text: str) -> object:
    def refuse(name: str):
        raise AssertionError(f"output holds {name}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


def assert_clean(result: tuple[int, str, str, float], names: tuple[str, ...], json_out: bool = True) -> None:
    code, out, err, took = result
    assert "Traceback" not in err and "Traceback" not in out, err
    assert took < BOUND_S, f"took {took:.1f} s"
    if code == 0:
        if json_out:
            _strict_json(out)
        return
    assert code == 2, (code, err)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert any(n in lines[0] for n in names), (names, lines[0])


def leaf_fields(model: type[BaseModel] = Scenario, prefix: str = "") -> list[str]:
    """Every scalar field of the scenario model, as ``section.field``."""
    out = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += leaf_fields(ann, f"{prefix}{name}.")
        elif typing.get_origin(ann) is tuple and any(isinstance(a, type) and issubclass(a, BaseModel)
                                                     for a in typing.get_args(ann)):
            continue  # arrays of tables: not settable with --set
        else:
            out.append(prefix + name)
    return out


FIELDS = leaf_fields()

BAD_VALUES = st.one_of(
    st.sampled_from(["inf", "-inf", "nan", "1e308", "-1e308", "true", "false", "'x'", '"2"', "yes", "-1", "0",
                     "1" + "0" * 30, "9" * 5000, "1e12", "[1, 2]", "[true]", "{a = 1}", "''", '"a/b"',
                     '"../../x"', "2.5", "1e-300", str(2**64), "[" * 300 + "]" * 300]),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda x: repr(x).replace("inf", "inf")),
    st.text(max_size=30).filter(lambda t: "\n" not in t and "\r" not in t),
)


def test_the_model_has_fields_to_fuzz():
    assert len(FIELDS) > 80 and "pool.ssd.gib_per_server" in FIELDS and "seed" in FIELDS


@settings(settings.get_profile(PROFILE), max_examples=settings.get_profile(PROFILE).max_examples * 8)
@given(field=st.sampled_from(FIELDS), value=BAD_VALUES)
def test_any_override_of_any_field_is_an_error_naming_it_or_a_valid_scenario(field, value):
    r = cli("scenario", "show", "mi355x-1p1d", "--set", f"{field}={value}", "--json")
    assert_clean(r, (field, "--set"))
    if r[0] == 0:  # what was accepted is in range and finite
        doc = _strict_json(r[1])
        assert all(not isinstance(v, float) or math.isfinite(v) for v in _numbers(doc))


def _numbers(doc) -> list:
    if isinstance(doc, dict):
        return [x for v in doc.values() for x in _numbers(v)]
    if isinstance(doc, list):
        return [x for v in doc for x in _numbers(v)]
    return [doc] if isinstance(doc, (int, float)) else []


FLAG_VALUES = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "1e308", "1e12", "0", "-1", "1e6", "99999999", "1e", "x", "", "2,nan",
                     "1" * 400, "0.5", "3", ",", "1,,2", str(2**64)]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(2**66), max_value=2**66).map(str),
)
# flag -> the names an error must mention
RUN_FLAGS = {"--duration": ("--duration",), "--rps": ("--rps",), "--sessions": ("--sessions",), "--seed": ("--seed",),
             "--workers": ("--workers",)}


@settings(settings.get_profile(PROFILE), max_examples=settings.get_profile(PROFILE).max_examples * 2)
@given(flag=st.sampled_from(sorted(RUN_FLAGS)), value=FLAG_VALUES)
def test_sim_run_flags_are_an_error_naming_the_flag_or_a_run_with_json(tmp_path_factory, flag, value):
    out = tmp_path_factory.mktemp("out")
    args = ["sim", "run", "mi355x-1p1d", "--set", "workload.synthetic_sessions=2", "--set", "workload.warmup_requests=0",
            "--out", str(out), "--json"]
    if flag != "--duration":
        args += ["--duration", "20"]
    if flag not in ("--rps", "--sessions"):
        args += ["--sessions", "1"]
    if flag == "--rps":
        args += ["--set", "workload.lanes=2"]
    if flag == "--workers":
        value = value if not value.lstrip("-").isdigit() or abs(int(value)) > 4 else "1"
    if flag == "--sessions" and value.isdigit() and 0 < int(value) <= 100_000:
        value = "1"  # a valid load: keep the run tiny
    if flag == "--rps":
        try:
            if 0 < float(value) <= 10_000:
                value = "0.5"
        except ValueError:
            pass
    if flag == "--duration":
        try:
            if 0 < float(value) <= 604_800:
                value = "20"
        except ValueError:
            pass
    r = cli(*args, f"{flag}={value}")
    assert_clean(r, RUN_FLAGS[flag] + ("see kvpool sim run --help",))
    if r[0] == 0:  # nothing but the run's own files
        assert all(p.suffix in (".json", ".csv", ".png") and not p.name.startswith(".") for p in out.iterdir())


PLAN_TEXT = st.one_of(
    st.sampled_from(["reuse>=1e", "reuse>=nan", "reuse>=inf", "reuse>=", ">=1", "reuse=>1", "reuse>=1e400", "x>=1",
                     "reuse>=0.5"]),
    st.text(alphabet="reuse_tfp90<>=.0123456789eE+-", max_size=20),
)
VARY_TEXT = st.one_of(
    st.sampled_from(["pool.gib_per_service=1e..768", "pool.gib_per_service=nan..768", "decode.max_seqs=1..256",
                     "pool.gib_per_service=inf..1e400", "pool.colour=1..2", "cluster.servers=0..4", "seed=-5..-1",
                     "decode.max_seqs=1.5..2.5", "workload.duration_s=1..1e12"]),
    st.builds(lambda f, a, b: f"{f}={a}..{b}", st.sampled_from(FIELDS),
              st.floats(allow_nan=True, allow_infinity=True).map(repr), st.floats(allow_nan=True, allow_infinity=True).map(repr)),
)


@settings(settings.get_profile(PROFILE), max_examples=settings.get_profile(PROFILE).max_examples * 4)
@given(target=PLAN_TEXT, vary=VARY_TEXT)
def test_plan_targets_and_ranges_are_a_plan_error_or_parsed(target, vary):
    from kvpool.scenario import load_scenario
    from kvpool.sim.plan import PlanError, parse_target, parse_vary

    base = load_scenario("mi355x-1p1d")
    try:
        t = parse_target(target)
        assert math.isfinite(t.value)
    except PlanError as e:
        assert "--target" in str(e) and "\n" not in str(e)
    try:
        v = parse_vary(vary, base)
        assert math.isfinite(v.lo) and math.isfinite(v.hi) and v.lo < v.hi
    except PlanError as e:
        assert "--vary" in str(e)


def test_plan_load_and_an_integer_field_point_are_clean(tmp_path):
    for load in ("0", "nan", "inf", "-3", "1e9"):
        assert_clean(cli("sim", "plan", "mi355x-1p1d", "--target", "reuse>=0.5", "--vary", "pool.gib_per_service=64..768",
                         "--load", load, "--out", str(tmp_path)), ("--load",))
    from kvpool.sim.plan import Variable

    assert Variable("decode.max_seqs", 1, 256).integer and not Variable("pool.gib_per_service", 1, 2).integer


# -- trace documents ------------------------------------------------------------------------------

JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
                      st.sampled_from([1e300, 10**9, 2**70, -1, 0.5]))
JSON_ANY = st.recursive(JSON_LEAF, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                        max_leaves=20)


def _request(t=0.0, n_in=64, n_out=8, ids=None, **extra):
    return {"t": t, "type": "n", "in": n_in, "out": n_out, "hash_ids": [1, 2, 3, 4] if ids is None else ids, **extra}


@st.composite
def weka_docs(draw) -> object:
    """A Weka trace with one field replaced by something odd, or a random JSON value."""
    if draw(st.integers(0, 5)) == 0:
        return draw(JSON_ANY)
    doc = {"id": "t1", "block_size": 16, "hash_id_scope": "local",
           "requests": [_request(0.0), _request(5.0, ids=[1, 2, 3, 4, 5, 6, 7, 8], n_in=128)]}
    where = draw(st.sampled_from(["id", "block_size", "hash_id_scope", "requests", "t", "in", "out", "hash_ids",
                                  "api_time", "think_time", "hash_ids_item"]))
    value = draw(st.one_of(JSON_ANY, st.sampled_from([1e300, 10**9, 2**70, True, [], {}, -1, "x", None])))
    if where in ("id", "block_size", "hash_id_scope", "requests"):
        doc[where] = value
    elif where == "hash_ids_item":
        doc["requests"][1]["hash_ids"][draw(st.integers(1, 7))] = value
    else:
        doc["requests"][1][where] = value
    return doc


@settings(settings.get_profile(PROFILE), max_examples=settings.get_profile(PROFILE).max_examples * 4)
@given(doc=weka_docs(), layout=st.sampled_from(["json", "jsonl"]))
def test_trace_documents_are_an_error_naming_the_file_or_valid_stats(tmp_path_factory, doc, layout):
    d = tmp_path_factory.mktemp("traces")
    path = d / f"t.{layout}"
    path.write_text(json.dumps(doc) + "\n")
    r = cli("trace", "stats", str(path), "--json")
    assert_clean(r, (str(path),))


def test_trace_paths_that_are_not_regular_files_are_clean_errors(tmp_path):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 5000 + "]" * 5000)
    (tmp_path / "dir.jsonl").mkdir()
    for p in (fifo, Path("/dev/zero"), deep, tmp_path / "dir.jsonl"):
        assert_clean(cli("trace", "stats", str(p), "--json"), (str(p),))


def test_duplicate_trace_ids_across_files_are_refused(tmp_path):
    doc = {"id": "same", "block_size": 16, "requests": [_request()]}
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps(doc))
    code, _, err, _ = cli("trace", "stats", str(tmp_path), "--json")
    assert code == 2 and "duplicate trace id" in err and "a.json" in err and "b.json" in err


@pytest.mark.parametrize("field, value, needle", [
    ("in", 10**9, "'in' must be an integer >= 0 and <= 16777216"),
    ("out", 2**70, "'out' must be an integer"),
    ("api_time", 1e300, "'api_time' must be a number >= 0 and <= 86400"),
    ("t", 1e300, "'t' must be a number >= 0 and <= 1e+10 s"),
    ("t", 2**70, "'t' must be a number >= 0 and <= 1e+10 s"),
])
def test_trace_numbers_beyond_any_model_are_refused(tmp_path, field, value, needle):
    doc = {"id": "t", "block_size": 16, "requests": [_request(**{field: value})]}
    if field == "in":
        doc = {"id": "t", "block_size": 16, "requests": [_request(n_in=value, ids=[1] * (value // 16))]}
        doc["requests"][0]["hash_ids"] = [1, 2, 3, 4]
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    code, _, err, _ = cli("trace", "stats", str(p), "--json")
    assert code == 2 and str(p) in err and (needle in err or "hash_ids has" in err), err


def test_booleans_in_hash_ids_and_non_string_ids_are_refused(tmp_path):
    for doc in ({"id": "t", "block_size": 16, "requests": [_request(ids=[1, True, 3, 4])]},
                {"id": {"a": 1}, "block_size": 16, "requests": [_request()]},
                {"id": True, "block_size": 16, "requests": [_request()]}):
        p = tmp_path / "t.json"
        p.write_text(json.dumps(doc))
        code, _, err, _ = cli("trace", "stats", str(p), "--json")
        assert code == 2 and str(p) in err, err


# -- outputs ------------------------------------------------------------------------------------

def test_convert_onto_its_source_and_synth_over_a_file_keep_the_file(tmp_path):
    src = tmp_path / "s.jsonl"
    assert cli("trace", "synth", "--preset", "agentx-062126", "--sessions", "1", "--out", str(src))[0] == 0
    before = src.read_bytes()
    assert_clean(cli("trace", "convert", str(src), "--to", "weka", "--out", str(src)), ("--out",))
    assert_clean(cli("trace", "synth", "--preset", "agentx-062126", "--sessions", "1", "--seed", "-1", "--out", str(src)),
                 ("--seed",))
    assert_clean(cli("trace", "synth", "--preset", "agentx-062126", "--sessions", "1", "--out", str(src)), ("--out",))
    assert src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"]


def test_a_scenario_name_never_leaves_out(tmp_path):
    code, toml, _, _ = cli("scenario", "show", "mi355x-1p1d", "--toml")
    assert code == 0
    evil = tmp_path / "evil.toml"
    evil.write_text(toml.replace('name = "mi355x-1p1d"', 'name = "../../x"'))
    out = tmp_path / "a" / "b" / "out"
    r = cli("sim", "run", str(evil), "--sessions", "1", "--duration", "20", "--set", "workload.synthetic_sessions=2",
            "--out", str(out), "--json")
    assert_clean(r, ())
    assert r[0] == 0
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p != evil]
    assert written and all(out in p.parents for p in written), written


def test_out_that_is_a_file_is_a_clean_error(tmp_path):
    f = tmp_path / "f"
    f.write_text("keep")
    assert_clean(cli("sim", "run", "--sessions", "1", "--out", str(f)), ("--out",))
    assert f.read_text() == "keep"


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    from kvpool.outputs import atomic_path

    target = tmp_path / "x.json"
    target.write_text("old")
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as tmp:
        tmp.write_text("partial")
        raise KeyboardInterrupt
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_atomic_path_without_replace_never_clobbers(tmp_path):
    from kvpool.outputs import atomic_path

    target = tmp_path / "x.json"
    with atomic_path(target, replace=False) as tmp:
        tmp.write_text("new")
    assert target.read_text() == "new"
    with pytest.raises(FileExistsError), atomic_path(target, replace=False) as tmp:
        tmp.write_text("other")
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


# -- wide integers, slow hardware, NUMA placement ---------------------------------------------------

@pytest.mark.parametrize("literal", ["0x" + "F" * 4000, "0o" + "7" * 30, "0b" + "1" * 65, "9" * 5000, "[1, 0x" + "F" * 20 + "]"])
def test_an_integer_wider_than_64_bits_in_any_notation_is_one_error(tmp_path, literal):
    assert_clean(cli("scenario", "show", "mi355x-1p1d", "--set", f"pool.parts={literal}", "--json"), ("--set pool.parts",))
    code, toml, _, _ = cli("scenario", "show", "mi355x-1p1d", "--toml")
    f = tmp_path / "wide.toml"
    f.write_text(re.sub(r"(?m)^seed = .*$", f"seed = {literal}", toml))
    r = cli("scenario", "validate", str(f))
    assert_clean(r, (str(f),))
    assert r[0] == 2 and "wider than 64 bits" in r[2]


def test_digits_inside_a_string_are_not_an_integer(tmp_path):
    r = cli("scenario", "show", "mi355x-1p1d", "--set", 'description="build 1234567890123456789012345678"', "--json")
    assert r[0] == 0 and "1234567890123456789012345678" in _strict_json(r[1])["scenario"]["description"]


@pytest.mark.parametrize("name, text", [
    ("t.json", '{"id": "t", "block_size": 16, "requests": [{"t": 0, "type": "n", "in": 64, "out": %s, "hash_ids": [1, 2, 3, 4]}]}'),
    ("t.jsonl", '{"id": "t", "block_size": 16, "requests": [{"t": 0, "type": "n", "in": 64, "out": 8, "hash_ids": [1, %s]}]}\n'),
    ("m.jsonl", '{"timestamp": %s, "input_length": 1024, "output_length": 16, "hash_ids": [1, 2]}\n'),
])
def test_a_trace_number_of_thousands_of_digits_is_an_error_naming_the_file(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text % ("9" * 5000))
    r = cli("trace", "stats", str(p), "--json")
    assert_clean(r, (str(p),))
    assert r[0] == 2 and "more than 4300 digits" in r[2]


@pytest.mark.parametrize("field, below", [("gpu.dense_tflops", "1e-6"), ("gpu.hbm_tb_s", "5e-324"), ("gpu.nic_gb_s", "1e-12"),
                                          ("gpu.nic_writes_per_s", "1e-6"), ("cost.prefill_mfu", "1e-300"),
                                          ("cost.hbm_efficiency", "1e-300"), ("cost.unpack_gb_s", "1e-12")])
def test_a_rate_below_any_real_device_is_refused(field, below):
    r = cli("scenario", "show", "mi355x-1p1d", "--set", f"{field}={below}", "--json")
    assert_clean(r, (field,))
    assert r[0] == 2 and "greater than or equal to" in r[2]


def test_the_slowest_allowed_hardware_runs_within_the_bound_and_writes_finite_json(tmp_path):
    slow = ["gpu.dense_tflops=0.01", "gpu.hbm_tb_s=0.01", "gpu.nic_gb_s=0.001", "gpu.nic_writes_per_s=1",
            "cost.prefill_mfu=0.001", "cost.hbm_efficiency=0.001", "cost.unpack_gb_s=0.001", "cost.pool_load_gb_s=0.001"]
    for one in [[x] for x in slow] + [slow]:
        r = cli("sim", "run", "mi355x-1p1d", "--sessions", "1", "--duration", "20", "--set", "workload.synthetic_sessions=2",
                *[a for x in one for a in ("--set", x)], "--out", str(tmp_path), "--json")
        assert_clean(r, ())
        assert r[0] == 0, (one, r[2])
        assert all(math.isfinite(v) for v in _numbers(_strict_json(r[1])) if isinstance(v, float)), one


def test_a_link_at_a_large_clock_completes_its_transfers():
    """Past ~1e7 s a float clock no longer resolves 1e-9 s; a transfer there still completes."""
    import simpy

    from kvpool.sim.links import FairLink

    env = simpy.Environment(initial_time=1.5e13)
    link = FairLink(env, 1e9, latency_s=5e-6, writes_per_s=1e6, name="nic")
    done = [link.transfer(4096), link.transfer(1 << 20, writes=3)]
    t0 = time.monotonic()
    env.run(until=env.now + 10)
    assert all(ev.processed for ev in done) and time.monotonic() - t0 < 5


@pytest.mark.parametrize("numa, needle", [("1", "do not fit the NUMA nodes"), ("16", "exceeds cluster.gpus_per_server")])
def test_numa_nodes_that_cannot_hold_the_instances_are_one_error(tmp_path, numa, needle):
    r = cli("sim", "run", "mi355x-1p1d", "--sessions", "1", "--duration", "20", "--set", "workload.synthetic_sessions=2",
            "--set", f"cluster.numa_per_server={numa}", "--out", str(tmp_path), "--json")
    assert_clean(r, ("cluster.numa_per_server",))
    assert r[0] == 2 and needle in r[2] and not list(tmp_path.iterdir())


@pytest.mark.parametrize("overrides, needle", [
    (["cluster.numa_per_server=3"], "cluster.numa_per_server (3) must divide cluster.gpus_per_server (8)"),
    (["cluster.gpus_per_server=12", "cluster.numa_per_server=8"],
     "cluster.numa_per_server (8) must divide cluster.gpus_per_server (12)"),
    (["cluster.servers=4", "decode.tp=16"], "a decode instance of 16 GPUs is larger than one server"),
    (["cluster.servers=4", "prefill.tp=3"], "a prefill instance of 12 GPUs is larger than one server"),
    (["pool.ssd.enabled=true", "pool.ssd.gib_per_server=64", "pool.services_per_server=0"],
     "pool.ssd.enabled needs a DRAM pool above it"),
    (["pool.ssd.enabled=true", "pool.ssd.gib_per_server=64", "pool.gib_per_service=0"],
     "pool.ssd.enabled needs a DRAM pool above it"),
])
def test_layouts_that_cannot_exist_are_one_error(tmp_path, overrides, needle):
    sets = [a for o in overrides for a in ("--set", o)]
    r = cli("scenario", "validate", "mi355x-1p1d", *sets)
    assert_clean(r, (needle,))
    assert r[0] == 2
    r = cli("sim", "run", "mi355x-1p1d", "--sessions", "1", "--duration", "20", "--set", "workload.synthetic_sessions=2",
            *sets, "--out", str(tmp_path), "--json")
    assert_clean(r, (needle,))
    assert r[0] == 2 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("numa", ["2", "4", "8"])
def test_numa_nodes_that_divide_the_server_and_hold_the_instances_validate(numa):
    code, out, err, _ = cli("scenario", "validate", "mi355x-1p1d", "--set", f"cluster.numa_per_server={numa}")
    assert code == 0 and out.startswith("ok: mi355x-1p1d"), err


def test_a_gate_that_admits_nothing_says_so_not_that_the_window_is_short(tmp_path):
    code, out, err, _ = cli("sim", "run", "mi355x-1p1d", "--sessions", "1", "--duration", "60",
                            "--set", "workload.synthetic_sessions=2", "--set", "gate.enabled=true",
                            "--set", "gate.tokens_per_decode=1000", "--set", "gate.max_wait_s=1",
                            "--out", str(tmp_path), "--json")
    assert code == 0, err
    doc = _strict_json(out)
    assert doc["results"][0]["requests"] == 0 and doc["results"][0]["rejected"] > 0
    (warning,) = doc["warnings"]
    assert "the admission gate rejected" in warning and "gate.tokens_per_decode x gate.budget_fraction" in warning
    assert "give a longer --duration" not in warning


@pytest.mark.parametrize("overrides, flags", [
    (["workload.synthetic_sessions=1025"], ["--sessions", "1025"]),
    (["workload.synthetic_sessions=600", "workload.context_scale=2"], ["--sessions", "600", "--context-scale", "2"]),
    (["workload.synthetic_sessions=103", "workload.context_scale=10"], ["--sessions", "103", "--context-scale", "10"]),
])
def test_a_synthetic_workload_too_large_to_build_in_the_bound_is_one_error(tmp_path, overrides, flags):
    """The synthetic build's time grows with sessions x max(1, context_scale); past 1024 it is one
    error, from a scenario and from trace synth alike, and nothing is written."""
    sets = [a for o in overrides for a in ("--set", o)]
    r = cli("sim", "run", "mi355x-1p1d", "--sessions", "1", "--duration", "20", *sets, "--out", str(tmp_path), "--json")
    assert_clean(r, ("workload.synthetic_sessions", "synthetic_sessions x context_scale"))
    assert r[0] == 2 and not list(tmp_path.iterdir())
    r = cli("trace", "synth", "--preset", "agentx-062126", *flags, "--out", str(tmp_path / "s.jsonl.gz"))
    assert_clean(r, ("--sessions",), json_out=False)
    assert r[0] == 2 and not list(tmp_path.iterdir())


def test_a_synthetic_workload_at_the_bound_validates():
    for sets in (["workload.synthetic_sessions=1024"], ["workload.synthetic_sessions=102", "workload.context_scale=10"],
                 ["workload.synthetic_sessions=1024", "workload.context_scale=0.5"]):
        code, out, err, _ = cli("scenario", "validate", "mi355x-1p1d", *[a for o in sets for a in ("--set", o)])
        assert code == 0, err
