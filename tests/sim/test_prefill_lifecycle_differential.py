"""The simulator's and the prefill engine's request lifecycles agree, request by request.

One stream of requests -- cold prompts, pool hits, a GPU hit below a pool hit, a chunk only some
stages hold, a load too short to be worth it, a full-prompt hit, failed loads (one stage failing)
and failed saves -- goes through both drivers of ``policy.prefill_request``:

    * the simulator's: ``sim.lifecycle.Lifecycle`` (``looked_up`` -> ``restored`` -> ``computed``)
      with its real lookup and save steps; the world's pool, the restore transfer, the compute
      time and the hand-off are stand-ins that answer at once;
    * the engine's: ``backend.serve.prefill_scheduler.PrefillScheduler`` (``_start``, ``_on_load``,
      the compute steps, ``_after_compute``, ``_on_save``, ``_on_handoff``) over its real
      ``ConnectorScheduler`` and block manager; the stage sockets are a stand-in client whose
      stages answer each command at once.

Each pool holds, per request, the same leading run of chunks on each stage, and the GPU prefix
cache the same pages. Compared per request: every record field the lifecycle fills, the chunks
loaded, the tokens computed, and the save (its chunks and whether it was stored).
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import simpy

from kvpool.backend.connector_data import StageReport, StageSaveReport
from kvpool.backend.connector_scheduler import ConnectorScheduler, SchedulerConfig
from kvpool.backend.serve.blocks import BlockManager
from kvpool.backend.serve.prefill_scheduler import PrefillScheduler, SchedulerSettings, _FanOutOracle
from kvpool.policy.chunks import ChunkNaming
from kvpool.policy.grouptable import GroupIds
from kvpool.policy.kvspec import KVSpec
from kvpool.sim.events import call_later
from kvpool.sim.lifecycle import Lifecycle
from kvpool.sim.request import Request
from kvpool.sim.steps.lookup import Lookup
from kvpool.sim.steps.save import Save
from kvpool.workload.records import RequestRecord

C = 256  # tokens per chunk
P = 16  # tokens per page
STAGES = 2
MIN_LOAD_TOKENS = 2 * C
FAILING_STAGE = 1  # the stage whose load or save fails (the other one succeeds: a partial outcome)
#: the record fields both worlds fill from the lifecycle's events
FIELDS = ("in_tokens", "gpu_tokens", "pool_tokens", "ssd_tokens", "computed_tokens", "restore_failed",
          "lookup_answered")


@dataclass(frozen=True)
class Case:
    """One request: its prompt, the pages its GPU prefix cache holds, each stage's leading run of
    chunks in the pool, and whether its load or its save fails."""

    name: str
    prompt_tokens: int
    gpu_tokens: int
    stage_runs: tuple[int, int]
    load_fails: bool = False
    save_fails: bool = False


STREAM = (
    Case("cold", 3 * C + 40, 0, (0, 0)),
    Case("pool hit", 5 * C + 10, 0, (4, 4)),
    Case("gpu below pool", 6 * C + 5, 288, (5, 5)),
    Case("stranded chunks", 5 * C + 1, 0, (5, 2)),
    Case("load too short", 4 * C + 7, 0, (1, 1)),
    Case("full-prompt hit", 4 * C, 0, (4, 4)),
    Case("failed load", 5 * C + 10, 0, (4, 4), load_fails=True),
    Case("failed load above a gpu hit", 6 * C + 5, 288, (5, 5), load_fails=True),
    Case("failed save", 4 * C + 3, 0, (2, 2), save_fails=True),
    Case("failed load and save", 5 * C + 10, 0, (3, 3), load_fails=True, save_fails=True),
)


@dataclass
class Lived:
    """What one world did with one request."""

    record: dict
    load: tuple[int, int] | None = None
    computed_tokens: int = 0
    save: tuple[int, int] | None = None
    stored: bool | None = None


def _fields(rec: RequestRecord) -> dict:
    return {f: getattr(rec, f) for f in FIELDS}


# -- the simulator's driver -------------------------------------------------------------------------

class _Pool:
    """The simulated pool's lookup and save, answering from the case's runs."""

    ssd = None

    def __init__(self) -> None:
        self.runs: tuple[int, int] = (0, 0)
        self.saved: list[list[int]] = []

    def lookup_runs(self, server, ranks, groups, now):
        return list(self.runs)

    def save(self, server, ranks, groups, now) -> None:
        self.saved.append(groups.ids.tolist())


class _Nics:
    """Every transfer lands at once."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env

    def transfer(self, p, rank, nbytes, writes, join) -> None:
        join.left += 1
        call_later(self.env, 0.0, lambda _call: join.one())


class _Pages:
    def __init__(self, gpu_tokens: int) -> None:
        self.gpu = gpu_tokens

    def gpu_tokens(self, r) -> int:
        return self.gpu

    def release(self, r) -> None:
        pass


class _Faults:
    def __init__(self, case: Case) -> None:
        self.case = case

    def hangs(self, key, pool_miss: bool) -> bool:
        return False

    def restore_fails(self, key) -> bool:
        return self.case.load_fails

    def save_fails(self, key) -> bool:
        return self.case.save_fails


def simulated(case: Case) -> Lived:
    """``case`` through the simulator's lifecycle (see the module docstring)."""
    env = simpy.Environment()
    pool = _Pool()
    pool.runs = case.stage_runs
    world = SimpleNamespace(s=SimpleNamespace(model=SimpleNamespace(page_tokens=P),
                                              pool=SimpleNamespace(min_load_tokens=MIN_LOAD_TOKENS)),
                            env=env, pool=pool, chunk_tokens=C, rank_bytes=[100] * STAGES,
                            cost=SimpleNamespace(pack_s=lambda nbytes: 0.0), sample_pool=lambda: None)
    rec = RequestRecord(case.name, in_tokens=case.prompt_tokens)
    lived = Lived({})
    life = Lifecycle.__new__(Lifecycle)  # its own methods; its steps below
    life.world, life.env, life.faults, life.min_load_tokens, life.admit_step = world, env, _Faults(case), 0, None
    life.lookup_step = Lookup(world)

    def restore(r, then) -> None:
        lived.load = (r.hits.load_first_chunk, r.hits.load_end_chunk)
        then()

    def compute(r, then) -> None:
        lived.computed_tokens = r.rec.computed_tokens
        then()

    save_step = Save(world, _Nics(env))

    def save(r, groups: GroupIds, lost: bool, done) -> None:
        ids = groups.ids.tolist()
        assert ids == list(range(ids[0], ids[-1] + 1))  # consecutive chunks
        lived.save = (ids[0], ids[-1] + 1)
        save_step(r, groups, lost, done)

    life.restore_step = restore
    life.compute_step = compute
    life.save_step = save
    life.handoff_step = lambda r, then: None
    r = Request(SimpleNamespace(), rec, lambda d: None)
    r.prefill = SimpleNamespace(pages=_Pages(case.gpu_tokens), server=0, ranks=STAGES, index=0)
    chunks = case.prompt_tokens // C
    r.prompt = SimpleNamespace(groups=GroupIds(np.arange(chunks, dtype=np.int64), max(chunks - 1, 0)))
    life.looked_up(r)
    env.run()
    lived.record = _fields(rec)
    if lived.save is not None:
        assert r.prefill_request.save_in_flight is None  # the save step told it the outcome
        lived.stored = bool(pool.saved)
    return lived


# -- the engine's driver ----------------------------------------------------------------------------

class _Stages:
    """The engine's stage client: every command is answered at once, in the order sent."""

    def __init__(self) -> None:
        self.present: set[str] = set()
        self.sent: deque[tuple[int, int, str, dict]] = deque()
        self._ids = 0

    def call_all(self, stages, cmd, bodies, timeout_s, give_up=None):
        assert cmd == "exists"
        return [{"ok": True, "present": [k in self.present for k in b["keys"]]} for b in bodies]

    def send(self, stage: int, cmd: str, body: dict | None = None, tensors=()) -> int:
        self._ids += 1
        self.sent.append((self._ids, stage, cmd, body or {}))
        return self._ids


def served(case: Case, tmp_path: Path) -> Lived:
    """``case`` through the prefill engine's scheduler (see the module docstring)."""
    spec = KVSpec(model="tiny", layers=STAGES, record_bytes=64, stage_layers=(1,) * STAGES, page_tokens=P)
    naming = ChunkNaming("differential", STAGES)
    config = SchedulerConfig(chunk_tokens=C, page_tokens=P, min_load_tokens=MIN_LOAD_TOKENS, recheck_after_s=1e9)
    ready = tmp_path / "decode-0.json"
    ready.write_text(json.dumps({"rank_endpoints": ["tcp://127.0.0.1:1"]}))
    blocks = BlockManager(1024, P, b"differential")
    finished: list[tuple[RequestRecord, object]] = []
    sched = PrefillScheduler(SchedulerSettings(max_batched_tokens=4 * C, page_tokens=P, stage_layers=(1,) * STAGES,
                                               record_bytes=64, max_write_bytes=1 << 20),
                             blocks, naming, spec, config, stage_endpoints=[], stage_pids=[0] * STAGES,
                             stage_names=[f"s{s}" for s in range(STAGES)], decode_ready=lambda d: ready,
                             on_finish=lambda rec, out: finished.append((rec, out)))
    stages = sched.client = _Stages()
    sched.connector = ConnectorScheduler(_FanOutOracle(stages, STAGES, lambda: False), naming, spec, config)
    tokens = tuple(range(7, 7 + case.prompt_tokens))
    if case.gpu_tokens:  # the prefix cache holds the first pages
        alloc = blocks.allocate(tokens[:case.gpu_tokens])
        blocks.commit(alloc, case.gpu_tokens)
        blocks.release(alloc)
    for s, row in enumerate(naming.stage_keys(sched.connector.digests_for(tokens))):
        stages.present.update(row[:case.stage_runs[s]])
    lived = Lived({})
    sched.submit(case.name, tokens, 0, "session", lambda out: None)
    sched._take_inbox()
    sched._admit()
    sched._schedule_step()
    while stages.sent:
        cid, stage, cmd, body = stages.sent.popleft()
        header, tensors = {"id": cid, "ok": True}, ()
        fails = stage == FAILING_STAGE
        if cmd == "load":
            plan = body["plan"]
            lived.load = (plan["first_chunk"], plan["end_chunk"])
            ok = not (case.load_fails and fails)
            header["report"] = asdict(StageReport(case.name, stage, ok, 0.0, 0.1, 100 if ok else 0,
                                                  "" if ok else "missing"))
        elif cmd == "compute":
            if stage == 0:
                lived.computed_tokens += sum(it["end"] - it["start"] for it in body["items"])
            if stage < STAGES - 1:
                tensors = (b"hidden",)
            else:
                header["first_tokens"] = {it["rid"]: 1 for it in body["items"] if it["last"]}
        elif cmd == "save":
            plan = body["plan"]
            lived.save = (plan["first_chunk"], plan["end_chunk"])
            planned = plan["end_chunk"] - plan["first_chunk"]
            stored = 0 if case.save_fails and fails else planned
            header["report"] = asdict(StageSaveReport(case.name, stage, stored, planned, 0.0, 0.1, stored * 100,
                                                      "" if stored == planned else "failed"))
        else:
            assert cmd == "handoff"
            header["report"] = {"handoff_bytes": 0, "handoff_writes": 0}
        sched._on_reply(stage, header, tensors)
        if cmd == "save" and stage == STAGES - 1:
            lived.stored = not case.save_fails
        sched._schedule_step()
    assert not sched.broken, sched.broken
    ((rec, out),) = finished
    assert out.status == 200, out.body
    lived.record = _fields(rec)
    return lived


# -- the comparison ---------------------------------------------------------------------------------

def differences(tmp_path: Path) -> list[str]:
    """Every way the two worlds' lives of ``STREAM`` differ (empty: none)."""
    out = []
    for case in STREAM:
        sim, real = simulated(case), served(case, tmp_path)
        for f in FIELDS:
            if sim.record[f] != real.record[f]:
                out.append(f"{case.name}: {f} simulated {sim.record[f]}, engine {real.record[f]}")
        for what in ("load", "computed_tokens", "save", "stored"):
            if getattr(sim, what) != getattr(real, what):
                out.append(f"{case.name}: {what} simulated {getattr(sim, what)}, engine {getattr(real, what)}")
    return out


def test_both_worlds_live_every_request_alike(tmp_path):
    assert differences(tmp_path) == []
    # the stream covers what it claims: failed loads recompute and save the recomputed chunks again
    lives = {c.name: served(c, tmp_path) for c in STREAM}
    assert lives["failed load"].record["restore_failed"] and lives["failed load"].save == (0, 5)
    assert lives["failed load above a gpu hit"].save == (2, 6) and lives["failed load above a gpu hit"].load == (2, 5)
    assert lives["pool hit"].save == (4, 5) and lives["stranded chunks"].save == (2, 5)
    assert lives["load too short"].load is None and lives["load too short"].save == (1, 4)
    assert lives["failed save"].stored is False and lives["full-prompt hit"].save is None
    assert lives["gpu below pool"].computed_tokens == 2 * C - 288 + C + 5


def test_a_simulator_that_skips_the_lookups_pool_prefix_after_a_failed_restore_is_caught(tmp_path, monkeypatch):
    """The comparison can fail: a simulator whose save keeps the lookup's floor after a failed
    restore (the engine saves the recomputed chunks again) differs on the failed loads."""
    computed = Lifecycle.computed

    def keep_the_lookup_floor(self, r) -> None:
        r.prefill_request.save_floor_chunks = r.hits.pool_prefix_chunks
        computed(self, r)

    monkeypatch.setattr(Lifecycle, "computed", keep_the_lookup_floor)
    found = differences(tmp_path)
    assert found and all(d.startswith(("failed load:", "failed load above a gpu hit:", "failed load and save:"))
                         for d in found), found
    assert "failed load: save simulated (4, 5), engine (0, 5)" in found
