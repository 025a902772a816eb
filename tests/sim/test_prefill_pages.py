"""The prefill's pages (``sim.steps.pages``): a request holds pages for its whole prompt from its
admission until its hand-off and save end, pages in flight are never evicted, a request that
cannot get its pages waits, and the shares of a small case are the hand-computed ones. Also the
prefill pipeline's step order."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import simpy
from trace_builders import req, trace

from kvpool.scenario import load_scenario
from kvpool.sim.engine import Simulation
from kvpool.sim.instances import PrefillInstance
from kvpool.sim.keys import KeyChain, KeySpace
from kvpool.sim.steps.pages import PrefillPages
from kvpool.workload.model import Workload
from kvpool.workload.replay import AgentXReplay
from kvpool.workload.weka import session_from_weka

P = 16  # cpu-tiny's page


PAGE_KEYS = KeySpace("test", P)  # the simulator's page key space (``sim.prompt``), one per world


def request(ids: list[int], in_tokens: int, block_tokens: int = P) -> SimpleNamespace:
    """What ``PrefillPages`` reads of a request: its prompt's page keys (named as ``sim.prompt``
    names them, from its block ids) and its length; ``pages`` is set when it is admitted."""
    blocks = np.asarray(ids, dtype=np.int64)
    keys = PAGE_KEYS.chunk_gids("s", KeyChain(), blocks, block_tokens, in_tokens)
    return SimpleNamespace(prompt=SimpleNamespace(pages=keys), rec=SimpleNamespace(in_tokens=in_tokens), pages=None)


def test_page_keys_are_equal_exactly_as_far_as_the_prompts_blocks_are():
    pages = PrefillPages(64, P, PAGE_KEYS)
    a = pages.keys(request(list(range(8)), 128)).tolist()
    b = pages.keys(request([0, 1, 2, 3, 4, 9, 9, 9], 128)).tolist()
    assert len(a) == 8 and a[:5] == b[:5] and not set(a[5:]) & set(b)
    # blocks of 64 tokens: 4 pages per block, equal while the blocks are
    c = pages.keys(request([5, 6], 128, block_tokens=64)).tolist()
    d = pages.keys(request([5, 7], 128, block_tokens=64)).tolist()
    assert len(set(c)) == 8 and c[:4] == d[:4] and not set(c[4:]) & set(d)
    # a full page past the prompt's full blocks is the request's own (tokens the trace does not name)
    e, f = pages.keys(request([1], 40)).tolist(), pages.keys(request([1], 40)).tolist()
    assert len(e) == 2 and e[0] == f[0] and e[1] != f[1]


def test_pages_held_in_flight_are_never_evicted_and_a_request_that_cannot_get_pages_waits_first_come_first():
    pages = PrefillPages(16, P, PAGE_KEYS)
    order: list[str] = []
    failed: list[str] = []

    def admit(name: str, r) -> None:
        pages.admit(r, lambda: order.append(name), lambda _r: failed.append(name))

    a0 = request(list(range(8)), 128)
    admit("a0", a0)
    pages.commit(a0)
    pages.release(a0)  # its 8 pages are cached, unreferenced
    a1 = request(list(range(12)), 192)
    admit("a1", a1)  # reuses a0's 8 pages and takes 4 free ones; holds all 12
    assert a1.pages.hit_pages == 8
    c = request(list(range(100, 108)), 128)
    admit("c", c)  # 4 free pages, a1's 12 held: c waits (evicting a1's pages would free them)
    small = request([200], 16)
    admit("small", small)  # one page would be free, but c is first in line
    assert order == ["a0", "a1"] and pages.waiting == 2
    assert pages.cache.cached_prefix(a1.pages.keys, 8) == 8  # a1's reused pages are all still there
    pages.commit(a1)
    pages.release(a1)  # c takes 4 free pages and evicts a1's last 4, then small evicts one more
    assert order == ["a0", "a1", "c", "small"] and pages.waiting == 0
    assert pages.cache.cached_prefix(a1.pages.keys, 12) == 7  # a's prefix lost its last 5 pages
    too_big = request(list(range(17)), 17 * P)
    admit("too_big", too_big)
    assert failed == ["too_big"] and pages.waiting == 0


def test_a_waiting_request_leaves_the_queue_when_cancelled_and_the_next_one_goes():
    pages = PrefillPages(4, P, PAGE_KEYS)
    order: list[str] = []
    a = request([1, 2, 3, 4], 64)
    pages.admit(a, lambda: order.append("a"), lambda _r: None)
    b = request([5, 6], 32)
    pages.admit(b, lambda: order.append("b"), lambda _r: None)
    c = request([7], 16)
    pages.admit(c, lambda: order.append("c"), lambda _r: None)
    assert order == ["a"] and pages.cancel(b) and not pages.cancel(b)
    assert order == ["a"]  # still no page free for c
    pages.release(a)
    assert order == ["a", "c"]


# -- the whole simulator on a small case -------------------------------------------------------

def two_sessions() -> Workload:
    """Session a: 192 tokens, then 208 (its prefix and one block more) 1,000 s after it ends;
    session b: 128 tokens, then 144, 3,000 s after it ends. Blocks of one page."""
    a = trace("a", [req(0.0, 192, list(range(12)), api=1.0, block=P),
                    req(1001.0, 208, list(range(13)), api=1.0, block=P)], block=P)
    b = trace("b", [req(0.0, 128, list(range(100, 108)), api=1.0, block=P),
                    req(3001.0, 144, list(range(100, 109)), api=1.0, block=P)], block=P)
    return Workload((session_from_weka(a), session_from_weka(b)))


def run(overrides: list[str]) -> list:
    s = load_scenario("cpu-tiny", ["serve.prefill_kv_tokens=256", "pool.services_per_server=0", *overrides])
    replay = AgentXReplay(two_sessions(), lanes=2, seed=1, warmup=False, recycle=False, idle_cap_s=1e6)
    return Simulation(s, replay).run()


def test_shares_of_a_small_case_are_the_hand_computed_ones():
    """16 pages. a0 (12 pages) is admitted; b0 (8) waits until a0's hand-off ends, then takes the 4
    free pages and evicts a0's last 4. a1 reuses a0's 8 pages and evicts b0's last 5 (b0 released
    later than a0, but a1 holds a0's pages); b1 reuses b0's 3 pages and evicts a1's last 6."""
    recs = {(r.session, r.in_tokens): r for r in run(['cost.kv_capacity="serve"'])}
    a0, b0, a1, b1 = recs["a", 192], recs["b", 128], recs["a", 208], recs["b", 144]
    assert not any(r.error for r in recs.values())
    assert [r.gpu_tokens for r in (a0, b0, a1, b1)] == [0, 0, 8 * P, 3 * P]
    assert [r.computed_tokens for r in (a0, b0, a1, b1)] == [192, 128, 208 - 8 * P, 144 - 3 * P]
    # b0 waited for a0's pages: its lookup came when a0's hand-off ended (no pool: nothing to save)
    assert b0.prefill_start_s == pytest.approx(a0.prefill_end_s + a0.handoff_s) and b0.prefill_start_s > a0.prefill_start_s
    gpu = sum(r.gpu_tokens for r in recs.values())
    assert gpu / sum(r.in_tokens for r in recs.values()) == pytest.approx(176 / 672)
    # the capacity derived from HBM keeps everything here
    default = {(r.session, r.in_tokens): r for r in run([])}
    assert [default[k].gpu_tokens for k in (("a", 208), ("b", 144))] == [192, 128]


def test_a_prompt_larger_than_the_prefill_kv_fails_and_its_session_goes_on():
    a = trace("a", [req(0.0, 300, list(range(19)), api=1.0, block=P), req(2.0, 64, list(range(50, 54)), api=1.0, block=P)],
              block=P)
    s = load_scenario("cpu-tiny", ["serve.prefill_kv_tokens=256", "pool.services_per_server=0", 'cost.kv_capacity="serve"'])
    replay = AgentXReplay(Workload((session_from_weka(a),)), lanes=1, seed=1, warmup=False, recycle=False, idle_cap_s=1e6)
    recs = Simulation(s, replay).run()
    assert [(r.in_tokens, r.error) for r in recs] == [(300, "prefill_kv"), (64, "")]


# -- the prefill pipeline --------------------------------------------------------------------------

class PerToken:
    """A step costs 1 ms per token, whatever the context."""

    def prefill_step_s(self, batch) -> float:
        return sum(take for take, _ in batch) * 1e-3


def test_the_pipeline_keeps_step_order_and_at_most_pp_steps_in_flight():
    env = simpy.Environment()
    p = PrefillInstance(env, 0, 0, [0, 1], pp=2, tp=1, max_batched_tokens=1000, cost=PerToken(), pages=None,
                        page_tokens=1, spread_requests=False, load_workers=1)
    done: dict[str, tuple[float, float]] = {}

    def compute(name: str, tokens: int, at_s: float):
        yield env.timeout(at_s)
        ev = p.compute(tokens, 0)
        ev.callbacks.append(lambda e: done.__setitem__(name, (e.value, env.now)))

    env.process(compute("long", 1000, 0.0))   # one step of 1 s
    env.process(compute("short", 10, 0.0))    # the next step, 10 ms
    env.process(compute("late", 10, 1.005))   # comes during the short step
    env.run()
    # stage 1 takes the short step after the long one (it cannot overtake); the late step waits for
    # the long one to leave
    assert done["long"] == pytest.approx((0.0, 2.0))
    assert done["short"] == pytest.approx((1.0, 2.01))
    assert done["late"] == pytest.approx((2.0, 2.02))


@pytest.mark.parametrize("spread", [False, True])
def test_spread_requests_fill_the_pipeline_behind_the_first_step(spread):
    """Four 100-token requests at once through two stages (1 ms a token): one step of all four, or
    (``prefill.spread_requests``) steps of the runnable requests' share over the stages: two, then
    one, then one, each stage taking the next step as soon as it is free."""
    env = simpy.Environment()
    p = PrefillInstance(env, 0, 0, [0, 1], pp=2, tp=1, max_batched_tokens=1000, cost=PerToken(), pages=None,
                        page_tokens=16, spread_requests=spread, load_workers=1)
    done: dict[int, float] = {}
    for k in range(4):
        p.compute(100, 0).callbacks.append(lambda e, k=k: done.__setitem__(k, env.now))
    env.run()
    if spread:   # stage 1 takes step A at 0.2, B at 0.4; C waits for A to leave (two in flight)
        assert [done[k] for k in range(4)] == pytest.approx([0.4, 0.4, 0.5, 0.6])
        assert p.steps_in_flight_s == pytest.approx(0.4 + 0.3 + 0.2)  # A 0-0.4, B 0.2-0.5, C 0.4-0.6
    else:
        assert [done[k] for k in range(4)] == pytest.approx([0.8] * 4)
        assert p.steps_in_flight_s == pytest.approx(0.8)


@pytest.mark.parametrize("faults", [[], ["faults.hang_prob_other=0.2", "faults.hang_s=5", "faults.request_timeout_s=6",
                                        "faults.restore_fail_prob=0.3", "faults.save_fail_prob=0.3"]])
def test_every_page_goes_back_by_the_end_of_a_run_faults_or_not(faults):
    """On the repository's traces at 4 sessions (the prefill KV fills), with and without failures:
    when the run ends no request holds a page or waits for one."""
    from trace_builders import KV_TRACES

    from kvpool.sim.run import make_replay, workload_for

    calibration = KV_TRACES.parents[1] / "calibration" / "cpu-tiny.json"
    s = load_scenario("cpu-tiny", ['cost.kv_capacity="serve"', f'cost.calibration="{calibration}"',
                                   "workload.token_scale=0.03125", "workload.duration_s=60",
                                   "workload.max_output_tokens=16", f'workload.traces="{KV_TRACES}"', *faults])
    sim = Simulation(s, make_replay(s, workload_for(s), 4))
    recs = sim.run()
    pages = sim.world.prefills[0].pages
    assert len(recs) > 8 and pages.cache.evictions > 0  # the cache filled
    assert pages.cache.held_pages == 0 and pages.waiting == 0
    if faults:
        assert any(r.error for r in recs)


def test_a_request_answers_and_decodes_once_its_hand_off_and_its_save_have_both_ended(tmp_path):
    """As production's prefill answers: its first token, and its decode's start, wait for the longer
    of the two. With the repository's calibration, but saves measured 20x slower, the save is what
    delays them."""
    import json

    from trace_builders import KV_TRACES

    from kvpool.sim.run import make_replay, workload_for

    doc = json.loads((KV_TRACES.parents[1] / "calibration" / "cpu-tiny.json").read_text())
    doc["save"]["fit"]["bytes_per_s"] /= 20
    slow_saves = tmp_path / "slow-saves.json"
    slow_saves.write_text(json.dumps(doc))
    s = load_scenario("cpu-tiny", ['cost.kv_capacity="serve"', f'cost.calibration="{slow_saves}"',
                                   "workload.token_scale=0.03125", "workload.duration_s=30",
                                   "workload.max_output_tokens=16", f'workload.traces="{KV_TRACES}"'])
    recs = [r for r in Simulation(s, make_replay(s, workload_for(s), 2)).run() if r.decode_start_s >= 0]
    saved = [r for r in recs if r.save_bytes]
    assert saved and len(saved) < len(recs)
    for r in recs:
        assert r.decode_start_s == pytest.approx(r.prefill_end_s + max(r.handoff_s, r.save_s), abs=1e-9), r
        assert r.first_token_s == r.decode_start_s
    assert any(r.save_s > r.handoff_s for r in saved)
    assert all(r.save_s == 0 for r in recs if not r.save_bytes)
