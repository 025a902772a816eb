"""A prefill pipeline stage process: its layers' paged KV, compute, pool connector worker and hand-off sender.

Started as ``python -m kvpool.backend.serve.prefill_stage --plan PLAN --name NAME`` (see
``backend.serve.plan``). It holds, on its device (``Worker.devices[0]``):
    * its layers' paged KV: ``serve.prefill_kv_tokens // model.page_tokens`` pages per layer (a
      latent cache per layer, and an indexer cache per indexer layer when the model has the DSA
      indexer, in ``RefConfig.stage_segments`` order: the pool format's segment order); the engine
      owns the page ids (one block table for every stage);
    * the reference model (``RefModel``, weights seeded from ``serve.model_seed``: every process
      builds the same model) and runs ``stage_forward`` over its layers;
    * its own pool client: ``EmbeddedPool`` of ``cluster.servers * pool.services_per_server *
      pool.gib_per_service / prefill.pp`` GiB for this stage's keys (``serve.pool = "embedded"``),
      or a ``MooncakePool`` client (``serve.pool = "mooncake"``; the address is the plan's
      ``pool_address``, ``mooncake://HOST:PORT?metrics=M``);
    * the connector's worker side (``ConnectorWorker``: pool reads into registered buffers and
      unpack, pack and pool writes with group ids);
    * the hand-off senders (``backend.handoff.PrefillStage`` over ``make_transport("ipc")``), one
      per part of ``handoff_plan.stage_parts``: the latents (sender id ``stage``) and, on a stage
      with indexer layers, the indexer records (sender id ``handoff_plan.index_sender``); each is
      attached to the ranks a decode engine listens to for this prefill instance (its ready file's
      ``rank_endpoints_by_prefill[instance]``) the first time a hand-off goes to it, and again after
      that decode instance's side channel was lost.

Commands (``backend.serve.stage_link`` frames on a ROUTER socket bound to ``tcp://127.0.0.1:*``;
the ready file is ``{"pid", "endpoint"}``). Every reply has ``"ok"``; failures carry ``"error"``.
    ``ping``                          -> ``{"stage", "device", "num_blocks"}``
    ``exists {keys}``                 -> ``{"present": [bool] | null}`` (null: the pool gave no answer)
    ``load {plan, blocks}``           -> ``{"report": StageReport}`` (connector load thread)
    ``save {plan, blocks}``           -> ``{"report": StageSaveReport}`` (connector save thread)
    ``compute {items}`` + hidden      -> ``{"forward_s", "queued_s", "handled_s", "first_tokens": {rid: token}}`` + hidden
        ``items``: ``[{"rid", "start", "end", "blocks", "tokens"?, "last"?}]`` in order: tokens
        ``[start, end)`` of each request through its block table. Stage 0 embeds ``tokens`` (the
        ids of ``[start, end)``); later stages take one float32 tensor ``[sum(end - start), d_model]``
        (the previous stage's output, items back to back). A stage other than the last answers its
        output the same way; the last stage answers, for each item with ``"last": true``, the
        greedy first token (argmax of the logits of the item's last token). Hidden states go
        through the engine (stage -> engine -> next stage) as raw frames that no process copies
        (``stage_link``); the output leaves a GPU through page-locked memory. ``forward_s`` is the
        step's time in this stage's layers: from its input on the device to a device
        synchronization after the last item (the input's copy and the output's copy off the device
        are not in it); ``queued_s`` the time from the command's arrival to the step's start
        (behind the steps before it here); ``handled_s`` from the arrival to the answer being
        ready (its output on the CPU), before it is sent.
    ``handoff {rid, decode, blocks, plan, timeout_s}`` -> ``{"report": handoff StageReport}``
        this stage's KV of the request's tokens to every rank of decode instance ``decode``:
        ``plan`` is the latents' plan (``handoff_plan.stage_plan``); the indexer records follow
        with the plan of the same tokens and ranks (``handoff_plan.stage_index_plan``); the report
        sums the parts (bytes, writes, seconds; the largest in-flight peak).
    ``pool {stats}``                  -> ``{"pool", "tier", "up", "reason", "stats"}``: this stage's pool
        client: ``pool`` (``embedded``: this stage's own pool; ``mooncake``: the whole shared pool),
        ``tier`` (``dram``), ``up`` (false: the client lost the Mooncake master and answers every
        call as unanswered; with ``stats`` it first re-probes a lost master, bounded), ``reason``
        (why not up), ``stats`` (with ``stats``: the pool's ``PoolStats`` fields, or null when the
        pool gives none; without: null).
    ``stop``                          -> closes everything and exits 0.
Compute runs on one compute thread (commands in arrival order), hand-offs on one hand-off
thread (one at a time), loads and saves on the connector worker's threads, pool existence checks
on a small pool of threads, ``pool`` on its own thread; the socket thread only moves messages.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict

import torch
import zmq

from kvpool.backend.connector_worker import ConnectorWorker, WorkerConfig, slot_bytes_for
from kvpool.backend.refmodel import RefModel
from kvpool.backend.serve import handoff_plan as hp
from kvpool.backend.serve import stage_link as link
from kvpool.backend.serve.model_config import ref_config
from kvpool.backend.serve.plan import ServePlan, Worker, wait_ready, worker_of_argv, write_ready
from kvpool.policy.layout import HandoffPlan

GIB = 1 << 30
MIB = 1 << 20
#: How long a hand-off waits for a decode engine's ready file before it fails.
DECODE_READY_WAIT_S = 5.0
#: Bound on reading a Mooncake master's metrics for the ``pool`` command.
POOL_METRICS_TIMEOUT_S = 0.5
#: The tier every stage's pool is (the production pools hold DRAM only).
POOL_TIER = "dram"


def pool_capacity_bytes(scenario) -> int:
    """This stage's share of the embedded pool: the deployment's pool DRAM split over the stages."""
    p = scenario.pool
    return int(scenario.cluster.servers * p.services_per_server * p.gib_per_service * GIB / scenario.prefill.pp)


def make_pool(scenario, pool_address: str = ""):
    """This stage's pool client: the embedded pool, or a client of the Mooncake pool at ``pool_address``."""
    if scenario.serve.pool == "mooncake":
        from kvpool.backend.pool.mooncake import MooncakePool, PoolUnavailable
        from kvpool.backend.pool.netns import PublicListenersRefused

        if not pool_address:
            raise SystemExit("error: serve.pool is mooncake but the plan names no pool_address")
        try:
            return MooncakePool(pool_address, metrics_timeout_s=POOL_METRICS_TIMEOUT_S)
        except (ValueError, PoolUnavailable, PublicListenersRefused) as e:
            raise SystemExit(f"error: serve.pool is mooncake, pool_address {pool_address}: {e}") from None
    from kvpool.backend.pool.embedded import EmbeddedPool

    cap = pool_capacity_bytes(scenario)
    if cap <= 0:
        raise SystemExit("error: pool: cluster.servers * pool.services_per_server * pool.gib_per_service is 0")
    return EmbeddedPool(cap, scenario.pool.eviction_policy, high_watermark=scenario.pool.high_watermark,
                        evict_ratio=scenario.pool.evict_ratio)


def merge_reports(reports: list):
    """One ``StageReport`` of a stage's hand-off parts sent one after the other: bytes, writes and
    seconds summed, the largest in-flight peak."""
    from kvpool.backend.handoff.metrics import StageReport

    first = reports[0]
    return StageReport(first.request_id, first.stage, sum(r.handoff_bytes for r in reports),
                       sum(r.handoff_writes for r in reports), sum(r.gather_s for r in reports),
                       sum(r.transfer_s for r in reports), sum(r.credit_wait_s for r in reports),
                       sum(r.handoff_s for r in reports), max(r.peak_inflight for r in reports))


def handoff_staging_bytes(scenario, layers: int, record_bytes: int) -> int:
    """Staging for the largest request one hand-off carries: min(KV room, gate input cap) tokens."""
    tokens = scenario.serve.prefill_kv_tokens
    if scenario.gate.enabled:
        tokens = min(tokens, scenario.gate.max_input_tokens)
    return max(1, tokens * layers * record_bytes)


def _off_device(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the CPU; from a GPU through page-locked memory (the fast copy; torch's host
    allocator keeps the buffers for the next steps)."""
    if x.device.type == "cpu":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x)
    return host


class StageServer:
    """One stage's state and its threads (see the module docstring)."""

    def __init__(self, plan: ServePlan, worker: Worker) -> None:
        self.plan = plan
        self.worker = worker
        sc = self.scenario = plan.scenario_model()
        self.stage = worker.stage
        self.device = torch.device(worker.devices[0])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(1)  # shared cores; the same op order in every process
        self.config = ref_config(sc)
        self.model = RefModel(self.config, device=self.device)
        self.spec = self.model.kv_spec(sc.model.name)
        self.last = self.stage == len(self.config.stage_layers) - 1
        self.num_blocks = sc.serve.prefill_kv_tokens // self.config.page_tokens
        c = self.config
        self.caches = self.model.new_stage_caches(self.stage, self.num_blocks, self.device)  # pool format order
        segments = c.stage_segments(self.stage)
        self.latents = [t for (_, rec), t in zip(segments, self.caches) if rec == "kv"]
        self.indexes = [t for (_, rec), t in zip(segments, self.caches) if rec != "kv"]
        self.pool = make_pool(sc, plan.pool_address)
        chunk = sc.pool.chunk_tokens
        slot = slot_bytes_for(self.spec.chunk_object_bytes(self.stage, chunk))
        chunks_room = max(4, self.num_blocks * c.page_tokens // chunk)
        wc = WorkerConfig(load_buffer_bytes=min(1024 * MIB, chunks_room * slot), save_buffer_bytes=min(256 * MIB, max(4, chunks_room // 2) * slot),
                          chunk_tokens=chunk, load_timeout_s=10.0, save_timeout_s=30.0)
        self.connector = ConnectorWorker(self.pool, self.spec, self.stage, self.caches, wc).start()
        from kvpool.backend.handoff import PrefillStage, make_transport

        self.sender = PrefillStage(self.stage, make_transport("ipc"), device=self.device,
                                   staging_bytes=handoff_staging_bytes(sc, len(self.latents), c.record_bytes))
        self.index_sender = None if not self.indexes else PrefillStage(
            hp.index_sender(sc, self.stage), make_transport("ipc"), device=self.device,
            staging_bytes=handoff_staging_bytes(sc, len(self.indexes), c.index_record_bytes))
        #: (sender id, decode instance) -> the attached target
        self.targets: dict[tuple[int, int], object] = {}
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.waker = link.Waker(self.ctx)
        self.replies: queue.Queue = queue.Queue()
        init = (lambda: torch.cuda.set_device(self.device)) if self.device.type == "cuda" else None  # per-thread device
        self.compute_exec = ThreadPoolExecutor(1, thread_name_prefix=f"stage{self.stage}-compute", initializer=init)
        self.handoff_exec = ThreadPoolExecutor(1, thread_name_prefix=f"stage{self.stage}-handoff", initializer=init)
        self.pool_exec = ThreadPoolExecutor(2, thread_name_prefix=f"stage{self.stage}-pool", initializer=init)
        self.info_exec = ThreadPoolExecutor(1, thread_name_prefix=f"stage{self.stage}-info")
        self.stopping = threading.Event()

    # -- socket thread -----------------------------------------------------------------------
    def reply(self, ident: bytes, header: dict, body: dict, tensors=()) -> None:
        """Queue a reply (any thread); the socket thread sends it."""
        self.replies.put((ident, {"id": header["id"], "cmd": header["cmd"], **body}, list(tensors)))
        self.waker.wake()

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.waker.socket, zmq.POLLIN)
        while not self.stopping.is_set():
            events = dict(poller.poll(200))
            if self.waker.socket in events:
                self.waker.drain()
            self._flush()
            if self.sock in events:
                while True:
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._dispatch(frames[0].bytes, frames[1:])
        self._flush()

    def _flush(self) -> None:
        while True:
            try:
                ident, header, tensors = self.replies.get_nowait()
            except queue.Empty:
                return
            try:
                self.sock.send_multipart([ident, *link.encode(header, tensors)], copy=False)
            except zmq.ZMQError:
                pass  # the engine is gone

    def _dispatch(self, ident: bytes, frames) -> None:
        try:
            header, tensors = link.decode(frames)
        except link.LinkError as e:
            return self.reply(ident, {"id": -1, "cmd": "?"}, {"ok": False, "error": str(e)})
        handler = getattr(self, f"cmd_{header['cmd']}", None)
        if handler is None:
            return self.reply(ident, header, {"ok": False, "error": f"unknown command {header['cmd']!r}"})
        try:
            handler(ident, header, tensors)
        except (link.LinkError, ValueError) as e:
            self.reply(ident, header, {"ok": False, "error": f"{type(e).__name__}: {e}"})

    def _in_thread(self, executor: ThreadPoolExecutor, ident: bytes, header: dict, fn) -> None:
        """Run ``fn() -> (body, tensors)`` on ``executor`` and reply with its result (or its error)."""
        def run() -> None:
            try:
                body, tensors = fn()
                self.reply(ident, header, {"ok": True, **body}, tensors)
            except Exception as e:  # a reply naming the failure, never a silent stage
                traceback.print_exc()
                self.reply(ident, header, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        executor.submit(run)

    def _blocks(self, header: dict) -> torch.Tensor:
        ids = link.int_list(header, "blocks")
        if any(not 0 <= b < self.num_blocks for b in ids):
            raise link.LinkError(f"blocks: ids must be in [0, {self.num_blocks})")
        return torch.tensor(ids, dtype=torch.int32, device=self.device)

    # -- commands ----------------------------------------------------------------------------
    def cmd_ping(self, ident, header, tensors) -> None:
        self.reply(ident, header, {"ok": True, "stage": self.stage, "device": str(self.device), "num_blocks": self.num_blocks})

    def cmd_stop(self, ident, header, tensors) -> None:
        self.reply(ident, header, {"ok": True})
        self.stopping.set()

    def cmd_exists(self, ident, header, tensors) -> None:
        keys = link._need(header, "keys", list)
        if not all(isinstance(k, str) for k in keys):
            raise link.LinkError("keys: expected strings")
        self._in_thread(self.pool_exec, ident, header, lambda: ({"present": self.pool.exists(keys)}, ()))

    def cmd_pool(self, ident, header, tensors) -> None:
        with_stats = bool(header.get("stats", False))
        self._in_thread(self.info_exec, ident, header, lambda: (self.pool_state(with_stats), ()))

    def pool_state(self, with_stats: bool) -> dict:
        """The ``pool`` command's answer (module docstring)."""
        reach = getattr(self.pool, "reachability", None)
        if reach is None:
            up = True
        else:
            up = self.pool.reachable() if with_stats else reach.up
        stats = self.pool.stats() if with_stats else None
        return {"pool": self.scenario.serve.pool, "tier": POOL_TIER, "up": up,
                "reason": "" if up or reach is None else reach.reason, "stats": asdict(stats) if stats else None}

    def cmd_load(self, ident, header, tensors) -> None:
        plan = link.load_plan_from_json(header.get("plan"))
        fut = self.connector.submit_load(plan, self._blocks(header))
        self._on_done(fut, ident, header)

    def cmd_save(self, ident, header, tensors) -> None:
        plan = link.save_plan_from_json(header.get("plan"))
        fut = self.connector.submit_save(plan, self._blocks(header))
        self._on_done(fut, ident, header)

    def _on_done(self, fut: Future, ident: bytes, header: dict) -> None:
        def done(f: Future) -> None:
            try:
                self.reply(ident, header, {"ok": True, "report": asdict(f.result())})
            except Exception as e:
                self.reply(ident, header, {"ok": False, "error": f"{type(e).__name__}: {e}"})
        fut.add_done_callback(done)

    def cmd_compute(self, ident, header, tensors) -> None:
        items = link._need(header, "items", list)
        parsed = []
        total = 0
        for it in items:
            start, end = link._need(it, "start", int), link._need(it, "end", int)
            if not 0 <= start < end or start % self.config.page_tokens:
                raise link.LinkError(f"items: range [{start}, {end}) must be non-empty and start on a page boundary")
            blocks = self._blocks(it)
            if blocks.numel() * self.config.page_tokens < end:
                raise link.LinkError(f"items: {blocks.numel()} blocks cannot hold {end} tokens")
            toks = None
            if self.stage == 0:
                toks = link.int_list(it, "tokens")
                if len(toks) != end - start or any(not 0 <= t < self.config.vocab for t in toks):
                    raise link.LinkError(f"items: tokens must be {end - start} ids in [0, {self.config.vocab})")
            parsed.append((link._need(it, "rid", str), start, end, blocks, toks, bool(it.get("last", False))))
            total += end - start
        if self.stage > 0:
            if len(tensors) != 1 or tuple(tensors[0].shape) != (total, self.config.d_model) or tensors[0].dtype != torch.float32:
                raise link.LinkError(f"compute: expected one float32 tensor [{total}, {self.config.d_model}]")
        received = time.perf_counter()
        self._in_thread(self.compute_exec, ident, header, lambda: self._compute(parsed, tensors, received))

    def _compute(self, items, tensors, received: float):
        started = time.perf_counter()
        x_in = tensors[0].to(self.device) if self.stage > 0 else None
        outs, first = [], {}
        off = 0
        t0 = time.perf_counter()
        for rid, start, end, blocks, toks, last in items:
            n = end - start
            x = self.model.embed_tokens(toks) if x_in is None else x_in[off:off + n]
            off += n
            h = self.model.stage_forward(self.stage, x, start, self.caches, blocks)
            if self.last:
                if last:
                    first[rid] = int(torch.argmax(self.model.logits(h[-1:]), dim=-1).item())
            else:
                outs.append(h)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        forward_s = time.perf_counter() - t0
        times = {"forward_s": forward_s, "queued_s": started - received}
        if self.last:
            return {"first_tokens": first, **times, "handled_s": time.perf_counter() - received}, ()
        out = _off_device(torch.cat(outs).float())
        return {**times, "handled_s": time.perf_counter() - received}, (out,)

    def cmd_handoff(self, ident, header, tensors) -> None:
        rid = link._need(header, "rid", str)
        decode = link._need(header, "decode", int)
        names = {w.instance: w for w in self.plan.by_role("decode_engine")}
        if decode not in names:
            raise link.LinkError(f"decode: no decode instance {decode} in the plan")
        hplan = link.handoff_plan_from_json(header.get("plan"))
        if hplan.layers != len(self.latents) or hplan.record_bytes != self.config.record_bytes:
            raise link.LinkError(f"plan: {hplan.layers} layers of {hplan.record_bytes} B records; this stage's "
                                 f"latents are {len(self.latents)} layers of {self.config.record_bytes} B")
        blocks = self._blocks(header)
        timeout_s = float(link._need(header, "timeout_s", (int, float)))
        self._in_thread(self.handoff_exec, ident, header,
                        lambda: ({"report": asdict(self._handoff(rid, names[decode], blocks, hplan, timeout_s))}, ()))

    def _target(self, sender, decode_worker: Worker):
        from kvpool.backend.handoff import HandoffError

        key = (sender.stage, decode_worker.instance)
        target = self.targets.get(key)
        if target is not None and target.alive:
            return target
        if target is not None:
            sender.disconnect(target)
            del self.targets[key]
        try:
            ready = wait_ready(self.plan.ready_path(decode_worker.name), DECODE_READY_WAIT_S)
        except TimeoutError as e:
            raise HandoffError(f"decode instance {decode_worker.instance} ({decode_worker.name}) is not ready: {e}") from None
        # the ranks this prefill instance writes to (a decode engine listens to each instance apart)
        by_prefill = ready.get("rank_endpoints_by_prefill")
        eps = by_prefill[self.worker.instance] if isinstance(by_prefill, list) and len(by_prefill) > self.worker.instance \
            else ready.get("rank_endpoints")
        if not isinstance(eps, list) or not eps or not all(isinstance(e, str) for e in eps):
            raise HandoffError(f"{decode_worker.name}'s ready file has no rank endpoints for prefill instance "
                               f"{self.worker.instance}")
        target = self.targets[key] = sender.connect(eps)
        return target

    def _handoff(self, rid, decode_worker, blocks, hplan, timeout_s):
        """The latents, then (with the indexer) the indexer records of the same tokens; one summed report."""
        t0 = time.monotonic()
        parts = [(self.sender, self.latents, hplan)]
        if self.index_sender is not None:
            parts.append((self.index_sender, self.indexes, HandoffPlan(
                hplan.tokens, len(self.indexes), self.config.index_record_bytes, hplan.ranks, hplan.max_write_bytes,
                hplan.token_start)))
        reports = []
        for sender, caches, plan in parts:
            target = self._target(sender, decode_worker)
            left = max(0.1, timeout_s - (time.monotonic() - t0))
            reports.append(sender.send(rid, target, caches, blocks, plan, timeout_s=left))
        return merge_reports(reports)

    def close(self) -> None:
        for ex in (self.compute_exec, self.handoff_exec, self.pool_exec, self.info_exec):
            ex.shutdown(wait=False, cancel_futures=True)
        try:
            self.connector.close()
        finally:
            self.sender.close()
            if self.index_sender is not None:
                self.index_sender.close()
            self.pool.close()
            self.sock.close(0)
            self.waker.close()


def main(argv: list[str] | None = None) -> int:
    plan, worker = worker_of_argv("prefill_stage", argv)
    server = StageServer(plan, worker)
    signal.signal(signal.SIGTERM, lambda *_: server.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: server.stopping.set())
    write_ready(plan.ready_path(worker.name), {"endpoint": server.endpoint, "stage": worker.stage})
    print(json.dumps({"serving": worker.name, "endpoint": server.endpoint, "device": str(server.device)}), flush=True)
    try:
        server.serve()
    finally:
        server.close()
    sys.stdout.flush()
    os._exit(0)  # no slow interpreter teardown of the transports' threads


if __name__ == "__main__":
    sys.exit(main())
