"""Result types made in large numbers per run are slotted frozen dataclasses: fields by position
and name, defaults, equality, hashing, immutability, no instance dict (and a hit result
pickles); ``PutOutcome`` too."""

import dataclasses
import pickle

import numpy as np
import pytest

from kvpool.policy.grouptable import PutOutcome
from kvpool.policy.hits import HitResult
from kvpool.workload import Workload
from kvpool.workload.replay import AgentXReplay, Wake
from kvpool.workload.weka import session_from_weka


def _is_slotted_frozen(obj, change: str) -> None:
    assert not hasattr(obj, "__dict__")
    assert type(obj).__slots__ == tuple(f.name for f in dataclasses.fields(obj))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, change, 7)


def test_hit_result_is_a_slotted_frozen_dataclass():
    h = HitResult(1, 2, 3, load_end_chunk=5)
    assert (h.gpu_tokens, h.pool_tokens, h.computed_tokens, h.load_first_chunk, h.load_end_chunk,
            h.pool_prefix_chunks, h.stranded_objects) == (1, 2, 3, 0, 5, 0, 0)
    assert h == HitResult(1, 2, 3, 0, 5) and hash(h) == hash(HitResult(1, 2, 3, 0, 5)) and h != HitResult(1, 2, 4)
    assert h != (1, 2, 3, 0, 5, 0, 0)  # a value of its own type, not a tuple
    _is_slotted_frozen(h, "gpu_tokens")
    assert pickle.loads(pickle.dumps(h)) == h
    assert h.prompt_tokens == 6 and dataclasses.replace(h, pool_tokens=0).load_chunks == 0


def test_dispatch_and_wake_are_slotted_frozen_dataclasses():
    doc = {"id": "s", "models": ["m"], "block_size": 64, "hash_id_scope": "local", "requests": [
        {"t": 0.0, "type": "n", "in": 300, "out": 8, "hash_ids": [1, 2, 3, 4, 5], "api_time": 1.0, "think_time": 0.0}]}
    w = AgentXReplay(Workload((session_from_weka(doc),)), lanes=1, seed=0, warmup=False, recycle=False).start(0.0)
    (d,) = w.ready
    assert (d.lane, d.play, d.scope, d.out_tokens, d.phase, d.due_s) == (0, 0, "s#p0", 8, "profile", 0.0)
    assert d.measured and d.in_tokens == 300 and d.block_ids().size == 5
    assert not dataclasses.replace(d, phase="warmup").measured
    assert d == dataclasses.replace(d) and d != dataclasses.replace(d, key=d.key + 1)
    _is_slotted_frozen(d, "key")
    assert w == Wake((d,), w.next_due_s, False) and w != Wake((), w.next_due_s, True)
    _is_slotted_frozen(w, "done")


def test_put_outcome_is_a_frozen_dataclass():
    p = PutOutcome(1, 2, 3, 4)
    assert p.evicted_ids.dtype == np.int64 and p.evicted_ids.size == 0
    assert p == PutOutcome(1, 2, 3, 4, np.arange(3))  # evicted_ids are not compared
    assert [f.name for f in dataclasses.fields(p)] == list(PutOutcome.__slots__) and not hasattr(p, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.stored = 0
