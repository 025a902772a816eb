"""policy.hits: the all-stage rule, chunk alignment, minimum load, the last token."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvpool.policy.hits import compute_hits, leading_run

C = 256


def present(n_chunks, *runs):
    return [[i < r for i in range(n_chunks)] for r in runs]


def test_pool_prefix_is_the_minimum_over_stages():
    h = compute_hits(10 * C, 0, present(10, 8, 6, 9, 8), chunk_tokens=C)
    assert (h.gpu_tokens, h.pool_tokens, h.computed_tokens) == (0, 6 * C, 4 * C)
    assert h.pool_prefix_chunks == 6
    assert h.stranded_objects == 2 + 0 + 3 + 2


def test_a_hole_in_one_stage_stops_the_prefix():
    stages = present(8, 8, 8, 8, 8)
    stages[2][3] = False
    h = compute_hits(8 * C, 0, stages, chunk_tokens=C)
    assert h.pool_tokens == 3 * C


def test_gpu_hit_counts_whole_pages_and_load_starts_on_chunk_boundary():
    h = compute_hits(10 * C, 300, present(10, 9, 9, 9, 9), chunk_tokens=C, page_tokens=16)
    assert h.gpu_tokens == 288  # 300 rounded down to pages of 16
    assert h.load_first_chunk == 2  # ceil(288 / 256)
    assert h.pool_tokens == 9 * C - 2 * C
    assert h.computed_tokens == 10 * C - 288 - 7 * C


def test_pool_never_below_gpu_hit():
    h = compute_hits(10 * C, 8 * C, present(10, 6, 6, 6, 6), chunk_tokens=C)
    assert h.pool_tokens == 0 and h.gpu_tokens == 8 * C


def test_min_load_threshold_recomputes_small_loads():
    stages = present(100, 40, 40, 40, 40)
    assert compute_hits(100 * C, 0, stages, chunk_tokens=C, min_load_tokens=8192).pool_tokens == 40 * C
    small = compute_hits(100 * C, 36 * C, stages, chunk_tokens=C, min_load_tokens=8192)
    assert small.pool_tokens == 0 and small.computed_tokens == 64 * C


def test_full_prompt_hit_computes_the_last_tokens_page():
    h = compute_hits(4 * C, 0, present(4, 4, 4), chunk_tokens=C)
    assert (h.pool_tokens, h.computed_tokens) == (4 * C - 16, 16)
    assert (h.load_first_chunk, h.load_end_chunk) == (0, 4)  # the last chunk loads whole
    odd = compute_hits(4 * C + 1, 0, present(4, 4, 4), chunk_tokens=C)
    assert (odd.pool_tokens, odd.computed_tokens) == (4 * C, 1)  # the last token starts a page of its own
    g = compute_hits(4 * C, 4 * C, None, chunk_tokens=C)
    assert (g.gpu_tokens, g.computed_tokens) == (4 * C - 16, 16)


def test_no_pool():
    h = compute_hits(1000, 512, None, chunk_tokens=C)
    assert (h.gpu_tokens, h.pool_tokens, h.computed_tokens) == (512, 0, 488)
    assert compute_hits(0, 0, None).prompt_tokens == 0


def test_leading_run():
    assert leading_run([True, True, False, True]) == 2 and leading_run([]) == 0


@given(
    st.integers(1, 40 * C),
    st.integers(0, 40 * C),
    st.lists(st.lists(st.booleans(), min_size=0, max_size=40), min_size=1, max_size=4),
    st.sampled_from([0, 1024, 8192]),
)
def test_invariants(prompt, gpu, stages, min_load):
    n_chunks = prompt // C
    stages = [s[:n_chunks] for s in stages]
    h = compute_hits(prompt, gpu, stages, chunk_tokens=C, min_load_tokens=min_load)
    assert h.gpu_tokens + h.pool_tokens + h.computed_tokens == prompt
    assert h.computed_tokens >= 1
    assert h.gpu_tokens % 16 == 0 and h.gpu_tokens <= gpu
    common = min(leading_run(s) for s in stages)
    if h.pool_tokens:
        assert h.pool_tokens >= max(1, min_load)
        assert h.load_first_chunk * C >= h.gpu_tokens
        assert h.load_end_chunk <= common
        assert h.load_first_chunk * C + h.pool_tokens <= common * C


@given(st.lists(st.booleans(), max_size=50))
def test_leading_run_numpy_matches_python(bits):
    import numpy as np

    assert leading_run(np.array(bits, dtype=bool)) == leading_run(bits)


@given(
    st.integers(1, 40 * C),
    st.integers(0, 40 * C),
    st.integers(1, 4).flatmap(lambda n: st.lists(st.lists(st.booleans(), min_size=40, max_size=40),
                                                  min_size=n, max_size=n)),
    st.sampled_from([0, 1024]),
)
def test_a_stage_by_chunk_array_gives_the_same_split_as_lists(prompt, gpu, stages, min_load):
    import numpy as np

    stages = [s[: prompt // C] for s in stages]
    as_lists = compute_hits(prompt, gpu, stages, chunk_tokens=C, min_load_tokens=min_load)
    as_array = compute_hits(prompt, gpu, np.array(stages, dtype=bool).reshape(len(stages), -1),
                            chunk_tokens=C, min_load_tokens=min_load)
    assert as_array == as_lists


@given(st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=4),
       st.integers(0, 2000), st.integers(0, 2000), st.integers(0, 600))
def test_stage_runs_decide_as_the_presence_rows(rows, prompt, gpu, min_load):
    """Given each stage's leading run instead of its row, the split is the same."""
    present = np.array(rows, dtype=bool)
    runs = [leading_run(r) for r in rows]
    kw = dict(chunk_tokens=256, page_tokens=16, min_load_tokens=min_load)
    assert compute_hits(prompt, gpu, None, stage_runs=runs, **kw) == compute_hits(prompt, gpu, present, **kw)
