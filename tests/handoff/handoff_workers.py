"""Shared geometry, seeded KV, expected decode KV and spawn-able workers of the handoff tests.

Processes talk to the test over ``multiprocessing`` pipes; every ``call`` is bounded. Prefill
stage ``s`` holds layers ``s*L .. s*L+L-1`` of a request of ``TOKENS`` tokens in a seeded random
paged cache; decode rank ``r`` holds every ``R``-th token of all layers in its own paged cache.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from dataclasses import replace
import traceback
from dataclasses import dataclass

import torch

PAGE = 16


@dataclass(frozen=True)
class Geom:
    tokens: int = 1003
    stages: int = 2
    layers: int = 3           # per stage
    ranks: int = 2
    record_bytes: int = 576
    max_write_bytes: int = 64 * 1024
    slots: int = 8
    token_start: int = 0
    model: bool = False       # KV from backend.refmodel's prefill (bf16 latents, 1,152 B records)

    @property
    def total_layers(self) -> int:
        return self.stages * self.layers

    def plan(self):
        from kvpool.policy.layout import HandoffPlan

        return HandoffPlan(self.tokens, self.layers, self.record_bytes, self.ranks, self.max_write_bytes,
                           self.token_start)

    @property
    def prefill_pages(self) -> int:
        return -(-(self.token_start + self.tokens) // PAGE)

    @property
    def decode_pages(self) -> int:
        return -(-(-(-(self.token_start + self.tokens) // self.ranks)) // PAGE)


def ref_model(g: Geom):
    from kvpool.backend.refmodel import RefConfig, RefModel

    return RefModel(RefConfig(stage_layers=(g.layers,) * g.stages, seed=0))


def model_tokens(g: Geom, seed: int = 0) -> torch.Tensor:
    """The prompt (``g.tokens`` tokens) and, last, the next token decode will run."""
    gen = torch.Generator().manual_seed(500 + seed)
    return torch.randint(0, ref_model(g).config.vocab, (g.tokens + 1,), generator=gen)


@functools.lru_cache(maxsize=4)
def _model_caches(g: Geom, seed: int) -> list[list[torch.Tensor]]:
    """Every stage's paged KV after the reference model's prefill of the prompt (computed once)."""
    model = ref_model(g)
    assert g.record_bytes == model.config.record_bytes and g.token_start == 0
    caches = model.new_caches(g.prefill_pages + 5)
    model.prefill(model_tokens(g, seed)[: g.tokens], caches, prefill_table(g, seed))
    return caches


def prefill_caches(g: Geom, stage: int, seed: int = 0, device="cpu") -> list[torch.Tensor]:
    if g.model:
        return [c.to(device) for c in _model_caches(g, seed)[stage]]
    gen = torch.Generator().manual_seed(1000 * seed + stage)
    nb = g.prefill_pages + 5
    return [torch.randint(0, 256, (nb, PAGE, g.record_bytes), dtype=torch.uint8, generator=gen).to(device)
            for _ in range(g.layers)]


def prefill_table(g: Geom, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7 + seed)
    return torch.randperm(g.prefill_pages + 5, generator=gen)[: g.prefill_pages].to(torch.int32)


def decode_table(g: Geom, rank: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank + seed)
    return torch.randperm(g.decode_pages + 3, generator=gen)[: g.decode_pages].to(torch.int64)


def decode_caches(g: Geom, device="cpu") -> list[torch.Tensor]:
    return [torch.zeros(g.decode_pages + 3, PAGE, g.record_bytes, dtype=torch.uint8, device=device)
            for _ in range(g.total_layers)]


def expected_rank_kv(g: Geom, rank: int, seed: int = 0) -> torch.Tensor:
    """``[total_layers, n_r, record]``: what rank ``rank`` must hold, by plain indexing."""
    table = prefill_table(g, seed)
    positions = list(g.plan().rank_positions(rank))
    out = []
    for s in range(g.stages):
        caches = prefill_caches(g, s, seed)
        for c in caches:
            rows = (torch.stack([c[table[p // PAGE], p % PAGE] for p in positions]) if positions
                    else torch.empty(0, c.shape[-1], dtype=c.dtype))
            out.append(rows.view(torch.uint8))
    return torch.stack(out)


def actual_rank_kv(g: Geom, caches: list[torch.Tensor], rank: int, seed: int = 0) -> torch.Tensor:
    table = decode_table(g, rank, seed)
    positions = list(g.plan().rank_positions(rank))
    return torch.stack([
        torch.stack([c[table[(p // g.ranks) // PAGE], (p // g.ranks) % PAGE] for p in positions])
        if positions else torch.empty(0, g.record_bytes, dtype=torch.uint8)
        for c in caches
    ]).cpu()


def make_transport(kind: str):
    from kvpool.backend.handoff import make_transport as mk

    return mk(kind)


def call(conn, cmd, timeout_s: float = 30.0):
    """Send a command to a worker and wait (bounded) for its answer; re-raise its error."""
    conn.send(cmd)
    if not conn.poll(timeout_s):
        raise TimeoutError(f"worker did not answer {cmd[0]!r} within {timeout_s} s")
    kind, value = conn.recv()
    if kind == "error":
        raise RuntimeError(value)
    return value


def decode_main(conn, rank: int, g: Geom, kind: str, opts: dict) -> None:
    """A decode rank process: serve commands and keep polling the side channel."""
    from kvpool.backend.handoff import DecodeRank, HandoffError, StagePart

    device = opts.get("device", "cpu")
    if device != "cpu":
        torch.cuda.set_device(device)
    caches = decode_caches(g, device)
    dr = DecodeRank(rank, caches, make_transport(kind), stages=g.stages, slots=g.slots,
                    slot_bytes=opts.get("slot_bytes", g.max_write_bytes), quarantine_s=opts.get("quarantine_s", 60.0))
    conn.send(("ok", dr.endpoint))
    stall_after = opts.get("stall_after_writes")
    die_after = opts.get("die_after_writes")
    freeze_after = opts.get("freeze_after_writes")
    try:
        while True:
            if die_after is not None and dr.landed_writes >= die_after:
                os._exit(9)
            if freeze_after is not None and dr.landed_writes >= freeze_after:
                freeze_after = None
                os.kill(os.getpid(), signal.SIGSTOP)  # hung: alive, answers nothing (the test resumes it)
            stalled = stall_after is not None and dr.landed_writes >= stall_after
            if conn.poll(0 if not stalled else 0.05):
                cmd = conn.recv()
                try:
                    if cmd[0] == "stop":
                        conn.send(("ok", None))
                        break
                    if cmd[0] == "expect":
                        _, rid, seed, over = cmd
                        gr = replace(g, **over)
                        plan = gr.plan()
                        parts = {s: StagePart(plan, s * g.layers) for s in range(g.stages)}
                        conn.send(("ok", dr.expect(rid, decode_table(gr, rank, seed).to(device), parts)))
                    elif cmd[0] == "wait":
                        res = dr.wait(cmd[1], cmd[2])
                        conn.send(("ok", res))
                    elif cmd[0] == "kv":
                        conn.send(("ok", actual_rank_kv(replace(g, **cmd[2]), caches, rank, cmd[1])))
                    elif cmd[0] == "state":
                        conn.send(("ok", {"quarantined": dr.quarantined_slots, "dropped": dr.dropped_readies,
                                          "landed": dr.landed_writes, "fenced": dr.fenced_readies}))
                    elif cmd[0] == "forget":
                        dr.forget(cmd[1])
                        conn.send(("ok", None))
                except HandoffError as exc:
                    conn.send(("error", f"{type(exc).__name__}: {exc}"))
            if not stalled:
                one = stall_after is not None or die_after is not None or freeze_after is not None
                dr.poll(0.005, max_messages=1 if one else 256)
    except (EOFError, BrokenPipeError):
        pass
    dr.close()
    os._exit(0)  # skip the engine's slow teardown at interpreter exit


def prefill_main(conn, stage: int, g: Geom, kind: str, endpoints: list[str], opts: dict) -> None:
    """A prefill stage process: connect to one decode instance, send requests on command."""
    from kvpool.backend.handoff import HandoffError, PrefillStage

    device = opts.get("device", "cpu")
    transport = make_transport(kind)
    if opts.get("fail_write") is not None:
        transport = FaultyTransport(transport, opts["fail_write"])
    if opts.get("die_on_poll"):
        transport = DyingTransport(transport)
    ps = PrefillStage(stage, transport, staging_bytes=g.plan().total_bytes, device=device,
                      staging_buffers=opts.get("staging_buffers", 1), max_inflight_per_peer=opts.get("max_inflight", 64),
                      credit_timeout_s=opts.get("credit_timeout_s", 5.0), peer_timeout_s=opts.get("peer_timeout_s", 2.0),
                      device_fences=opts.get("device_fences", True))
    targets = {}
    try:
        targets["a"] = ps.connect(endpoints)
        conn.send(("ok", ps.name))
        while True:
            if not conn.poll(60):
                break
            cmd = conn.recv()
            try:
                if cmd[0] == "stop":
                    conn.send(("ok", None))
                    break
                if cmd[0] == "connect":
                    targets[cmd[1]] = ps.connect(cmd[2])
                    conn.send(("ok", None))
                elif cmd[0] == "send":
                    _, rid, seed, tname, timeout_s, over = cmd
                    gr = replace(g, **{k: v for k, v in over.items() if k != "max_inflight"})
                    ps.max_inflight_per_peer = over.get("max_inflight", opts.get("max_inflight", 64))
                    caches = [c.to(device) for c in prefill_caches(gr, stage, seed)]
                    t0 = time.monotonic()
                    try:
                        rep = ps.send(rid, targets[tname], caches, prefill_table(gr, seed).to(device), gr.plan(),
                                      timeout_s=timeout_s)
                        conn.send(("ok", rep))
                    except HandoffError as exc:
                        conn.send(("ok", {"error": type(exc).__name__, "message": str(exc),
                                          "after_s": time.monotonic() - t0}))
                elif cmd[0] == "send_many":   # pipelined: start every request, then finish each
                    _, items, tname, timeout_s = cmd
                    for rid, seed in items:
                        ps.start(rid, targets[tname], [c.to(device) for c in prefill_caches(g, stage, seed)],
                                 prefill_table(g, seed).to(device), g.plan(), timeout_s=timeout_s)
                    conn.send(("ok", [ps.finish(rid) for rid, _ in items]))
                elif cmd[0] == "credits":
                    conn.send(("ok", ps.credits(targets[cmd[1]])))
                elif cmd[0] == "stats":
                    conn.send(("ok", {"submitted": ps.submitted_writes,
                                      "quarantined": [sorted(lk.quarantined) for lk in targets[cmd[1]].links]}))
            except (ValueError, HandoffError) as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    except (EOFError, BrokenPipeError):
        pass
    ps.close()
    os._exit(0)  # skip the engine's slow teardown at interpreter exit


class FaultyTransport:
    """Wraps a transport; the ``fail_at``-th write (0-based) really lands, then reports failure."""

    def __init__(self, inner, fail_at: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.fail_at = fail_at
        self.count = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit_writes(self, peer, src, writes, after=None):
        return [self.submit(peer, src, s, d, n) for s, d, n in writes]

    def submit_group(self, jobs, src, after=None):
        return [self.submit_writes(peer, src, writes, after) for peer, writes in jobs]

    def submit(self, peer, src, src_offset_bytes, dst_offset_bytes, nbytes):
        from kvpool.backend.handoff.transport import FAILED, WriteHandle

        h = self.inner.submit(peer, src, src_offset_bytes, dst_offset_bytes, nbytes)
        n, self.count = self.count, self.count + 1
        if n == self.fail_at:
            while self.inner.poll(h) == 0:
                time.sleep(0.001)
            return WriteHandle(None, FAILED)
        return h


class DyingTransport:
    """Wraps a transport; the process exits (no cleanup) the first time the stage polls a write:
    after its first writes were submitted (and, with fences, their READIES sent)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def poll(self, handle):
        time.sleep(0.3)   # let ZMQ's I/O thread deliver the READIES already sent
        os._exit(9)
