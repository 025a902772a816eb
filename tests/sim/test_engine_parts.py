"""Pieces of the simulator's request steps written out for speed, checked against what they stand for."""

import pytest


@pytest.mark.parametrize(("scenario", "max_write_bytes"), [("mi350x-6p2d-shared", 8 << 20),
                                                        ("mi350x-6p2d-shared", 1_000_000),
                                                        ("mi350x-6p2d-tp4-replay-split", 3 << 20)])
def test_handoff_writes_are_the_policy_plans(scenario, max_write_bytes):
    """Every handed-off request's writes are its stages' ``policy.layout.HandoffPlan`` writes
    (stages of 20/20/20/18 layers and one of all layers; write caps of whole records and not)."""
    from kvpool.policy.layout import HandoffPlan
    from kvpool.scenario import load_scenario
    from kvpool.sim.engine import Simulation
    from kvpool.sim.run import make_replay, workload_for

    s = load_scenario(scenario, ["workload.duration_s=120", f"handoff.max_write_bytes={max_write_bytes}"])
    spec = s.kvspec()
    stage_layers = [len(spec.stage_layer_ids(st)) for st in range(spec.stages)]
    records = Simulation(s, make_replay(s, workload_for(s), 16 if s.workload.mode == "agentx" else 0.8)).run()
    handed = [r for r in records if r.end_s > 0]
    assert len(handed) > 20
    for r in handed:
        plans = [HandoffPlan(tokens=r.in_tokens, layers=layers, record_bytes=s.model.record_bytes,
                             ranks=s.decode.dcp, max_write_bytes=max_write_bytes) for layers in stage_layers]
        assert r.handoff_writes == sum(len(plan.all_writes()) for plan in plans)


def test_block_ids_from_reports_the_known_prefix_it_copied():
    """BlockStore.block_ids_from: the same ids as a walk without known lists, and its first n ids
    are known[r]'s first n (what the engine reuses for the GPU cache ids)."""
    import numpy as np

    from kvpool.scenario import load_scenario
    from kvpool.sim.run import workload_for

    w = workload_for(load_scenario("mi355x-1p1d"))
    for s in w.sessions[:5]:
        store = s.blocks
        latest: dict[int, int] = {}
        known: dict[int, np.ndarray] = {}
        copied = 0
        for req in s.requests[:80]:
            ids, r, n = store.block_ids_from(req.index, known)
            assert store.pieces_from(req.index, known, store.lists()) == store.pieces_from(req.index, known)
            assert np.array_equal(ids, store.block_ids(req.index))
            if n:
                copied += 1
                assert r in known and r != req.index and np.array_equal(ids[:n], known[r][:n])
            else:
                assert r == -1
            old = latest.get(req.thread)
            if old is not None:
                known.pop(old, None)
            known[req.index] = ids
            latest[req.thread] = req.index
        assert copied  # the walks do stop at kept lists


def test_play_prompts_extend_in_place_and_keep_earlier_views():
    """PlayPrompts.ids: every request's block ids are right, most extend their thread's last list
    in its buffer (a view of the same memory), and no list handed out earlier changes afterwards
    (earlier prompts and the key space keep them)."""
    import numpy as np

    from kvpool.scenario import load_scenario
    from kvpool.sim.prompt import PlayPrompts
    from kvpool.sim.run import workload_for

    w = workload_for(load_scenario("mi355x-1p1d"))
    in_place = 0
    for s in w.sessions[:6]:
        store = s.blocks
        lists = store.lists()
        play = PlayPrompts()
        handed: list[tuple[np.ndarray, np.ndarray]] = []
        for req in s.requests[:120]:
            prev = play.threads[req.thread].blocks if req.thread in play.threads else None
            blocks, r, n = play.ids(store, req.index, req.thread, lists)
            want = store.block_ids(req.index)
            assert blocks.dtype == want.dtype and np.array_equal(blocks, want)
            if n:
                assert r != req.index and np.array_equal(blocks[:n], store.block_ids(r)[:n])
            else:
                assert r == -1
            if prev is not None and prev.size and np.shares_memory(prev, blocks):
                in_place += 1
            handed.append((blocks, want.copy()))
            for b, ref in handed:  # earlier views unchanged
                assert np.array_equal(b, ref)
    assert in_place  # the buffers are extended, not copied


def test_play_prompts_do_not_write_over_a_list_another_thread_extended():
    """Two threads extend the same list in turn (a subagent opening with its parent's whole
    prompt, then the parent going on): the second may not write where the first's ids lie."""
    import numpy as np

    from kvpool.sim.prompt import PlayPrompts
    from kvpool.workload.model import BlockStoreBuilder

    b = BlockStoreBuilder()
    b.add(-1, 0, np.array([1, 2, 3]), 3)  # request 0, thread 0
    b.add(0, 3, np.array([7, 8]), 5)  # request 1, thread 1: request 0's ids, then its own
    b.add(0, 3, np.array([4, 5]), 5)  # request 2, thread 0: request 0's ids, then others
    b.add(1, 5, np.array([9]), 6)  # request 3, thread 1: extends request 1
    store = b.build()
    play = PlayPrompts()
    got = [play.ids(store, i, thread, store.lists())[0] for i, thread in enumerate([0, 1, 0, 1])]
    want = [[1, 2, 3], [1, 2, 3, 7, 8], [1, 2, 3, 4, 5], [1, 2, 3, 7, 8, 9]]
    assert [blocks.tolist() for blocks in got] == want


def test_dispatch_and_wake_are_frozen_dataclasses():
    """The replay's Dispatch and Wake keep the frozen-dataclass contract with their hand-written
    initialisers."""
    import dataclasses

    import pytest

    from kvpool.workload.replay import Dispatch, Wake

    d = Dispatch(1, 2, 3, None, None, "s", 5, "profile", 1.5)
    assert [getattr(d, f.name) for f in dataclasses.fields(d)] == [1, 2, 3, None, None, "s", 5, "profile", 1.5]
    assert d.measured and d == Dispatch(1, 2, 3, None, None, "s", 5, "profile", 1.5)
    w = Wake((d,), None, True)
    assert (w.ready, w.next_due_s, w.done) == ((d,), None, True) and w == Wake((d,), None, True)
    for obj, name in ((d, "key"), (w, "done")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 0)


def test_admit_step_resumes_where_a_waiting_process_would():
    """The admit step's callbacks run in the queue slots of a SimPy process that waits on
    ``admitted | timeout(max_wait_s)`` (the policy's arrive/release/expire in both): markers
    scheduled at the same moments land in the same order, for a release before a deadline, a
    release at a deadline's moment after the deadline fired, and a waiter that times out."""
    import simpy

    from kvpool.policy.admission import AdmissionGate, GateConfig, Verdict
    from kvpool.sim.events import start
    from kvpool.sim.steps.admit import Admit
    from kvpool.workload.records import RequestRecord

    def model(use_step: bool) -> list:
        env = simpy.Environment()
        gate = AdmissionGate(GateConfig(tokens_per_decode=1000, budget_fraction=1.0, max_wait_s=2.0), 1)
        log: list = []
        step, waiters = Admit(env, gate), {}

        def ref_wait(rec):
            a = gate.arrive(rec.key, rec.in_tokens, rec.out_tokens, env.now)
            if a.verdict is Verdict.ADMITTED:
                log.append((env.now, "admitted", rec.key, a.decode))
                return
            ev = waiters[rec.key] = env.event()
            yield ev | env.timeout(gate.config.max_wait_s)
            if not gate.expire(rec.key):
                log.append((env.now, "admitted", rec.key, ev.value))
                return
            del waiters[rec.key]
            log.append((env.now, "rejected", rec.key, None))

        def arrive(key, need):
            rec = RequestRecord(key, "s", 0, True, env.now, need - 1, 1)
            if use_step:
                start(env, lambda _c: step.arrive(rec, lambda d: log.append((env.now, "admitted", key, d)),
                                                  lambda: log.append((env.now, "rejected", key, None))))
            else:
                env.process(ref_wait(rec))

        def release(key):
            if use_step:
                step.release(key)
            else:
                for wkey, d in gate.release(key):
                    waiters.pop(wkey).succeed(d)
            for i in range(2):  # markers at the release's moment
                env.timeout(0).callbacks.append(lambda _e, i=i: log.append((env.now, "marker", key, i)))

        def script():
            arrive("a", 900)  # admitted at once
            yield env.timeout(1.0)
            arrive("b", 500)  # waits; deadline 3.0
            arrive("c", 900)  # waits; deadline 3.0
            yield env.timeout(0.5)
            env.process(at(0.5, lambda: release("a")))  # at 2.0, before b's deadline: b admitted
            env.process(at(0.5, lambda: arrive("d", 100)))  # d admitted at once (fits beside b)
            yield env.timeout(0.25)
            env.process(at(1.25, lambda: release("b")))  # at 3.0, after the deadlines fired: c admitted
            env.timeout(1.25).callbacks.append(lambda _e: log.append((env.now, "marker", "deadline", 0)))
            yield env.timeout(2.0)
            arrive("e", 1000)  # waits on a full gate until its deadline at 5.75

        def at(delay, fn):
            yield env.timeout(delay)
            fn()

        env.process(script())
        env.run()
        return log

    got, want = model(True), model(False)
    assert got == want
    assert want == [(0, "admitted", "a", 0),
                    (2.0, "admitted", "d", 0),  # a new arrival fits beside b at once
                    (2.0, "marker", "a", 0), (2.0, "marker", "a", 1),
                    (2.0, "admitted", "b", 0),  # two entries after the release: after its markers
                    (3.0, "marker", "deadline", 0),
                    (3.0, "admitted", "c", 0),  # its deadline fired first; the release admits it then
                    (3.0, "marker", "b", 0), (3.0, "marker", "b", 1),
                    (5.75, "rejected", "e", None)]


def _check_prompts(sim, shared_prefix_tokens: int) -> list[bool]:
    """Run ``sim``, checking every Prompt it builds against its request's ids; per request,
    whether its ids were copied from a kept list. Page keys: one key per page digest
    (``policy.chunks.digests_from_blocks`` of the named ids at the page size) over the whole run,
    and one digest per key."""
    import numpy as np

    from kvpool.policy.chunks import chain_seed, digests_from_blocks
    from kvpool.sim.keys import SHARED_PREFIX_SCOPE

    prompts, keys = sim.lifecycle.prompts, sim.keys
    page_tokens = sim.world.s.model.page_tokens
    build, seen = prompts.build, []
    key_of: dict[bytes, int] = {}  # page digest -> its key
    digest_of: dict[int, bytes] = {}  # page key -> its digest

    def checked_build(d):
        p = build(d)
        store, bt = d.session.blocks, d.session.block_tokens
        want = store.block_ids(d.request.index)
        assert np.array_equal(p.blocks, want) and (p.thread, p.request) == (d.request.thread, d.request.index)
        n_tokens = min(d.request.in_tokens, want.size * bt)
        named, scope = [int(b) for b in want], d.scope
        if shared_prefix_tokens:  # keys chain ids unique across scopes, under one chain
            named = (want.astype(np.int64) + keys.block_offset(d.scope, 0)).tolist()
            if p.thread == 0:
                k = min(shared_prefix_tokens // bt, want.size)
                named[:k] = (keys.block_offset(SHARED_PREFIX_SCOPE, shared_prefix_tokens) + np.arange(k)).tolist()
            scope = ""
        digests = digests_from_blocks(named, bt, n_tokens, page_tokens, chain_seed("pages", scope))
        assert p.pages.size == len(digests) == min(n_tokens // page_tokens, n_tokens // bt * bt // page_tokens)
        for digest, key in zip(digests, p.pages.tolist()):
            assert key_of.setdefault(bytes(digest), key) == key
            assert digest_of.setdefault(key, bytes(digest)) == bytes(digest)
        if shared_prefix_tokens:  # chunk keys chain ids unique across scopes
            key_ids = want.astype(np.int64) + keys.block_offset(d.scope, 0)
            if p.thread == 0:
                k = min(shared_prefix_tokens // bt, want.size)
                key_ids[:k] = keys.block_offset(SHARED_PREFIX_SCOPE, shared_prefix_tokens) + np.arange(k)
            assert np.array_equal(p.memory.chain.blocks, key_ids)
        gids = p.groups.ids
        assert gids.size == np.unique(gids).size and (not gids.size or gids.max() <= p.groups.max_gid)
        if p.copied:
            assert np.array_equal(want[:p.copied], store.block_ids(p.source)[:p.copied])
        seen.append(p.copied > 0)
        return p

    prompts.build = checked_build
    assert len(sim.run()) == len(seen)
    return seen


@pytest.mark.parametrize("shared_prefix_tokens", [0, 150 * 64 + 17])
def test_every_prompt_names_its_request_ids(shared_prefix_tokens):
    """Over a replay (subagents, replayed plays; with and without a shared prefix), every
    request's Prompt holds its block ids, page keys that name its pages' chained digests (a
    main-thread prompt's shared blocks on the shared prefix's own ids), chunk group ids within
    their bounds, and ids copied from the play's request it names."""
    from kvpool.scenario import load_scenario
    from kvpool.sim.engine import Simulation
    from kvpool.sim.run import make_replay, workload_for

    s = load_scenario("mi355x-1p1d", ["workload.duration_s=600", f"workload.shared_prefix_tokens={shared_prefix_tokens}"])
    seen = _check_prompts(Simulation(s, make_replay(s, workload_for(s), 8)), shared_prefix_tokens)
    assert len(seen) > 100 and sum(seen) > len(seen) // 2  # most copy a kept list


def test_every_prompt_names_its_request_ids_on_several_prefills():
    """The same on four servers' six prefills, where a thread's requests meet several of them."""
    from kvpool.scenario import load_scenario
    from kvpool.sim.engine import Simulation
    from kvpool.sim.run import make_replay, workload_for

    s = load_scenario("mi350x-6p2d-shared", ["workload.duration_s=300"])
    sim = Simulation(s, make_replay(s, workload_for(s), 24))
    seen = _check_prompts(sim, 0)
    served = {}
    for r in sim.records:
        served.setdefault((r.session, r.thread), set()).add(r.prefill)
    assert len(seen) > 100 and max(len(p) for p in served.values()) > 1  # threads do move


def test_every_mooncake_prompt_names_its_request_ids(tmp_path):
    """The same for global-scope ids (Mooncake rows: 512-token blocks, a partial last block)."""
    from trace_builders import MOONCAKE_CONVERSATION_HEAD

    from kvpool.scenario import load_scenario
    from kvpool.sim.engine import Simulation
    from kvpool.sim.run import make_replay
    from kvpool.workload import load_workload

    src = MOONCAKE_CONVERSATION_HEAD
    if not src.is_file():
        pytest.skip(f"real Mooncake trace not found at {src}")
    with src.open() as f:
        (tmp_path / "head.jsonl").write_text("".join(next(f) for _ in range(1500)))
    s = load_scenario("mi355x-1p1d", ["workload.mode=replay", "workload.duration_s=120"])
    seen = _check_prompts(Simulation(s, make_replay(s, load_workload(tmp_path / "head.jsonl"), 8.0)), 0)
    assert len(seen) > 500
