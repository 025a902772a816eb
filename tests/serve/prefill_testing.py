"""Helpers of the prefill tests: a cpu-tiny plan's prefill stages and engine as real processes, a
decode side made of ``backend.handoff.DecodeRank`` objects in the test process, and the
single-process reference (``RefModel.prefill``) the landed KV is compared with.

``Deployment`` starts the processes (``python -m kvpool.backend.serve.<role>``, logs in the run
folder) and stops every one of them by its pid (SIGTERM, then SIGKILL after ``STOP_WAIT_S``).
``DecodeSide`` writes the ready file a decode engine writes (``{"pid", "url", "rank_endpoints"}``)
and drives its ranks on one thread: ``expect`` registers a request on every rank (as
``POST /expect`` does), ``wait`` returns once every rank holds it (bounded), ``rank_kv`` reads
what landed. Every wait is bounded.

``running(run_dir, overrides)`` starts a plan's deployment with its decode side and reference and
checks, once it stops, that none of its processes is left; ``prefill`` sends one prompt and waits
until every decode rank holds it; ``assert_matches_reference`` compares the first token and every
rank's landed KV with the reference's; ``prompt`` and ``sources`` build prompts and read a record's
token sources.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import torch

from kvpool.backend.refmodel import RefModel
from kvpool.backend.serve import handoff_plan as hp
from kvpool.backend.serve.model_config import ref_config
from kvpool.backend.serve.plan import ServePlan, build_plan, wait_ready, write_ready
from kvpool.policy.layout import rank_token_count
from kvpool.scenario.load import load_scenario

READY_WAIT_S = 90.0
STOP_WAIT_S = 5.0
HTTP_WAIT_S = 60.0


def tiny_scenario(overrides: list[str]):
    return load_scenario("cpu-tiny", overrides)


class Deployment:
    """The prefill processes of one plan (stages, then the engine)."""

    def __init__(self, plan: ServePlan) -> None:
        self.plan = plan
        self.procs: dict[str, subprocess.Popen] = {}
        self.url = ""

    def spawn(self, name: str) -> subprocess.Popen:
        w = self.plan.worker(name)
        log = open(self.plan.log_path(name), "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        p = subprocess.Popen(w.argv(self.plan.path), stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        log.close()
        self.procs[name] = p
        return p

    def start(self) -> Deployment:
        for w in self.plan.by_role("prefill_stage"):
            self.spawn(w.name)
        engine = self.plan.by_role("prefill_engine")[0]
        self.spawn(engine.name)
        p = self.procs[engine.name]
        try:
            ready = wait_ready(self.plan.ready_path(engine.name), READY_WAIT_S, lambda: p.poll() is None)
        except TimeoutError:
            raise RuntimeError(f"the prefill engine did not start:\n{self.logs()}") from None
        self.url = ready["url"]
        return self

    def logs(self) -> str:
        out = []
        for name in self.procs:
            path = self.plan.log_path(name)
            text = path.read_text(errors="replace") if path.exists() else ""
            out.append(f"--- {name} ---\n{text[-3000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(STOP_WAIT_S)

    # -- HTTP -----------------------------------------------------------------------------
    def post(self, path: str, body, timeout_s: float = HTTP_WAIT_S) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        return _open(req, timeout_s)

    def get(self, path: str, timeout_s: float = HTTP_WAIT_S) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


def _open(req, timeout_s: float) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class DecodeSide:
    """Decode instance ``instance``'s ranks (``decode.tp`` of them, DCP over all), on one thread."""

    def __init__(self, plan: ServePlan, instance: int = 0, pages_per_rank: int = 256) -> None:
        from kvpool.backend.handoff import DecodeRank, make_transport

        sc = self.scenario = plan.scenario_model()
        self.plan = plan
        self.config = ref_config(sc)
        self.ranks_n = sc.decode.tp
        self.max_write_bytes = sc.handoff.max_write_bytes
        c = self.config
        # a decode rank's caches as the hand-off sees them: every layer's latent, then every indexer's
        elems = [c.record_elems] * c.layers + [c.index_record_elems] * len(c.indexer_layers)
        self.caches = [[torch.zeros(pages_per_rank, c.page_tokens, e, dtype=c.cache_dtype) for e in elems]
                       for _ in range(self.ranks_n)]
        self.ranks = [DecodeRank(r, self.caches[r], make_transport("ipc"), stages=hp.senders(sc),
                                 slots=sc.serve.landing_slots, slot_bytes=sc.handoff.max_write_bytes)
                      for r in range(self.ranks_n)]
        self.pages_per_rank = pages_per_rank
        self.tables: dict[str, list[torch.Tensor]] = {}
        self._next_page = [0] * self.ranks_n
        self._cmds: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-side", daemon=True)
        self._thread.start()
        name = next(w.name for w in plan.by_role("decode_engine") if w.instance == instance)
        write_ready(plan.ready_path(name), {"url": "http://127.0.0.1:9", "rank_endpoints": [r.endpoint for r in self.ranks]})

    def _run(self) -> None:
        while not self._stop.is_set():
            while True:
                try:
                    fn, fut = self._cmds.get_nowait()
                except queue.Empty:
                    break
                try:
                    fut.set_result(fn())
                except Exception as e:
                    fut.set_exception(e)
            for r in self.ranks:
                r.poll(0.0)
            time.sleep(0.001)

    def _do(self, fn, timeout_s: float = 10.0):
        fut: Future = Future()
        self._cmds.put((fn, fut))
        return fut.result(timeout_s)

    def expect(self, rid: str, n_tokens: int) -> None:
        """Pages on every rank (fresh, not zeroed: they may hold earlier requests' bytes) and every rank's WANT."""
        from kvpool.backend.handoff import StagePart

        c = self.config
        R = self.ranks_n

        def run() -> None:
            tables = []
            for r, rank in enumerate(self.ranks):
                local = rank_token_count(n_tokens, r, R)
                pages = -(-max(local, 1) // c.page_tokens)
                if self._next_page[r] + pages > self.pages_per_rank:
                    self._next_page[r] = 0
                ids = torch.arange(self._next_page[r], self._next_page[r] + pages, dtype=torch.int64).flip(0)
                self._next_page[r] += pages
                tables.append(ids)
                parts = {sender: StagePart(plan, start) for s in range(len(c.stage_layers))
                         for sender, (plan, start) in hp.stage_parts(self.scenario, s, n_tokens).items()}
                rank.expect(rid, ids, parts)
            self.tables[rid] = tables

        self._do(run)

    def wait(self, rid: str, timeout_s: float = 30.0) -> list[str]:
        """Every rank's status once all are ready or failed (or at the deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = self._do(lambda: [r.status(rid) for r in self.ranks])
            if all(s != "pending" for s in states) or time.monotonic() > deadline:
                return states
            time.sleep(0.01)

    def rank_kv(self, rid: str, n_tokens: int, rank: int) -> torch.Tensor:
        """What landed on ``rank`` as 1-D uint8: for each cache (latents, then indexers, in layer
        order), the records of the rank's tokens in DCP order."""
        c = self.config
        R = self.ranks_n

        def run() -> torch.Tensor:
            table = self.tables[rid][rank]
            local = list(range(rank, n_tokens, R))
            return torch.cat([torch.stack([cache[table[(p // R) // c.page_tokens], (p // R) % c.page_tokens]
                                           for p in local]).view(torch.uint8).reshape(-1)
                              for cache in self.caches[rank]]).clone()

        return self._do(run)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        for r in self.ranks:
            r.close()


class Reference:
    """``RefModel.prefill`` of a whole prompt in this process: logits and the KV in DCP order
    (``DecodeSide.rank_kv``'s layout)."""

    def __init__(self, plan: ServePlan) -> None:
        torch.set_num_threads(1)
        self.config = ref_config(plan.scenario_model())
        self.model = RefModel(self.config)
        self.ranks = plan.scenario_model().decode.tp

    def run(self, tokens: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        c = self.config
        pages = -(-len(tokens) // c.page_tokens)
        caches = self.model.new_caches(pages)
        table = torch.arange(pages, dtype=torch.int32)
        logits = self.model.prefill(tokens, caches, table, 0)
        segments = [seg for s in range(len(c.stage_layers)) for seg in c.stage_segments(s)]
        flat = [cache for stage in caches for cache in stage]
        flat = [t for (_, rec), t in zip(segments, flat) if rec == "kv"] + \
               [t for (_, rec), t in zip(segments, flat) if rec != "kv"]
        per_rank = []
        for r in range(self.ranks):
            pos = list(range(r, len(tokens), self.ranks))
            per_rank.append(torch.cat([torch.stack([cache[p // c.page_tokens, p % c.page_tokens] for p in pos])
                                       .view(torch.uint8).reshape(-1) for cache in flat]).clone())
        return logits, per_rank


def make_plan(run_dir: Path, overrides: list[str]) -> ServePlan:
    plan = build_plan(tiny_scenario(overrides), run_dir, router_port=0)
    plan.write()
    return plan


@contextmanager
def running(run_dir: Path, overrides: list[str]) -> Iterator[tuple[Deployment, DecodeSide, Reference]]:
    """A started deployment of ``make_plan(run_dir, overrides)``, its decode side and its reference;
    on exit every process is stopped, and one still running fails the test."""
    plan = make_plan(run_dir, overrides)
    decode = DecodeSide(plan)
    dep = Deployment(plan)
    try:
        dep.start()
        yield dep, decode, Reference(plan)
    finally:
        dep.stop()
        decode.close()
        left = {name: p.pid for name, p in dep.procs.items() if p.poll() is None}
        assert not left, f"processes left running: {left}"


def prompt(n: int, seed: int, prefix: list[int] | None = None) -> list[int]:
    """``prefix`` and then random token ids up to ``n`` tokens (``random.Random(seed)``)."""
    g = random.Random(seed)
    head = list(prefix or [])
    return head + [g.randrange(512) for _ in range(n - len(head))]


def prefill(dep: Deployment, decode: DecodeSide, rid: str, tokens: list[int]) -> dict:
    """``POST /prefill`` of ``tokens`` for decode instance 0 (200 asserted), once every rank holds it."""
    decode.expect(rid, len(tokens))
    status, body = dep.post("/prefill", {"request_id": rid, "token_ids": tokens, "decode_instance": 0})
    assert status == 200, (body, dep.logs())
    assert decode.wait(rid) == ["ready"] * decode.ranks_n
    return body


def assert_matches_reference(decode: DecodeSide, ref: Reference, rid: str, tokens: list[int], body: dict) -> None:
    logits, kv = ref.run(tokens)
    assert body["first_token"] == int(torch.argmax(logits, dim=-1))
    for r in range(decode.ranks_n):
        assert torch.equal(decode.rank_kv(rid, len(tokens), r), kv[r]), f"KV landed on decode rank {r} differs"


def sources(body: dict) -> tuple[int, int, int]:
    """A prefill answer's (GPU, pool, computed) tokens."""
    rec = body["record"]
    return rec["gpu_tokens"], rec["pool_tokens"], rec["computed_tokens"]


__all__ = ["DecodeSide", "Deployment", "Reference", "assert_matches_reference", "make_plan", "prefill", "prompt",
           "running", "sources"]
