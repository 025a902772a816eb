"""The hand-off step: a computed prompt's KV goes from its prefill stages to its decode ranks.

Contract: ``Handoff(world)(r, then)``: every stage gathers its layers of every token per decode
rank and sends them in large writes (``policy.layout``'s write plan: at most
``handoff.max_write_bytes`` per write, whole records; ``policy.layout.handoff_counts``); each decode rank receives its tokens
(``policy.layout`` DCP split) from every stage. Each stage's sends leave on its first rank's
NIC; each decode rank's writes land on its NIC. Once the last write has landed, the gather and
the scatter take ``2 x unpack_s(bytes per stage)``; then ``then()``, with the record's
``handoff_s``, ``handoff_bytes`` and ``handoff_writes`` set. A stage's extra records (the DSA
index cache) ride along in the byte count.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.policy.layout import HandoffPlan, handoff_counts
from kvpool.sim.events import call_later
from kvpool.sim.links import Join
from kvpool.sim.request import Request
from kvpool.sim.world import World


class Handoff:
    def __init__(self, world: World) -> None:
        s, spec = world.s, world.spec
        self.env = world.env
        self.unpack_s = world.cost.unpack_s
        self.stages = spec.stages
        self.dcp = s.decode.dcp
        self.stage_layers = [len(spec.stage_layer_ids(st)) for st in range(spec.stages)]
        self.depths = depths = sorted(set(self.stage_layers))
        for layers in depths:  # the plan's checks, once (per request: handoff_counts)
            HandoffPlan(tokens=0, layers=layers, record_bytes=s.model.record_bytes, ranks=s.decode.dcp,
                        max_write_bytes=s.handoff.max_write_bytes)
        self.stage_depths = [(layers, self.stage_layers.count(layers)) for layers in depths]
        self.record_bytes = s.model.record_bytes
        self.max_write_bytes = s.handoff.max_write_bytes
        self.stage_bpt = list(spec.stage_bytes_per_token)
        self.bpt = sum(self.stage_bpt)
        nic = world.net.nic
        tp = s.prefill.tp
        self.stage_nics = [[nic[p.rank_gpu(st * tp)] for st in range(spec.stages)] for p in world.prefills]
        self.decode_nics = [[nic[d.gpus[r % len(d.gpus)]] for r in range(s.decode.dcp)] for d in world.decodes]

    def __call__(self, r: Request, then: Callable[[], None]) -> None:
        env, rec = self.env, r.rec
        start = env.now
        tokens = rec.in_tokens
        bpt = self.bpt
        rec.handoff_bytes += tokens * bpt
        gather_s = 2 * self.unpack_s(rec.handoff_bytes // self.stages)
        rank_tokens, plans = handoff_counts(tokens, self.depths, self.record_bytes, self.dcp, self.max_write_bytes)
        sums = {layers: sum(w) for layers, w in plans.items()}

        def done(_e) -> None:
            rec.handoff_s = env.now - start
            then()

        j = Join(env, fn=lambda: call_later(env, gather_s, done))  # gather + scatter once every write landed
        stage_nics, stage_bpt = self.stage_nics[r.prefill.index], self.stage_bpt
        for stage, layers in enumerate(self.stage_layers):
            writes = sums[layers]
            rec.handoff_writes += writes
            stage_nics[stage].transfer(tokens * stage_bpt[stage], writes, j)
        for rank, link in enumerate(self.decode_nics[r.decode.index]):  # a rank's writes from every stage
            link.transfer(rank_tokens[rank] * bpt, sum([n * plans[layers][rank] for layers, n in self.stage_depths]), j)
        if not j.left:  # nothing to send: the join completes through SimPy's queue, now
            call_later(env, 0.0, lambda _e: j.fn())
