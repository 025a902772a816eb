"""policy.kvspec: KV geometry of real layouts."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.policy.kvspec import ExtraRecord, KVSpec, every_kth_layer


def glm52(stage_layers=(20, 20, 20, 18)) -> KVSpec:
    idx = every_kth_layer(78, 3, 4, 6) + (78,)
    return KVSpec("GLM-5.2", 78, 576, tuple(stage_layers), mtp_layers=1,
                  extra_records=(ExtraRecord("indexer", 144, idx),))


def test_glm52_indexer_schedule_has_21_layers():
    ids = every_kth_layer(78, 3, 4, 6)
    assert len(ids) == 21
    assert ids[:5] == (0, 1, 2, 6, 10) and ids[-1] == 74


def test_seed_bytes_per_token():
    # 79 MLA slices x 576 + 22 indexer slices x 144 = the seed's 48,672 B/token
    assert glm52().bytes_per_token == 48_672


def test_stage_bytes_sum_and_mtp_on_last_stage():
    spec = glm52()
    assert sum(spec.stage_bytes_per_token) == spec.bytes_per_token
    assert 78 in spec.stage_layer_ids(3) and 78 not in spec.stage_layer_ids(0)
    # stage 0: 20 layers, indexer on 0,1,2,6,10,14,18
    assert spec.stage_bytes_per_token[0] == 20 * 576 + 7 * 144


def test_pure_mla_deepseek_v3():
    spec = KVSpec("DeepSeek-V3", 61, 576, (61,))
    assert spec.bytes_per_token == 35_136


def test_chunk_object_bytes():
    spec = glm52()
    assert spec.chunk_object_bytes(0, 256) == 256 * spec.stage_bytes_per_token[0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(stage_layers=(20, 20)), "sum to 40"),
        (dict(stage_layers=(78, 0)), "positive"),
        (dict(record_bytes=0), "record_bytes"),
        (dict(extra_records=(ExtraRecord("x", 8, (200,)),)), "out of range"),
    ],
)
def test_bad_geometry_is_rejected(kwargs, match):
    base = dict(model="m", layers=78, record_bytes=576, stage_layers=(78,))
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KVSpec(**base)


@given(st.lists(st.integers(1, 30), min_size=1, max_size=8), st.integers(1, 2048), st.integers(0, 2))
def test_stage_split_never_changes_total(split, record, mtp):
    layers = sum(split)
    one = KVSpec("m", layers, record, (layers,), mtp_layers=mtp)
    many = KVSpec("m", layers, record, tuple(split), mtp_layers=mtp)
    assert one.bytes_per_token == many.bytes_per_token == (layers + mtp) * record
    ids = [i for s in range(many.stages) for i in many.stage_layer_ids(s)]
    assert sorted(ids) == list(range(layers + mtp))
