"""Built-in scenarios load, and what follows from them matches the seed's figures."""

import pytest

from kvpool.scenario import builtin_names, load_scenario, summarize
from kvpool.scenario.derive import TIB
from kvpool.scenario.load import ScenarioError, read_raw, to_toml, validate

SEED_SCENARIOS = {
    "mi355x-1p1d", "mi350x-6p2d-shared", "mi350x-6p2d-split",
    "mi350x-6p2d-tp4-replay-shared", "mi350x-6p2d-tp4-replay-split", "h200-1p1d",
}


def test_every_seed_deployment_is_built_in():
    assert SEED_SCENARIOS <= set(builtin_names())


@pytest.mark.parametrize("name", sorted(SEED_SCENARIOS))
def test_builtin_loads_and_round_trips_through_toml(name, tmp_path):
    s = load_scenario(name)
    assert s.name == name
    p = tmp_path / "x.toml"
    p.write_text(to_toml(s))
    assert load_scenario(p) == s


def test_mi355x_matches_the_seed():
    d = summarize(load_scenario("mi355x-1p1d"))
    assert d["kv_bytes_per_token"] == 48_672
    assert d["pool_capacity_bytes"] == 1.5 * TIB
    assert d["handoff_writes_naive"] == 163_840 and d["handoff_writes_batched"] == 12
    # "nearly four times the KV space of the prefill GPUs" (~0.4 TiB)
    assert 0.38 < d["prefill_gpu_kv_bytes"] / TIB < 0.42
    assert 3.5 < d["pool_to_prefill_gpu_kv_ratio"] < 4.0
    assert d["pool_capacity_tokens"] == d["pool_capacity_bytes"] // 48_672
    assert d["prefill_gpu_kv_capacity_tokens"] == pytest.approx(d["prefill_gpu_kv_bytes"] / 4 / 12_528, abs=1)


def test_four_server_pool_is_about_3_tib():
    for arm in ("shared", "split"):
        d = summarize(load_scenario(f"mi350x-6p2d-{arm}"))
        assert d["pool_capacity_bytes"] == 32 * 96 * (1 << 30)
        assert d["gpus"] == 32


def test_tp4_prefill_keeps_one_copy_per_rank():
    d = summarize(load_scenario("mi350x-6p2d-tp4-replay-shared"))
    assert d["pool_copies_per_token"] == 4
    assert d["pool_capacity_tokens"] == d["pool_capacity_bytes"] // (4 * 48_672)
    pp4 = summarize(load_scenario("mi350x-6p2d-shared"))  # the same pool, one copy per token
    assert d["pool_sessions_10gib"] * 4 == pytest.approx(pp4["pool_sessions_10gib"])


def test_set_overrides_fields():
    s = load_scenario("mi355x-1p1d", ["pool.gib_per_service=0", "workload.sessions=112", 'pool.mode="split"'])
    assert s.pool.gib_per_service == 0 and s.workload.sessions == 112 and s.pool.mode == "split"
    assert summarize(s)["pool_capacity_bytes"] == 0
    assert load_scenario("mi355x-1p1d", ["pool.mode=split"]).pool.mode == "split"  # bare strings too


@pytest.mark.parametrize(
    "override, needle",
    [
        ("pool.gib_per_servce=1", "pool has no field 'gib_per_servce'; allowed: mode, parts"),
        ("pool.mode=mirrored", "pool.mode: value 'mirrored': Input should be 'shared' or 'split'"),
        ("decode.dcp=3", "decode.dcp (3) must divide decode.tp (4)"),
        ("prefill.stage_layers=[20,20,20]", "prefill.stage_layers has 3 stages but prefill.pp is 4"),
        ("pool.high_watermark=1.5", "pool.high_watermark: value 1.5: Input should be less than or equal to 1"),
        ("cluster.servers=0", "cluster.servers: value 0: Input should be greater than 0"),
        ("nonsense", "expected section.field=value"),
    ],
)
def test_bad_overrides_name_the_field(override, needle):
    with pytest.raises(ScenarioError) as e:
        load_scenario("mi355x-1p1d", [override])
    assert needle in str(e.value)


def test_bad_file_names_file_and_field(tmp_path):
    raw, _ = read_raw("mi355x-1p1d")
    raw["gpu"]["hbm_gb"] = -1
    del raw["model"]["layers"]
    raw["pool"]["colour"] = "blue"
    with pytest.raises(ScenarioError) as e:
        validate(raw, "my.toml")
    msg = str(e.value)
    assert "my.toml: gpu.hbm_gb: value -1: Input should be greater than 0" in msg
    assert "my.toml: model.layers: required field is missing" in msg
    assert "my.toml: pool.colour: unknown field; allowed:" in msg


def test_not_toml_and_missing_file(tmp_path):
    p = tmp_path / "broken.toml"
    p.write_text("[pool\nmode = 1\n")
    with pytest.raises(ScenarioError, match="broken.toml: not valid TOML"):
        load_scenario(p)
    with pytest.raises(ScenarioError, match="no such scenario file"):
        load_scenario(tmp_path / "missing.toml")
    with pytest.raises(ScenarioError, match="built-in: "):
        load_scenario("no-such-name")


def test_docs_field_reference_is_generated_from_the_model():
    from pathlib import Path

    from kvpool.scenario.docgen import fields_markdown

    doc = (Path(__file__).resolve().parents[2] / "docs" / "scenario.md").read_text()
    assert fields_markdown() in doc, "docs/scenario.md is stale: regenerate with python -m kvpool.scenario.docgen"
