"""policy.prefill_request: the load, the compute ranges, the save floor and the record fields of one
request's prefill, and the order of its events."""

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.policy.hits import compute_hits
from kvpool.policy.prefill_request import ChunkRange, Phase, PrefillOrderError, PrefillRequest
from kvpool.workload.records import RequestRecord

C = 256  # tokens per chunk
P = 16  # tokens per page


def looked_up(prompt_tokens: int, gpu_tokens: int, pool_chunks: int, answered: bool = True) -> PrefillRequest:
    """A request whose lookup found ``gpu_tokens`` on the GPU and ``pool_chunks`` on every stage."""
    life = PrefillRequest(prompt_tokens, C)
    present = [[c < pool_chunks for c in range(prompt_tokens // C)]] * 2 if answered else None
    life.looked_up(compute_hits(prompt_tokens, gpu_tokens, present, chunk_tokens=C, page_tokens=P), answered)
    return life


def range_tokens(life: PrefillRequest) -> int:
    return sum(end - start for start, end in life.compute_ranges)


def test_a_loaded_request_computes_up_to_the_load_and_after_it():
    life = looked_up(6 * C + 40, 300, 5)  # GPU: 288 tokens in pages; the load starts at chunk 2
    assert life.load == ChunkRange(2, 5) and life.load.chunks == 3
    life.loaded(ok=True)
    assert life.compute_ranges == ((288, 2 * C), (5 * C, 6 * C + 40))
    assert range_tokens(life) == life.account.computed_tokens == 224 + C + 40
    acc = life.account
    assert (acc.gpu_tokens, acc.pool_tokens, acc.restore_failed, acc.lookup_answered) == (288, 3 * C, False, True)


def test_a_load_from_the_gpu_hit_computes_only_after_it():
    life = looked_up(4 * C + 1, 2 * C, 4)
    life.loaded(ok=True)
    assert life.compute_ranges == ((4 * C, 4 * C + 1),)


def test_a_full_prompt_hit_leaves_its_last_page_to_compute():
    life = looked_up(2 * C, 0, 2)
    assert life.load == ChunkRange(0, 2) and life.account.pool_tokens == 2 * C - P
    life.loaded(ok=True)
    assert life.compute_ranges == ((2 * C - P, 2 * C),)
    assert life.account.computed_tokens == P


def test_a_failed_load_recomputes_from_the_gpu_hit_and_lowers_the_save_floor():
    life = looked_up(6 * C + 40, 300, 5)
    assert life.save_floor_chunks == 5  # the pool held chunks 0..4 at lookup
    acc = life.loaded(ok=False)
    assert life.compute_ranges == ((288, 6 * C + 40),)
    assert (acc.gpu_tokens, acc.pool_tokens, acc.computed_tokens, acc.restore_failed) == (288, 0, 6 * C + 40 - 288, True)
    assert life.save_floor_chunks == 2  # the load's first chunk: chunks 2..4 are recomputed, so saved
    life.computed()
    assert life.start_save(6) == ChunkRange(2, 6)


def test_without_a_load_the_pool_prefix_is_not_saved_again():
    life = looked_up(6 * C, 5 * C, 3)  # the GPU hit covers the pool's three chunks: nothing to load
    assert life.load is None and life.save_floor_chunks == 3
    assert life.compute_ranges == ((5 * C, 6 * C),)
    life.computed()
    assert life.start_save(6) == ChunkRange(3, 6)


def test_an_unanswered_lookup_loads_nothing_and_saves_from_chunk_zero():
    life = looked_up(3 * C + 5, 0, 0, answered=False)
    assert life.load is None and life.compute_ranges == ((0, 3 * C + 5),)
    acc = life.account
    assert (acc.pool_tokens, acc.computed_tokens, acc.lookup_answered, acc.restore_failed) == (0, 3 * C + 5, False, False)
    life.computed()
    assert life.start_save(3) == ChunkRange(0, 3)


def test_a_recheck_before_the_load_decides_the_load_and_the_floor():
    life = looked_up(6 * C, 0, 5)
    hit = compute_hits(6 * C, 0, [[c < 3 for c in range(6)]] * 2, chunk_tokens=C, page_tokens=P)
    assert life.looked_up(hit, True) == ChunkRange(0, 3)  # chunks 3, 4 went meanwhile
    assert life.save_floor_chunks == 3
    no_answer = compute_hits(6 * C, 0, None, chunk_tokens=C, page_tokens=P)
    assert life.looked_up(no_answer, False) is None  # a recheck without an answer: compute everything
    assert life.save_floor_chunks == 3 and not life.account.lookup_answered and life.account.pool_tokens == 0


def test_saves_go_one_at_a_time_and_a_failed_save_leaves_the_floor():
    life = looked_up(8 * C + 1, 0, 3, answered=True)
    life.loaded(ok=True)
    life.computed(5 * C + 100)  # KV of chunks 3, 4 exists so far
    assert life.start_save(8) == ChunkRange(3, 5)
    assert life.start_save(8) is None  # one in flight
    life.saved(stored=True)
    life.computed()
    assert life.start_save(8) == ChunkRange(5, 8)
    life.saved(stored=False)  # not stored: the next save tries the same chunks
    assert life.save_floor_chunks == 5 and life.start_save(8) == ChunkRange(5, 8)
    life.saved(stored=True)
    assert life.start_save(8) is None  # nothing new
    assert life.start_save(9) is None  # keyed chunks beyond the computed KV do not count


def test_keyed_chunks_bound_the_save():
    life = looked_up(8 * C, 0, 0)
    life.computed()
    assert life.start_save(6) == ChunkRange(0, 6)  # only six chunks have a key


def test_the_request_ends_once_its_hand_off_ended_and_no_save_is_in_flight():
    life = looked_up(3 * C, 0, 0)
    life.computed()
    assert life.start_save(3) is not None
    life.handed_off()
    assert not life.ended
    life.saved(stored=True)
    assert life.ended


@pytest.mark.parametrize("event", ["loaded", "computed", "compute_ranges", "start_save", "handed_off", "account"])
def test_events_out_of_order_raise(event):
    life = PrefillRequest(3 * C, C)
    with pytest.raises(PrefillOrderError):  # nothing before the lookup
        {"loaded": lambda: life.loaded(True), "computed": life.computed,
         "compute_ranges": lambda: life.compute_ranges, "start_save": lambda: life.start_save(3),
         "handed_off": life.handed_off, "account": lambda: life.account}[event]()


def test_a_load_under_way_holds_back_compute_and_save_and_a_load_outcome_needs_a_load():
    life = looked_up(4 * C + 1, 0, 4)
    assert life.phase is Phase.LOOKED_UP and not life.ready_to_compute
    with pytest.raises(PrefillOrderError):
        life.compute_ranges
    with pytest.raises(PrefillOrderError):
        life.computed()
    life.loaded(ok=True)
    with pytest.raises(PrefillOrderError):
        life.loaded(ok=True)  # once
    with pytest.raises(PrefillOrderError):
        life.looked_up(compute_hits(4 * C + 1, 0, None, chunk_tokens=C), True)  # no lookup after the load
    with pytest.raises(PrefillOrderError):
        looked_up(4 * C, 0, 0).loaded(ok=False)  # no load was planned
    with pytest.raises(PrefillOrderError, match="no save in flight"):
        life.saved(stored=True)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="prompt has"):
        PrefillRequest(100, C).looked_up(compute_hits(99, 0, None, chunk_tokens=C), True)
    with pytest.raises(ValueError, match="chunk_tokens"):
        PrefillRequest(100, 0)
    life = looked_up(2 * C, 0, 0)
    life.computed(C)
    with pytest.raises(ValueError, match="kv_tokens"):
        life.computed(C - 1)  # the computed KV only grows
    with pytest.raises(ValueError, match="kv_tokens"):
        life.computed(2 * C + 1)


@dataclass
class _Fields:
    gpu_tokens: int = -1
    pool_tokens: int = -1
    ssd_tokens: int = -1
    computed_tokens: int = -1
    restore_failed: bool = True
    lookup_answered: bool = False


def test_the_account_writes_the_records_fields_and_keeps_an_ssd_share_of_the_pool_tokens():
    life = looked_up(5 * C, 0, 4)
    rec = RequestRecord("r", in_tokens=5 * C)
    life.loaded(ok=True).write(rec, ssd_tokens=C)
    assert (rec.gpu_tokens, rec.pool_tokens, rec.ssd_tokens, rec.computed_tokens) == (0, 3 * C, C, C)
    assert not rec.restore_failed and rec.lookup_answered
    failed = looked_up(5 * C, 0, 4)
    f = _Fields()
    failed.loaded(ok=False).write(f, ssd_tokens=C)  # a failed load: no SSD share either
    assert (f.gpu_tokens, f.pool_tokens, f.ssd_tokens, f.computed_tokens, f.restore_failed, f.lookup_answered) == (
        0, 0, 0, 5 * C, True, True)


@given(prompt=st.integers(1, 12 * C), gpu=st.integers(0, 12 * C), pool_chunks=st.integers(0, 12),
       answered=st.booleans(), load_ok=st.booleans())
def test_ranges_cover_exactly_the_computed_tokens_after_the_gpu_hit(prompt, gpu, pool_chunks, answered, load_ok):
    life = looked_up(prompt, gpu, pool_chunks, answered)
    if life.load is not None:
        life.loaded(load_ok)
    acc = life.account
    assert acc.gpu_tokens + acc.pool_tokens + acc.computed_tokens == prompt
    ranges = life.compute_ranges
    assert range_tokens(life) == acc.computed_tokens >= 1
    assert all(a < b for a, b in ranges) and all(x[1] <= y[0] for x, y in zip(ranges, ranges[1:]))
    assert ranges[-1][1] == prompt  # the last token is computed
    if life.load is not None and load_ok:
        start = life.load.first_chunk * C
        assert [a for a, b in ranges if a < start + acc.pool_tokens and b > start] == []  # nothing loaded is computed
        assert ranges[0][0] == (acc.gpu_tokens if acc.gpu_tokens < start else start + acc.pool_tokens)
    else:
        assert ranges == ((acc.gpu_tokens, prompt),)  # from the GPU hit
