"""sim.pool: the per-rank leading runs agree with the presence rows."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.policy.grouptable import GroupIds
from kvpool.policy.hits import leading_run
from kvpool.scenario import load_scenario
from kvpool.sim.pool import SimPool


@pytest.mark.parametrize("name", ["mi355x-1p1d", "mi350x-6p2d-shared", "mi350x-6p2d-tp4-replay-split"])
def test_lookup_runs_are_the_leading_runs_of_lookup(name):
    """Saves of random prefixes by random rank counts, then every rank's run equals the leading
    run of its row in ``lookup``, and both touch the same groups."""
    s = load_scenario(name)
    ranks = s.prefill.pp * s.prefill.tp
    sizes = [1 << 20] * ranks
    a, b = SimPool(s, sizes), SimPool(s, sizes)
    rng = np.random.default_rng(7)
    for i in range(200):
        k = int(rng.integers(1, 30))
        gids = GroupIds(np.arange(k) if i % 2 else np.unique(rng.integers(0, 60, size=k)), 59)  # prompts, scattered
        n = int(rng.integers(1, ranks + 1))
        a.save(0, n, gids, float(i))
        b.save(0, n, gids, float(i))
        m = int(rng.integers(1, 40))
        query = GroupIds(np.arange(m) if i % 3 else rng.permutation(60)[:m], 59)  # distinct groups below 60
        n = int(rng.integers(1, ranks + 1))
        rows = a.lookup(0, n, query, float(i) + 0.5)
        assert b.lookup_runs(0, n, query, float(i) + 0.5) == [leading_run(r) for r in rows]
        for ta, tb in zip(a.tables[0], b.tables[0]):
            assert np.array_equal(ta._last, tb._last) and np.array_equal(ta._count, tb._count)
