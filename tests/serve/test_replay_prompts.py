"""Replay prompts: deterministic token ids from hash ids, prefix-consistent within a session, and
the token-scale rule (``workload.token_scale``)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from kvpool.backend.serve.prompts import PromptBuilder
from kvpool.workload.load import load_workload
from kvpool.workload.replay import AgentXReplay, ProductionReplay, run_fixed_latency
from kvpool.workload.token_scale import scaled_block_tokens, scaled_prompt_tokens

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
EOS = 256


@pytest.fixture(scope="module")
def weka():
    return load_workload(TRACES / "kv-cache-tester" / "trace_0014.json.gz")


def _dispatches(workload, lanes=1):
    replay = AgentXReplay(workload, lanes=lanes, seed=3, warmup=False, idle_cap_s=1.0, recycle=False)
    return [s.dispatch for s in run_fixed_latency(replay, lambda d: 0.5)]


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(diff[0]) if len(diff) else n


def test_the_scale_rule():
    assert [scaled_block_tokens(64, f) for f in (1, 0.5, 1 / 64, 1 / 1000)] == [64, 32, 1, 1]
    assert scaled_block_tokens(512, 1 / 64) == 8
    # whole blocks keep b tokens each; only the part past them is rounded (half up)
    assert scaled_prompt_tokens(64 * 10 + 31, 64, 1 / 64) == 10
    assert scaled_prompt_tokens(64 * 10 + 32, 64, 1 / 64) == 11
    assert scaled_prompt_tokens(5, 64, 1 / 64) == 1
    assert scaled_prompt_tokens(1000, 512, 1 / 64) == 16  # 1000 * 8 / 512 = 15.6
    for n in (1, 63, 64, 65, 100_003):
        assert scaled_prompt_tokens(n, 64, 1.0) == n
    for bad in (0, -1, 1.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="token scale"):
            scaled_block_tokens(64, bad)


def test_prompts_are_deterministic_and_in_the_vocabulary(weka):
    ds = _dispatches(weka)
    a, b = PromptBuilder(512), PromptBuilder(512)
    for d in ds[:6]:
        p = a.prompt(d)
        assert p == b.prompt(d) == a.prompt(d)
        assert len(p) == d.in_tokens == a.prompt_tokens(d)
        arr = np.asarray(p)
        assert arr.min() >= 0 and arr.max() < 512 and not (arr == EOS).any()
    # a vocabulary just above EOS still avoids it
    tight = np.asarray(PromptBuilder(257).prompt(ds[0]))
    assert tight.max() <= 256 and not (tight == EOS).any() and len(set(tight.tolist())) > 200


@pytest.mark.parametrize("scale", [1.0, 1 / 64, 1 / 8])
def test_equal_hash_prefixes_give_equal_token_prefixes(weka, scale):
    ds = _dispatches(weka)
    builder = PromptBuilder(512, scale)
    b = scaled_block_tokens(weka.sessions[0].block_tokens, scale)
    prompts = [(d, builder.prompt(d)) for d in ds]
    pairs = 0
    for (d1, p1), (d2, p2) in zip(prompts, prompts[1:]):
        h1, h2 = d1.block_ids(), d2.block_ids()
        shared = _common_prefix(h1, h2)
        tokens = _common_prefix(p1, p2)
        limit = min(len(p1), len(p2))
        assert tokens >= min(shared * b, limit)
        if shared < min(len(h1), len(h2)) and (shared + 1) * b <= limit:  # the first differing block differs
            assert tokens < (shared + 1) * b
        pairs += shared > 0
    assert pairs > 5  # the session's turns do share prefixes


def test_plays_never_share_tokens_and_global_ids_do(weka):
    replay = AgentXReplay(list(weka) * 1, lanes=2, seed=3, warmup=False, idle_cap_s=1.0, recycle=False)
    ds = [s.dispatch for s in run_fixed_latency(replay, lambda d: 0.5)]
    first = {d.play: d for d in ds if d.request.index == 0}
    assert len(first) == 2 and first[0].scope != first[1].scope
    builder = PromptBuilder(512)
    assert _common_prefix(builder.prompt(first[0]), builder.prompt(first[1])) < 4

    moon = load_workload(TRACES / "mooncake-fast25" / "synthetic_trace.jsonl")
    rows = list(moon)[:400]
    replay = ProductionReplay(rows, lanes=400, rps=1000.0, seed=1, duration_s=0.5)
    ds = [s.dispatch for s in run_fixed_latency(replay, lambda d: 10.0)]
    builder = PromptBuilder(512, 1 / 64)
    by_first = {}
    for d in ds:
        by_first.setdefault(int(d.block_ids()[0]), []).append(d)
    shared = [g for g in by_first.values() if len(g) > 1]
    assert shared, "rows sharing a first block"
    for g in shared:
        assert builder.prompt(g[0])[:8] == builder.prompt(g[1])[:8]
