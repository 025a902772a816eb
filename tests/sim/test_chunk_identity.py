"""The simulator's chunk group ids are a numbering of ``policy.chunks``' digests, over replays of
real traces: two chunks the simulator serves get the same group id exactly when the policy core
gives them the same digest.

Each case runs a small ``Simulation`` whose key space records every ``chunk_gids`` call the
engine makes, with the dispatch being prefilled. For every served request two digest lists are
computed with ``policy.chunks``:

* from the arguments the engine passed (block ids, block size, tokens, chain scope) under the
  deployment's namespace: the key space numbers what it is given;
* from the request itself (its recorded block ids, its dispatch's scope; with a shared prefix,
  the first blocks of a main-thread prompt replaced by the prefix's own blocks): the engine gives
  the key space the right blocks.

Both maps group id <-> digest must be bijections over the whole replay, and the key space must
have numbered nothing else (its group count is the number of distinct digests).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from trace_builders import KV_TRACES, MOONCAKE_CONVERSATION_HEAD

from kvpool.policy.chunks import ChunkDigest, chain_seed, digests_from_blocks, namespace_for
from kvpool.scenario import load_scenario
from kvpool.sim.engine import Simulation
from kvpool.sim.run import make_replay
from kvpool.workload import load_workload
from kvpool.workload.model import Workload
from kvpool.workload.replay import Dispatch

SCENARIO = "mi355x-1p1d"
#: small real AgentX/Weka sessions; 0010, 0014 and 0254 have subagent threads
WEKA_TRACES = ("0001", "0002", "0010", "0014", "0254", "0270")
MOONCAKE_ROWS = 4000  # the first rows of the conversation trace
#: 150 whole 64-token blocks and a partial one (not shared): chunk 37 holds shared and own blocks
SHARED_PREFIX_TOKENS = 150 * 64 + 17


@dataclass(frozen=True)
class Served:
    """One ``chunk_gids`` call of the engine: the request, the call's arguments and its ids."""

    dispatch: Dispatch
    scope: str
    blocks: np.ndarray
    block_tokens: int
    n_tokens: int
    chain_scope: str | None
    gids: np.ndarray


def replay(s, w: Workload, load: float) -> tuple[Simulation, list[Served]]:
    """Run ``s`` over ``w`` at ``load``; every key-space call of the engine, in order."""
    sim = Simulation(s, make_replay(s, w, load))
    served: list[Served] = []
    current: list[Dispatch] = []
    prompts = sim.lifecycle.prompts
    build, chunk_gids = prompts.build, sim.keys.chunk_gids

    def recording_build(d):
        current[:] = [d]
        return build(d)

    def recording_chunk_gids(scope, chain, block_ids, block_tokens, n_tokens, *, chain_scope=None):
        gids = chunk_gids(scope, chain, block_ids, block_tokens, n_tokens, chain_scope=chain_scope)
        (d,) = current
        assert scope == d.scope and chain is prompts.play(d).threads[d.request.thread].chain
        served.append(Served(d, scope, np.array(block_ids), block_tokens, n_tokens, chain_scope, np.array(gids)))
        current.clear()
        return gids

    prompts.build = recording_build
    sim.keys.chunk_gids = recording_chunk_gids
    records = sim.run()
    assert len(served) == len(records)  # one key-space call per request served
    return sim, served


def digests_of_call(c: Served, namespace: str) -> list[ChunkDigest]:
    """``policy.chunks``' digests of the blocks, scope and tokens the engine passed."""
    n_tokens = min(c.n_tokens, c.blocks.size * c.block_tokens)  # tokens past the recorded blocks: not keyed
    seed = chain_seed(namespace, c.scope if c.chain_scope is None else c.chain_scope)
    return digests_from_blocks(c.blocks, c.block_tokens, n_tokens, 256, seed)


def digests_of_request(d: Dispatch, namespace: str, shared_prefix_tokens: int,
                       codes: dict[str, int]) -> list[ChunkDigest]:
    """``policy.chunks``' digests of the request itself: its recorded blocks under its scope's
    chain; with a shared prefix, every scope's blocks made distinct (scope code << 32 | local
    id, code 0 for the prefix's blocks) under the global chain, the prefix's whole blocks
    leading every main-thread prompt."""
    bt = d.session.block_tokens
    blocks = d.block_ids()
    n_tokens = min(d.request.in_tokens, blocks.size * bt)
    if not shared_prefix_tokens:
        return digests_from_blocks(blocks, bt, n_tokens, 256, chain_seed(namespace, d.scope))
    assert blocks.size == 0 or int(blocks.max()) < 1 << 32
    code = codes.setdefault(d.scope, len(codes) + 1)
    ids = (np.uint64(code) << np.uint64(32)) | blocks.astype(np.uint64)
    if d.request.thread == 0:
        k = min(shared_prefix_tokens // bt, ids.size)
        ids[:k] = np.arange(k, dtype=np.uint64)
    return digests_from_blocks(ids, bt, n_tokens, 256, chain_seed(namespace, ""))


def assert_bijection(pairs: Iterable[tuple[np.ndarray, list[ChunkDigest]]]) -> tuple[int, int]:
    """Group id <-> digest is one-to-one over every chunk of every pair; returns (distinct
    chunks, chunk occurrences)."""
    by_gid: dict[int, bytes] = {}
    by_digest: dict[bytes, int] = {}
    seen = 0
    for gids, digests in pairs:
        assert gids.size == len(digests)
        for g, dg in zip(gids.tolist(), digests):
            assert by_gid.setdefault(g, dg) == dg, f"group id {g} names two digests"
            assert by_digest.setdefault(dg, g) == g, f"digest {dg.hex()} has two group ids"
        seen += gids.size
    return len(by_digest), seen


def check_replay(sim: Simulation, served: list[Served], shared_prefix_tokens: int = 0) -> int:
    """Both bijections over the replay; returns the number of distinct chunks."""
    s = sim.s
    namespace = namespace_for(s.kvspec(), s.pool.chunk_tokens)
    assert s.pool.chunk_tokens == 256 and sim.keys.namespace == namespace
    distinct, seen = assert_bijection((c.gids, digests_of_call(c, namespace)) for c in served)
    codes: dict[str, int] = {}
    assert assert_bijection((c.gids, digests_of_request(c.dispatch, namespace, shared_prefix_tokens, codes))
                            for c in served) == (distinct, seen)
    assert sim.keys.groups == distinct  # every id handed out names a served chunk
    assert distinct < seen  # chunks were reused: equal digests met the same id
    return distinct


@pytest.fixture(scope="module")
def weka(tmp_path_factory) -> Workload:
    files = [KV_TRACES / f"trace_{t}.json.gz" for t in WEKA_TRACES]
    d = tmp_path_factory.mktemp("weka")
    for f in files:
        shutil.copy(f, d / f.name)
    return load_workload(d)


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory) -> Workload:
    with MOONCAKE_CONVERSATION_HEAD.open() as f:
        rows = [next(f) for _ in range(MOONCAKE_ROWS)]
    p = tmp_path_factory.mktemp("mooncake") / "conversation_head.jsonl"
    p.write_text("".join(rows))
    return load_workload(p)


def test_weka_replay_ids_number_the_digests(weka):
    """Local-scope ids: sessions, their subagent threads and their replays (each play a new
    scope, a cache bust) get ids exactly as their digests are equal."""
    s = load_scenario(SCENARIO, ["workload.duration_s=3600"])
    sim, served = replay(s, weka, 6)
    plays = {c.scope for c in served}
    assert len(plays) > len({c.dispatch.session.id for c in served})  # some session played twice
    assert any(c.dispatch.request.thread > 0 for c in served)
    assert all(c.chain_scope is None for c in served)
    check_replay(sim, served)


def test_shared_prefix_replay_ids_number_the_digests(weka):
    """``workload.shared_prefix_tokens``: the prefix's chunks get one id in every session, and
    no chunk with a session's own block shares an id across scopes."""
    s = load_scenario(SCENARIO, ["workload.duration_s=3600", f"workload.shared_prefix_tokens={SHARED_PREFIX_TOKENS}"])
    sim, served = replay(s, weka, 6)
    assert all(c.chain_scope == "" for c in served)
    check_replay(sim, served, SHARED_PREFIX_TOKENS)
    shared_chunks = SHARED_PREFIX_TOKENS // 64 * 64 // 256
    scopes_of: dict[int, set[str]] = {}
    for c in served:
        for g in c.gids.tolist():
            scopes_of.setdefault(g, set()).add(c.scope)
    across = {g for g, scopes in scopes_of.items() if len(scopes) > 1}
    assert len(across) == shared_chunks  # the prefix's whole chunks, and no others


def test_mooncake_replay_ids_number_the_digests(mooncake):
    """Global-scope ids (Mooncake rows, 512-token blocks of two chunks each): prompts of different
    rows share chunks exactly where their digests are equal."""
    s = load_scenario(SCENARIO, ["workload.mode=replay", "workload.duration_s=300"])
    sim, served = replay(s, mooncake, 8.0)
    assert {c.scope for c in served} == {""} and {c.block_tokens for c in served} == {512}
    assert len({c.dispatch.session.id for c in served}) > 1000
    check_replay(sim, served)
