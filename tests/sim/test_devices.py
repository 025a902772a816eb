"""``sim.devices``: workers that share a device slow one another by the calibration's measured shares,
in the prefill pipeline and the decode batch; without a ``sharing`` section nothing changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import simpy

from kvpool.scenario.load import load_scenario
from kvpool.sim.devices import Device, Placement, shared_devices
from kvpool.sim.engine import Simulation
from kvpool.sim.instances import DecodeInstance, PrefillInstance

FILE = Path(__file__).resolve().parents[1] / "data" / "calibration" / "cpu-tiny.json"


class FixedCost:
    """A prefill stage step of 1 s, a decode step of 0.1 s, whatever the work."""

    def prefill_step_s(self, items):
        return 1.0

    def decode_step_s(self, batch, context_tokens):
        return 0.1 if batch else 0.0


def test_a_placement_counts_the_other_workers_on_its_busiest_device():
    a, b = Device("cuda:0"), Device("cuda:1")
    decode = Placement([a, b], 0.5)
    stage0, stage1 = Placement([a], 0.25), Placement([b], 0.25)
    heard = []
    decode.listen(lambda: heard.append(a.busy + b.busy))
    assert decode.factor() == 1.0
    stage0.start()
    stage1.start()
    assert decode.others() == 1 and decode.factor() == 1.5  # one other on each device: the most is 1
    decode.start()  # its own start is not news to it, and does not count as another
    assert heard == [1, 2] and decode.others() == 1
    assert stage0.factor() == 1.25  # the decode beside it
    stage0.stop()
    assert decode.others() == 1 and heard == [1, 2, 3]
    stage1.stop()
    assert decode.factor() == 1.0
    with pytest.raises(RuntimeError, match="not computing"):
        stage1.stop()


def test_serve_devices_wrap_so_every_worker_of_a_one_device_scenario_shares_it():
    s = load_scenario("h200-tiny")
    stages, decodes = shared_devices(s, 0.5, 0.25)
    assert len(stages) == s.prefill.instances and len(stages[0]) == s.prefill.pp and len(decodes) == s.decode.instances
    device = stages[0][0].devices[0]
    assert all(p.devices == [device] for p in stages[0]) and decodes[0].devices == [device]
    assert device.name == "cuda:0"


def _pipeline(env, sharing: tuple[float, float] | None):
    s = load_scenario("h200-tiny")
    p = PrefillInstance(env, 0, 0, [0], pp=s.prefill.pp, tp=1, max_batched_tokens=8192, cost=FixedCost(),
                        pages=None, page_tokens=1, spread_requests=False, load_workers=1)
    d = DecodeInstance(env, 0, 0, [1], capacity_tokens=1 << 20, max_seqs=8, tokens_per_step=1.0, cost=FixedCost())
    if sharing is not None:
        stages, decodes = shared_devices(s, *sharing)
        p.placements = stages[0]
        d.share_devices(decodes[0])
    return p, d


def test_alone_a_step_passes_the_four_stages_in_four_step_times():
    env = simpy.Environment()
    p, _ = _pipeline(env, None)
    done = p.compute(100, 0)
    env.run()
    assert done.value == 0.0 and env.now == pytest.approx(4.0)


def test_a_decode_batch_slows_every_stage_and_the_stages_slow_the_decode():
    env = simpy.Environment()
    p, d = _pipeline(env, (0.5, 0.25))
    first, finished = d.generate(100, 60)  # 60 tokens of 0.1 s alone
    done = p.compute(100, 0)
    stage_ends, decode_ends = [], []
    done.callbacks.append(lambda _e: stage_ends.append(env.now))
    finished.callbacks.append(lambda _e: decode_ends.append(env.now))
    env.run()
    # each stage ran beside the decode (one other worker): 1.25 s each
    assert stage_ends == [pytest.approx(5.0)]
    # the decode stepped at 0.15 s while a stage computed (its first 5 s), 0.1 s after
    assert first.triggered and finished.triggered
    tokens_in_5_s = 5.0 / 0.15
    assert decode_ends == [pytest.approx(5.0 + (60 - tokens_in_5_s) * 0.1)]


def test_two_steps_in_flight_on_one_device_slow_each_other():
    env = simpy.Environment()
    p, _ = _pipeline(env, (0.5, 0.25))
    first = p.compute(8192, 0)  # one whole step each
    second = p.compute(8192, 0)
    ends = {}
    first.callbacks.append(lambda _e: ends.setdefault("first", env.now))
    second.callbacks.append(lambda _e: ends.setdefault("second", env.now))
    env.run()
    # a stage's step is priced when it starts, by the workers computing then. The first step:
    # stage 0 alone (0-1 s); stage 1 starts before the second step starts at stage 0 (1-2 s);
    # stages 2 and 3 beside the second step's stages 0 and 1 (2-3.25, 3.25-4.5 s). The second:
    # stage 0 beside the first's stage 1 (1-2.25), stage 1 beside its stage 2 (2.25-3.5),
    # stage 2 beside its stage 3 (3.5-4.75), stage 3 alone (4.75-5.75).
    assert ends == {"first": pytest.approx(4.5), "second": pytest.approx(5.75)}


def _records(calibration: Path) -> list[dict]:
    from trace_builders import KV_TRACES

    from kvpool.sim.run import make_replay, workload_for

    s = load_scenario("cpu-tiny", ['cost.kv_capacity="serve"', f'cost.calibration="{calibration}"',
                                   "workload.token_scale=0.03125", "workload.duration_s=30",
                                   "workload.max_output_tokens=16", f'workload.traces="{KV_TRACES}"'])
    return [r.as_dict() for r in Simulation(s, make_replay(s, workload_for(s), 3)).run()]


def test_a_calibration_without_sharing_and_one_with_zero_slowdowns_simulate_alike(tmp_path):
    doc = json.loads(FILE.read_text())
    doc.pop("sharing", None)
    without = tmp_path / "without.json"
    without.write_text(json.dumps(doc))
    doc["sharing"] = {"decode_slowdown_per_worker": 0.0, "prefill_slowdown_per_worker": 0.0}
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps(doc))
    doc["sharing"] = {"decode_slowdown_per_worker": 1.0, "prefill_slowdown_per_worker": 1.0}
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(doc))
    alone, zero_slowdowns, slowed = _records(without), _records(zero), _records(slow)
    assert alone == zero_slowdowns
    # every worker twice as slow per other worker beside it: decoding beside the prefills is slower
    def time_per_token_s(recs):
        decoded = [r for r in recs if r["out_tokens"] > 1 and not r["error"]]
        return sum((r["end_s"] - r["first_token_s"]) / (r["out_tokens"] - 1) for r in decoded) / len(decoded)
    assert time_per_token_s(slowed) > 1.2 * time_per_token_s(alone)
