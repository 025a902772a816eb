"""The decode engine's core in one process: two prefill instances handing off to one decode
instance, and the batch bounded by ``decode.max_seqs`` (CPU, real ZMQ side channels and
shared-memory landing pools on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import torch

from kvpool.backend.handoff import PrefillStage, make_transport
from kvpool.backend.refmodel import RefModel
from kvpool.backend.serve import handoff_plan as hp
from kvpool.backend.serve.decode_core import DecodeCore, NoRoom
from kvpool.backend.serve.model_config import ref_config
from kvpool.backend.serve.protocol import ExpectRequest, GenerateRequest, ProtocolError
from kvpool.backend.serve.reference import reference_generate
from kvpool.scenario.load import load_scenario

pytestmark = pytest.mark.timeout(120)

SCENARIO = load_scenario("cpu-tiny", ["prefill.instances=2", "cluster.gpus_per_server=6", "cluster.numa_per_server=3",
                                      "decode.max_seqs=2", "serve.decode_kv_tokens=2048", "serve.request_timeout_s=10"])
CFG = ref_config(SCENARIO)
MAX_TOKENS = 9


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(21)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 33, 20, 64)]


def _knows(rank, request_id: str) -> bool:
    """Whether a decode rank holds ``request_id`` (pending, ready or failed)."""
    try:
        rank.status(request_id)
    except KeyError:
        return False
    return True


async def collect(q: asyncio.Queue, timeout_s: float = 20.0) -> list:
    events = []
    while not events or not events[-1].done:
        events.append(await asyncio.wait_for(q.get(), timeout_s))
    return events


@pytest.mark.usefixtures("one_torch_thread")
def test_two_prefill_instances_feed_one_decode_instance_and_the_batch_is_bounded():
    asyncio.run(_scenario_run())


async def _scenario_run() -> None:
    loop = asyncio.get_running_loop()
    core = DecodeCore(SCENARIO, 0, ("cpu", "cpu"), loop, log=lambda s: None)
    t_start = time.monotonic()
    assert len(core.rank_endpoints) == 2 and all(len(eps) == 2 for eps in core.rank_endpoints)
    core.start()
    stages: dict[tuple[int, int], PrefillStage] = {}
    try:
        for i in range(2):
            for s in range(2):
                stages[i, s] = PrefillStage(s, make_transport(hp.TRANSPORT), staging_bytes=1 << 20)
        targets = {key: await loop.run_in_executor(None, ps.connect, core.rank_endpoints[key[0]])
                   for key, ps in stages.items()}
        model = RefModel(CFG)
        ps_ = prompts()
        firsts = []
        for k, prompt in enumerate(ps_):
            rid, inst = f"q{k}", k % 2          # requests alternate between the prefill instances
            await core.submit(core.expect, ExpectRequest(rid, len(prompt), MAX_TOKENS, inst))
            # only the named prefill instance's ranks wait for the request (and set landing space aside)
            known = await core.submit(lambda rid=rid: [[_knows(dr, rid) for dr in ranks] for ranks in core.ranks])
            assert known == [[i == inst] * 2 for i in range(2)], known
            table = torch.arange(-(-len(prompt) // CFG.page_tokens))
            caches = model.new_caches(table.numel())
            firsts.append(int(model.prefill(prompt, caches, table).argmax()))

            def send(rid=rid, inst=inst, prompt=prompt, caches=caches, table=table):
                for s in range(2):
                    stages[inst, s].send(rid, targets[inst, s], caches[s], table,
                                         hp.stage_plan(SCENARIO, s, len(prompt)), timeout_s=10.0)

            await loop.run_in_executor(None, send)
        queues = [asyncio.Queue() for _ in ps_]
        # queued together (one loop tick): the engine takes them in one round
        await asyncio.gather(*(core.submit(core.generate, GenerateRequest(f"q{k}", firsts[k], MAX_TOKENS, {}, True), q)
                               for k, q in enumerate(queues)))
        results = await asyncio.gather(*(collect(q) for q in queues))
        for k, events in enumerate(results):
            assert events[-1].finish_reason == "length" and not events[-1].error, events[-1]
            tokens = [firsts[k]] + [t for ev in events for t in ev.tokens]
            assert tokens == reference_generate(CFG, ps_[k], MAX_TOKENS, SCENARIO.decode.dcp), k
        text = core.metrics.render().decode()
        count = float(re.search(r"^kvpool:decode_batch_sequences_count (\S+)$", text, re.M).group(1))
        at_most_2 = float(re.search(r'^kvpool:decode_batch_sequences_bucket\{le="2.0"\} (\S+)$', text, re.M).group(1))
        at_most_1 = float(re.search(r'^kvpool:decode_batch_sequences_bucket\{le="1.0"\} (\S+)$', text, re.M).group(1))
        assert count == at_most_2 > at_most_1          # batches of 2, never more (max_seqs 2)
        # the time accounts: the steps are inside the busy iterations, which are inside the run
        step_s = float(re.search(r"^kvpool:decode_step_seconds_sum (\S+)$", text, re.M).group(1))
        busy_s = float(re.search(r"^kvpool:decode_busy_seconds_total (\S+)$", text, re.M).group(1))
        assert 0 < step_s <= busy_s <= time.monotonic() - t_start
        assert core.kv_usage == 0.0
        # no room: 2,048 tokens over 2 ranks
        with pytest.raises(NoRoom, match="no room for 2100 tokens"):
            await core.submit(core.expect, ExpectRequest("huge", 2000, 100, 0))
        with pytest.raises(ProtocolError, match=r"prefill_instance: expected an integer in \[0, 1\]"):
            await core.submit(core.expect, ExpectRequest("nowhere", 5, 5, 2))
        assert core.kv_usage == 0.0
    finally:
        await loop.run_in_executor(None, core.stop)
        for ps in stages.values():
            ps.close()
    assert not core.alive
