"""The policy core's result types keep the frozen-dataclass contract (``HitResult`` with its
hand-written, faster initialiser; ``PutOutcome`` slotted): fields by position and name, defaults,
equality, hashing, immutability."""

import dataclasses

import numpy as np
import pytest

from kvpool.policy.grouptable import PutOutcome
from kvpool.policy.hits import HitResult


def test_hit_result_is_a_frozen_dataclass():
    h = HitResult(1, 2, 3, load_end_chunk=5)
    assert (h.gpu_tokens, h.pool_tokens, h.computed_tokens, h.load_first_chunk, h.load_end_chunk,
            h.pool_prefix_chunks, h.stranded_objects) == (1, 2, 3, 0, 5, 0, 0)
    assert h == HitResult(1, 2, 3, 0, 5) and hash(h) == hash(HitResult(1, 2, 3, 0, 5)) and h != HitResult(1, 2, 4)
    assert [f.name for f in dataclasses.fields(h)] == list(vars(h))
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.gpu_tokens = 7
    assert h.prompt_tokens == 6 and dataclasses.replace(h, pool_tokens=0).load_chunks == 0


def test_put_outcome_is_a_frozen_dataclass():
    p = PutOutcome(1, 2, 3, 4)
    assert p.evicted_ids.dtype == np.int64 and p.evicted_ids.size == 0
    assert p == PutOutcome(1, 2, 3, 4, np.arange(3))  # evicted_ids are not compared
    assert [f.name for f in dataclasses.fields(p)] == list(PutOutcome.__slots__) and not hasattr(p, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.stored = 0
