#!/usr/bin/env python3
"""The prefill -> decode handoff: large writes against per-token writes, and against the limit.

(a) default, loopback TCP between two processes (run inside a private network namespace:
    ``unshare -n sh -c 'ip link set lo up; exec .venv/bin/python bench/handoff.py'``):
    the seed's example, 8,192 tokens x one 20-layer stage x 576 B to 4 decode ranks (94,371,840 B),
      * ``large``: the handoff itself (``PrefillStage.send`` -> 4 ``DecodeRank``s over Mooncake
        Transfer Engine TCP): gather, 12 writes of <= 8 MiB, READY/credit per write, scatter.
        ``transfer_*`` counts the writes only (first submit to last completion, sender side);
        ``end_to_end_*`` from the send command to every rank ready (gather + writes + scatter).
      * ``per_token``: the same bytes as 163,840 writes of 576 B, one per token per layer, straight
        from the prefill pages into the ranks' buffers through the same engine, in batches of
        ``--batch`` (<= 1024 in flight to the one peer); ``--naive-writes`` runs a subset, scaled.
      * ``large_writes_only``: the same 12 writes alone (staging -> the ranks' buffers through the
        engine, all in flight, no gather/scatter/side channel): the like-for-like comparison.
      * ``socket``: a plain TCP socket sending the same bytes (the loopback limit), same run.
(b) ``--gpu`` on a 2-GPU machine: prefill stage on cuda:0, 4 decode ranks on cuda:1 (one process
    per rank; ``--decode-procs 1`` puts them in one), ``IpcTransport`` (CUDA IPC, copies over
    NVLink/PCIe): ``--requests`` handoffs back to back, pipelined (``start`` all, then ``finish``;
    ``--staging-buffers``) and sequential (``send`` each); GB/s of gather + transfer + scatter,
    best and median rounds, against torch's own cuda:0 -> cuda:1 copy of the same bytes in the same
    run (best of 3; goal >= 0.8), the sustained rate of each round (from its first quarter's last
    request ready to its last: pipeline fill left out) and its first request's latency, the data
    path alone (no host waits), a per-request timeline with decode-side timestamps, the writes
    alone and the bound kernels' rates; the last request's decode KV is checked bit-exact.
    READIES carry the copies' interprocess events (device fences) unless ``--no-fences``.
    ``--tokens`` sets the request size (default the seed's 8,192; a whole agentic prompt, as the
    decode receives it, is 100K+ tokens). ``--mps`` runs the GPU processes under a private NVIDIA MPS daemon: the 4 decode processes then
    share cuda:1 without time-slicing, the nearest a 2-GPU machine gets to one rank per GPU.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def _import_kvpool() -> None:
    """Use the installed kvpool, or map this source tree's folders into ``kvpool`` (a GPU host without an install)."""
    try:
        import kvpool.backend.handoff  # noqa: F401
    except ModuleNotFoundError:
        root = Path(__file__).resolve().parents[1]
        sys.path.insert(0, str(root))
        import kvpool

        shim = Path(tempfile.mkdtemp(prefix="kvpool-shim-"))
        for sub in ("policy", "backend", "kernels"):
            (shim / sub).symlink_to(root / sub)
        kvpool.__path__.append(str(shim))


_import_kvpool()

import torch  # noqa: E402

from kvpool.backend.handoff import DecodeRank, PrefillStage, StagePart, make_transport  # noqa: E402
from kvpool.kernels import GatherDcp, ScatterDcp, gather_dcp, rank_buffer_offset_bytes, scatter_dcp  # noqa: E402
from kvpool.policy.layout import MIB, HandoffPlan  # noqa: E402

PAGE = 16
TOKENS, LAYERS, RECORD, RANKS = 8192, 20, 576, 4
SEED_PLAN = HandoffPlan(TOKENS, LAYERS, RECORD, RANKS)


def prefill_kv(plan: HandoffPlan, device: str):
    gen = torch.Generator().manual_seed(0)
    pages = -(-plan.tokens // PAGE)
    caches = [torch.randint(0, 256, (pages, PAGE, plan.record_bytes), dtype=torch.uint8, generator=gen).to(device)
              for _ in range(plan.layers)]
    table = torch.randperm(pages, generator=gen).to(torch.int32).to(device)
    return caches, table


def decode_kv(plan: HandoffPlan, rank: int, device: str):
    pages = -(-plan.rank_tokens(rank) // PAGE)
    gen = torch.Generator().manual_seed(10 + rank)
    caches = [torch.zeros(pages, PAGE, plan.record_bytes, dtype=torch.uint8, device=device) for _ in range(plan.layers)]
    return caches, torch.randperm(pages, generator=gen).to(torch.int64).to(device)


def _answer(conn, fn) -> None:
    try:
        conn.send(("ok", fn()))
    except Exception as exc:  # noqa: BLE001 - report any worker failure to the parent, then go on
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _call(conn, *cmd, timeout_s: float = 300.0):
    conn.send(cmd)
    if not conn.poll(timeout_s):
        raise TimeoutError(f"worker did not answer {cmd[0]!r} within {timeout_s} s")
    kind, value = conn.recv()
    if kind != "ok":
        raise RuntimeError(value)
    return value


# ---- decode process ----------------------------------------------------------------------------

def _transport(kind: str):
    return make_transport(kind, **({"copy_on": os.environ.get("KVPOOL_IPC_COPY_ON", "src")} if kind == "ipc" else {}))


def _profiler():
    """A cProfile profiler when KVPOOL_BENCH_PROFILE names a folder (its stats go there at stop)."""
    if not os.environ.get("KVPOOL_BENCH_PROFILE"):
        return None
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    return prof


def _dump_profile(prof, name: str) -> None:
    if prof is None:
        return
    import io
    import pstats

    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(35)
    Path(os.environ["KVPOOL_BENCH_PROFILE"], f"profile-{name}.txt").write_text(buf.getvalue())


def decode_proc(conn, kind: str, device: str, slots: int, slot_bytes: int = 8 * MIB,
                here: list[int] | None = None, tokens: int = TOKENS) -> None:
    """Decode ranks ``here`` (default: all) in this process; the one holding rank 0 also holds the
    buffer of the writes-only and per-token measurements."""
    here = list(range(RANKS)) if here is None else list(here)
    prof = _profiler()
    if device != "cpu":
        torch.cuda.set_device(device)
    transport = _transport(kind)
    plan = HandoffPlan(tokens, LAYERS, RECORD, RANKS)
    kv = {r: decode_kv(plan, r, device) for r in here}
    ranks = [DecodeRank(r, kv[r][0], transport, stages=1, slots=slots, slot_bytes=slot_bytes, validate=False)
             for r in here]
    naive_desc = None
    if 0 in here:
        naive = transport.allocate(plan.total_bytes, device)
        naive_desc = transport.expose(naive)
    conn.send(("ok", [dr.endpoint for dr in ranks]))
    ends: dict[str, float] = {}
    pending: dict[str, None] = {}   # in expect order

    def _settle() -> None:
        # requests complete in order: look at the oldest pending ones only (a cheap harness)
        for rid in list(pending):
            if any(dr.status(rid) == "pending" for dr in ranks):
                break
            del pending[rid]
            ends[rid] = time.monotonic()

    while True:
        if len(ranks) == 1 and not ranks[0].scattering:
            ranks[0].poll(0.001)   # one rank (as deployed): sleep in zmq until a message, not spin
        else:
            for dr in ranks:
                dr.poll(0)
        _settle()
        if not conn.poll(0 if pending or len(ranks) == 1 else 0.0005):
            continue
        cmd = conn.recv()
        if cmd[0] == "stop":
            _dump_profile(prof if 0 in here else None, "decode")
            conn.send(("ok", None))
            break
        if cmd[0] == "expect":
            for rid in cmd[1]:
                for dr in ranks:
                    dr.expect(rid, kv[dr.rank][1], {0: StagePart(plan, 0)})
                pending[rid] = None
            conn.send(("ok", None))
        elif cmd[0] == "wait":
            def wait(rids=cmd[1]):
                deadline = time.monotonic() + 120
                while any(r in pending for r in rids):
                    if time.monotonic() > deadline:
                        raise TimeoutError("requests not ready within 120 s")
                    for dr in ranks:
                        dr.poll(0)
                    _settle()
                bad = [(rid, dr.error(rid)) for rid in rids for dr in ranks if dr.status(rid) != "ready"]
                if bad:
                    raise RuntimeError(f"failed: {bad[:2]}")
                res = {rid: [dr.wait(rid, 1) for dr in ranks] for rid in rids}
                times = {rid: [dr.times(rid) for dr in ranks] for rid in rids}
                for rid in rids:
                    for dr in ranks:
                        dr.forget(rid)
                return {"end_s": max(ends[r] for r in rids), "results": res, "ends": {r: ends[r] for r in rids},
                        "times": times}
            _answer(conn, wait)
        elif cmd[0] == "naive_desc":
            conn.send(("ok", naive_desc))
        elif cmd[0] == "kv":
            conn.send(("ok", {r: torch.stack([c[kv[r][1]].cpu() for c in kv[r][0]]) for r in here}))
        elif cmd[0] == "socket":
            _answer(conn, lambda: _socket_server(cmd[1], cmd[2]))
    for dr in ranks:
        dr.close()
    os._exit(0)


def _socket_server(nbytes: int, reps: int) -> int:
    """Start a thread that receives ``reps`` blobs of ``nbytes`` on 127.0.0.1 and acks each."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(60)

    def run() -> None:
        conn, _ = srv.accept()
        conn.settimeout(60)
        buf = bytearray(nbytes)
        view = memoryview(buf)
        for _ in range(reps):
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got:], nbytes - got)
                if n == 0:
                    return
                got += n
            conn.sendall(b"k")
        conn.close()
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[1]


# ---- prefill process ---------------------------------------------------------------------------

def prefill_proc(conn, kind: str, device: str, endpoints: list[str], staging_buffers: int = 1,
                 device_fences: bool = True, tokens: int = TOKENS) -> None:
    prof = _profiler()
    if device != "cpu":
        torch.cuda.set_device(device)
    transport = _transport(kind)
    plan = HandoffPlan(tokens, LAYERS, RECORD, RANKS)
    caches, table = prefill_kv(plan, device)
    stage = PrefillStage(0, transport, staging_bytes=plan.total_bytes, device=device, validate=False,
                         credit_timeout_s=30.0, staging_buffers=staging_buffers, device_fences=device_fences)
    target = stage.connect(endpoints)
    conn.send(("ok", None))
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            _dump_profile(prof, "prefill")
            conn.send(("ok", None))
            break
        if cmd[0] == "send":
            def send(rids=cmd[1], pipelined=cmd[2] if len(cmd) > 2 else False):
                # The decode ranks' WANTs (pages allocated) arrive while the prefill computes, so
                # the clock starts once the stage holds them; how long handling them took is reported.
                tw = time.monotonic()
                while not all(rid in link.wants for link in target.links for rid in rids):
                    if time.monotonic() - tw > 30:
                        raise TimeoutError("WANTs did not arrive within 30 s")
                    stage.progress(0.001)
                want_s = time.monotonic() - tw
                t0 = time.monotonic()
                marks = {}   # request -> (start called, start returned, finish returned), monotonic
                if pipelined:   # start every request (each waits only for a free staging buffer), then finish
                    for rid in rids:
                        t = time.monotonic()
                        stage.start(rid, target, caches, table, plan, timeout_s=120)
                        marks[rid] = [t, time.monotonic()]
                    reps = []
                    for rid in rids:
                        reps.append(stage.finish(rid))
                        marks[rid].append(time.monotonic())
                else:
                    reps = []
                    for rid in rids:
                        t = time.monotonic()
                        reps.append(stage.send(rid, target, caches, table, plan, timeout_s=120))
                        marks[rid] = [t, t, time.monotonic()]
                return {"start_s": t0, "reports": reps, "marks": marks, "want_s": want_s}
            _answer(conn, send)
        elif cmd[0] == "large_raw":
            _answer(conn, lambda: _large_raw(transport, stage.staging, plan, cmd[1], cmd[2], *cmd[3:]))
        elif cmd[0] == "naive":
            _answer(conn, lambda: _naive(transport, caches, table, plan, cmd[1], cmd[2], cmd[3]))
        elif cmd[0] == "socket":
            _answer(conn, lambda: _socket_send(cmd[1], stage.staging.narrow(0, 0, plan.total_bytes), cmd[2]))
        elif cmd[0] == "ceiling":
            _answer(conn, lambda: _ceiling(stage, target, caches, table, plan, cmd[1]))
        elif cmd[0] == "device_copy":
            _answer(conn, lambda: _device_copy(plan.total_bytes, cmd[1], cmd[2]))
        elif cmd[0] == "kernels":
            _answer(conn, lambda: _kernel_rates(caches, table, plan, cmd[1]))
    stage.close()
    os._exit(0)


def _naive(transport, caches, table, plan: HandoffPlan, desc: dict, writes: int, batch: int) -> dict:
    """One 576 B write per (token, layer) from its page into its place in the rank's buffer."""
    peer = transport.open(desc)
    rank_base = [sum(plan.buffer_bytes(q) for q in range(r)) for r in range(plan.ranks)]
    page_bytes = PAGE * plan.record_bytes
    srcs, dsts = [], []
    for layer in range(plan.layers):
        for r in range(plan.ranks):
            n_r = plan.rank_tokens(r)
            for j, p in enumerate(plan.rank_positions(r)):
                srcs.append((layer, int(table[p // PAGE]) * page_bytes + (p % PAGE) * plan.record_bytes))
                dsts.append(rank_base[r] + (layer * n_r + j) * plan.record_bytes)
    flat = [c.view(-1) for c in caches]
    order = list(range(len(srcs)))[:writes]
    t0 = time.monotonic()
    done = 0
    for layer in range(plan.layers):
        idx = [i for i in order if srcs[i][0] == layer]
        for k in range(0, len(idx), batch):
            chunk = idx[k:k + batch]
            h = transport.submit_many(peer, flat[layer], [srcs[i][1] for i in chunk], [dsts[i] for i in chunk],
                                      [plan.record_bytes] * len(chunk))
            if transport.poll(h) != 1:
                raise RuntimeError("a per-token batch failed")
            done += len(chunk)
    dt = time.monotonic() - t0
    return {"writes": done, "bytes": done * plan.record_bytes, "s": dt}


def _large_raw(transport, staging: torch.Tensor, plan: HandoffPlan, desc: dict, reps: int,
               batched: bool = False) -> dict:
    """The plan's writes alone (no gather, no scatter, no side channel): staging -> the same places
    in the peer's buffer, all submitted at once, polled until done; best of ``reps``. ``batched``:
    one ``submit_writes`` call (adjacent writes merged, one completion) instead of one ``submit``
    per write."""
    peer = transport.open(desc)
    writes = [(sum(plan.buffer_bytes(q) for q in range(w.rank)) + w.offset_bytes, w.nbytes) for w in plan.all_writes()]
    times = []
    submit_s = []
    for _ in range(reps):
        t0 = time.monotonic()
        if batched:
            handles = transport.submit_writes(peer, staging, [(off, off, n) for off, n in writes])
        else:
            handles = [transport.submit(peer, staging, off, off, n) for off, n in writes]
        submit_s.append(time.monotonic() - t0)
        while True:
            states = [transport.poll(h) for h in handles]
            if -1 in states:
                raise RuntimeError("a large write failed")
            if all(st == 1 for st in states):
                break
            time.sleep(0 if staging.is_cuda else 0.0002)
        times.append(time.monotonic() - t0)
    return {"writes": len(writes), "s": min(times), "submit_s": min(submit_s)}


def _ceiling(stage, target, caches, table, plan: HandoffPlan, requests: int) -> dict:
    """The data path alone, no host waits: per request one gather into a staging buffer (waiting on
    the GPU for that buffer's previous copies) and the request's writes to every rank's landing pool
    in one ``submit_group``; timed from the first launch to the last copy's completion."""
    transport = stage.transport
    gop = stage._gather_op(caches)   # noqa: SLF001 - the stage's own bound gather
    bufs = stage._buffers            # noqa: SLF001
    links = target.links
    nw = max(len(plan.writes(link.rank)) for link in links)
    t = time.monotonic()
    while min(len(link.credits) for link in links) < 2 * nw and time.monotonic() - t < 5:
        stage.progress(0.001)   # the last scatters' CREDITs may still be on their way
    slots = [sorted(link.credits) for link in links]
    per = max(1, min(len(x) for x in slots) // nw)
    done = [None] * len(bufs)
    cur = torch.cuda.current_stream()
    torch.cuda.synchronize()
    t0 = time.monotonic()
    last = None
    for i in range(requests):
        b = i % len(bufs)
        if done[b] is not None:
            cur.wait_event(done[b])
        staging = bufs[b].narrow(0, 0, plan.total_bytes)
        gop(table, plan, out=staging, validate=False)
        after = torch.cuda.Event()
        after.record(cur)
        j = i % per
        jobs = []
        for link, sl in zip(links, slots):
            base = rank_buffer_offset_bytes(plan, link.rank)
            jobs.append((link.peer, [(base + w.offset_bytes, sl[nw * j + k] * link.slot_bytes, w.nbytes)
                                     for k, w in enumerate(plan.writes(link.rank))]))
        handles = transport.submit_group(jobs, staging, after)
        done[b] = last = handles[0][0].token
    host = time.monotonic() - t0
    last.synchronize()
    dt = time.monotonic() - t0
    return {"requests": requests, "s": dt, "host_s": host, "gbps": requests * plan.total_bytes / dt / 1e9}


def _socket_send(port: int, staging: torch.Tensor, reps: int) -> dict:
    data = memoryview(staging.numpy()) if staging.device.type == "cpu" else memoryview(staging.cpu().numpy())
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    times = []
    for _ in range(reps):
        t0 = time.monotonic()
        s.sendall(data)
        if s.recv(1) != b"k":
            raise RuntimeError("socket receiver did not ack")
        times.append(time.monotonic() - t0)
    s.close()
    return {"bytes": staging.numel(), "s": min(times)}


def _device_copy(nbytes: int, reps: int, dst_device: str) -> dict:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    dst.copy_(src)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize(dst_device)
    t0 = time.monotonic()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize(dst_device)
    dt = time.monotonic() - t0
    return {"bytes": nbytes * reps, "s": dt, "gbps": nbytes * reps / dt / 1e9}


def _kernel_rates(caches, table, plan: HandoffPlan, reps: int) -> dict:
    out = torch.empty(plan.total_bytes, dtype=torch.uint8, device=caches[0].device)
    gather_dcp(caches, table, plan, out=out, validate=False)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    for _ in range(reps):
        gather_dcp(caches, table, plan, out=out, validate=False)
    torch.cuda.synchronize()
    g = (time.monotonic() - t0) / reps
    dcaches, dtable = decode_kv(plan, 0, str(caches[0].device))
    view = out.narrow(0, 0, plan.buffer_bytes(0))
    scatter_dcp(view, dcaches, dtable, plan, 0, validate=False)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    for _ in range(reps):
        scatter_dcp(view, dcaches, dtable, plan, 0, validate=False)
    torch.cuda.synchronize()
    s = (time.monotonic() - t0) / reps
    out_rates = {"gather_gbps": plan.total_bytes / g / 1e9, "scatter_rank_buffer_gbps": plan.buffer_bytes(0) / s / 1e9}
    # the bound ops the handoff uses: host time per call (back to back) and GPU time (events)
    gop, sop = GatherDcp(caches), ScatterDcp(dcaches)
    segs = [(w.offset_bytes, w.offset_bytes, w.nbytes) for w in plan.writes(0)]
    for name, fn, nbytes in (("bound_gather", lambda: gop(table, plan, out=out, validate=False), plan.total_bytes),
                             ("bound_scatter_rank", lambda: sop(view, dtable, plan, 0, segs, validate=False),
                              plan.buffer_bytes(0))):
        fn()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000_000)   # the launches queue behind it: e0..e1 is GPU time alone
        e0.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host = (time.perf_counter() - t0) / reps
        e1.record()
        e1.synchronize()
        gpu = e0.elapsed_time(e1) / 1e3 / reps
        out_rates[name] = {"host_us_per_call": host * 1e6, "gpu_us_per_call": gpu * 1e6, "gbps": nbytes / gpu / 1e9}
    return out_rates


# ---- driver ------------------------------------------------------------------------------------

def _start(ctx, target, *args):
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(child, *args), daemon=True)
    p.start()
    if not parent.poll(180):
        raise TimeoutError(f"{target.__name__} did not start")
    kind, value = parent.recv()
    if kind != "ok":
        raise RuntimeError(value)
    return p, parent, value


def run_tcp(args) -> dict:
    plan = SEED_PLAN
    ctx = mp.get_context("spawn")
    dp, d, endpoints = _start(ctx, decode_proc, "mooncake", "cpu", args.slots or 8)
    pp, p, _ = _start(ctx, prefill_proc, "mooncake", "cpu", endpoints)
    try:
        large = []
        for i in range(args.reps):
            rid = f"r{i}"
            _call(d, "expect", [rid])
            t0 = time.monotonic()
            sent = _call(p, "send", [rid])
            waited = _call(d, "wait", [rid])
            rep = sent["reports"][0]
            large.append({"transfer_s": rep.transfer_s, "gather_s": rep.gather_s, "writes": rep.handoff_writes,
                          "end_to_end_s": waited["end_s"] - t0, "stage_s": rep.handoff_s})
        best = min(large, key=lambda x: x["transfer_s"])
        raw = _call(p, "large_raw", _call(d, "naive_desc"), args.reps)
        n_naive = min(args.naive_writes or plan.naive_writes, plan.naive_writes)
        naive = _call(p, "naive", _call(d, "naive_desc"), n_naive, args.batch, timeout_s=900)
        port = _call(d, "socket", plan.total_bytes, 3)
        sock = _call(p, "socket", port, 3)
    finally:
        for conn in (p, d):
            try:
                _call(conn, "stop", timeout_s=30)
            except (TimeoutError, RuntimeError, OSError, EOFError):
                pass
        for proc in (pp, dp):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    gb = plan.total_bytes / 1e9
    naive_scaled_s = naive["s"] * plan.naive_writes / naive["writes"]
    out = {
        "mode": "loopback_tcp_mooncake",
        "plan": {"tokens": TOKENS, "layers": LAYERS, "record_bytes": RECORD, "ranks": RANKS,
                 "bytes": plan.total_bytes, "batched_writes": plan.batched_writes, "naive_writes": plan.naive_writes},
        "load_avg_1min": os.getloadavg()[0],
        "large_writes_only": {
            "writes": raw["writes"], "s": raw["s"], "writes_per_s": raw["writes"] / raw["s"],
            "gbps": gb / raw["s"],
        },
        "large": {
            "writes": best["writes"],
            "transfer_s": best["transfer_s"],
            "writes_per_s": best["writes"] / best["transfer_s"],
            "transfer_gbps": gb / best["transfer_s"],
            "gather_s": best["gather_s"],
            "end_to_end_s": best["end_to_end_s"],
            "end_to_end_gbps": gb / best["end_to_end_s"],
            "reps": large,
        },
        "per_token": {
            "writes_measured": naive["writes"],
            "measured_s": naive["s"],
            "scaled_to_all": naive["writes"] < plan.naive_writes,
            "s": naive_scaled_s,
            "writes_per_s": naive["writes"] / naive["s"],
            "gbps": naive["bytes"] / naive["s"] / 1e9,
            "batch": args.batch,
        },
        "socket": {"s": sock["s"], "gbps": gb / sock["s"]},
    }
    out["ratios"] = {
        "per_token_vs_large_writes_time": naive_scaled_s / raw["s"],
        "large_writes_only_vs_socket": out["large_writes_only"]["gbps"] / out["socket"]["gbps"],
        "per_token_vs_large_time_in_handoff": naive_scaled_s / best["transfer_s"],
        "large_transfer_vs_socket": out["large"]["transfer_gbps"] / out["socket"]["gbps"],
        "large_end_to_end_vs_socket": out["large"]["end_to_end_gbps"] / out["socket"]["gbps"],
        "per_token_vs_socket": out["per_token"]["gbps"] / out["socket"]["gbps"],
    }
    return out


def _call_all(conns, *cmd, timeout_s: float = 300.0) -> list:
    """The same command to several workers at once; their answers in order."""
    for conn in conns:
        conn.send(cmd)
    out = []
    for conn in conns:
        if not conn.poll(timeout_s):
            raise TimeoutError(f"worker did not answer {cmd[0]!r} within {timeout_s} s")
        kind, value = conn.recv()
        if kind != "ok":
            raise RuntimeError(value)
        out.append(value)
    return out


def _start_all(ctx, target, arg_lists):
    """Start one worker per argument tuple, all at once; ``(procs, conns, first answers)``."""
    started = []
    for args in arg_lists:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, *args), daemon=True)
        p.start()
        started.append((p, parent))
    vals = []
    for p, parent in started:
        if not parent.poll(180):
            raise TimeoutError(f"{target.__name__} did not start")
        kind, value = parent.recv()
        if kind != "ok":
            raise RuntimeError(value)
        vals.append(value)
    return [p for p, _ in started], [c for _, c in started], vals


def run_gpu(args) -> dict:
    plan = HandoffPlan(args.tokens, LAYERS, RECORD, RANKS)
    if torch.cuda.device_count() < 2:
        raise SystemExit("--gpu needs 2 GPUs")
    ctx = mp.get_context("spawn")
    slot_bytes = plan.max_write_bytes // plan.record_bytes * plan.record_bytes   # slots sized to the plan's writes
    nw = max(len(plan.writes(r)) for r in range(RANKS))
    slots = args.slots or max(24, 2 * nw)   # credits for several requests in flight (3 writes per rank each at 8,192 tokens)
    procs = max(1, min(args.decode_procs, RANKS))
    groups = [list(range(RANKS))[i::procs] for i in range(procs)]   # ranks per decode process
    dps, ds, eps = _start_all(ctx, decode_proc, [("ipc", "cuda:1", slots, slot_bytes, g, args.tokens) for g in groups])
    by_rank = {r: ep for g, e in zip(groups, eps) for r, ep in zip(g, e)}
    endpoints = [by_rank[r] for r in range(RANKS)]
    d0 = ds[next(i for i, g in enumerate(groups) if 0 in g)]
    pp, p, _ = _start(ctx, prefill_proc, "ipc", "cuda:0", endpoints, args.staging_buffers, not args.no_fences,
                      args.tokens)
    try:
        runs: dict[str, list] = {"pipelined": [], "sequential": []}
        for rnd in range(args.reps):
            for mode in ("pipelined", "sequential"):
                rids = [f"g{rnd}-{mode[0]}{i}" for i in range(args.requests)]
                _call_all(ds, "expect", rids)
                sent = _call(p, "send", rids, mode == "pipelined")
                waits = _call_all(ds, "wait", rids)
                end_s = max(w["end_s"] for w in waits)
                ends = {rid: max(w["ends"][rid] for w in waits) for rid in rids}
                results = {rid: sorted((x for w in waits for x in w["results"][rid]), key=lambda x: x.rank)
                           for rid in rids}
                total_s = end_s - sent["start_s"]
                reps = sent["reports"]
                res = [x for rid in rids for x in results[rid]]
                t0 = sent["start_s"]
                timeline = [[round((x - t0) * 1e3, 3) for x in sent["marks"][rid]] + [round((ends[rid] - t0) * 1e3, 3)]
                            for rid in rids]
                # per request: stage's last READIES sent; on the slowest rank: first READIES handled,
                # scatter launched, ready (ms from the clock's start)
                sent_at = {rep.request_id: sent["marks"][rep.request_id][0] + rep.handoff_s for rep in sent["reports"]}
                detail = []
                for rid in rids:
                    tt = max((x for w in waits for x in w["times"][rid]), key=lambda x: x[2])
                    detail.append([round((x - t0) * 1e3, 3) for x in (sent_at[rid], *tt)])
                # sustained rate: from the first quarter's last request ready to the last request
                # ready (the pipeline's fill and the first request's latency left out)
                order = sorted(ends[rid] for rid in rids)
                k0 = len(order) // 4
                steady = ((len(order) - 1 - k0) * plan.total_bytes / (order[-1] - order[k0]) / 1e9
                          if len(order) > k0 + 1 and order[-1] > order[k0] else 0.0)
                runs[mode].append({"requests": len(rids), "s": total_s,
                                   "gbps": len(rids) * plan.total_bytes / total_s / 1e9,
                                   "sustained_gbps": steady,
                                   "first_ready_ms": round((order[0] - sent["start_s"]) * 1e3, 3),
                                   "want_handling_s_before_clock": sent["want_s"],
                                   "timeline_ms": timeline,
                                   "readies_sent_first_handled_launched_ready_ms": detail,
                                   "scatter_host_s_per_rank_request": sum(x.scatter_s for x in res) / len(res),
                                   "gather_host_s_per_request": sum(r.gather_s for r in reps) / len(rids),
                                   "transfer_s_per_request": sum(r.transfer_s for r in reps) / len(rids),
                                   "credit_wait_s_per_request": sum(r.credit_wait_s for r in reps) / len(rids),
                                   "writes_per_request": reps[0].handoff_writes,
                                   "writes_per_request_on_ranks": sum(x.handoff_writes for x in results[rids[0]])})
        raw = _call(p, "large_raw", _call(d0, "naive_desc"), 5)
        raw_batched = _call(p, "large_raw", _call(d0, "naive_desc"), 5, True)
        copies = [_call(p, "device_copy", args.requests * 2, "cuda:1") for _ in range(3)]
        copy = max(copies, key=lambda c: c["gbps"])   # the limit: the best of 3 (the strictest ratio)
        try:
            ceiling = [_call(p, "ceiling", args.requests) for _ in range(3)]
        except RuntimeError as exc:   # a probe, not the measurement: report and go on
            ceiling = [{"error": str(exc), "gbps": 0.0}]
        kern = _call(p, "kernels", 20)
        got = {}
        for part in _call_all(ds, "kv"):
            got.update(part)
    finally:
        for conn in (p, *ds):
            try:
                _call(conn, "stop", timeout_s=30)
            except (TimeoutError, RuntimeError, OSError, EOFError):
                pass
        for proc in (pp, *dps):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    # expected decode KV, by plain indexing of the same seeded prefill pages
    caches, table = prefill_kv(plan, "cpu")
    exact = True
    for r in range(RANKS):
        _, dtable = decode_kv(plan, r, "cpu")
        pos = torch.tensor(list(plan.rank_positions(r)))
        want = torch.stack([c[table[pos // PAGE].long(), pos % PAGE] for c in caches])   # [L, n_r, rec]
        have = got[r].reshape(plan.layers, -1, plan.record_bytes)[:, : pos.numel()]          # pages in table order
        exact &= bool(have.equal(want))

    def summary(rounds: list[dict]) -> dict:
        rates = sorted(x["gbps"] for x in rounds)
        later = rounds[1:] or rounds   # round 1 includes Triton compilation
        med = statistics.median(x["gbps"] for x in later)
        sus_med = statistics.median(x["sustained_gbps"] for x in later)
        return {"best_gbps": rates[-1], "median_gbps_after_round_1": med,
                "best_ratio": rates[-1] / copy["gbps"], "median_ratio_after_round_1": med / copy["gbps"],
                "sustained_median_ratio_after_round_1": sus_med / copy["gbps"],
                "first_ready_ms_after_round_1": [x["first_ready_ms"] for x in rounds[1:]],
                "all_gbps": [round(x["gbps"], 1) for x in rounds]}

    best = max(runs["pipelined"], key=lambda x: x["gbps"])
    best_seq = max(runs["sequential"], key=lambda x: x["gbps"])
    return {
        "mode": "gpu_ipc",
        "device": torch.cuda.get_device_name(0),
        "plan": {"tokens": plan.tokens, "layers": LAYERS, "record_bytes": RECORD, "ranks": RANKS,
                 "bytes": plan.total_bytes, "batched_writes": plan.batched_writes},
        "copy_on": os.environ.get("KVPOOL_IPC_COPY_ON", "src"),
        "slots_per_rank": slots, "slot_bytes": slot_bytes, "staging_buffers": args.staging_buffers,
        "device_fences": not args.no_fences,
        "decode_processes": procs, "ranks_per_decode_process": groups,
        "pipelined": summary(runs["pipelined"]),
        "sequential": summary(runs["sequential"]),
        "handoff": best,
        "handoff_sequential": best_seq,
        "runs": runs,
        "writes_only": {"writes": raw["writes"], "s": raw["s"], "submit_s": raw["submit_s"],
                        "gbps": plan.total_bytes / raw["s"] / 1e9},
        "writes_only_batched": {"writes": raw_batched["writes"], "s": raw_batched["s"],
                                "submit_s": raw_batched["submit_s"], "gbps": plan.total_bytes / raw_batched["s"] / 1e9},
        "data_path_ceiling": {"best_gbps": max(c["gbps"] for c in ceiling),
                              "best_ratio": max(c["gbps"] for c in ceiling) / copy["gbps"], "runs": ceiling},
        "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
        "requests_per_round": args.requests,
        "device_copy": copy,
        "device_copy_all_gbps": [round(c["gbps"], 1) for c in copies],
        "kernels": kern,
        "ratio_vs_device_copy": best["gbps"] / copy["gbps"],
        "ratio_sequential_vs_device_copy": best_seq["gbps"] / copy["gbps"],
        "goal_ratio": 0.8,
        "bit_exact": exact,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="2-GPU mode: cuda:0 -> cuda:1 over CUDA IPC")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slots", type=int, default=None,
                    help="landing slots per decode rank (8 MiB each; --gpu uses 24 unless given)")
    ap.add_argument("--batch", type=int, default=1000, help="per-token writes per engine batch (<= 1024)")
    ap.add_argument("--naive-writes", type=int, default=0, help="run only this many per-token writes, scaled")
    ap.add_argument("--requests", type=int, default=64, help="--gpu: requests back to back per round")
    ap.add_argument("--decode-procs", type=int, default=RANKS,
                    help="--gpu: decode processes on cuda:1 (default one per rank, as deployed; 1: all ranks in one)")
    ap.add_argument("--staging-buffers", type=int, default=6,
                    help="--gpu: prefill staging buffers (>= 2: the next gathers overlap the writes)")
    ap.add_argument("--tokens", type=int, default=TOKENS,
                    help="--gpu: tokens per request (default the seed's 8,192-token example; a whole agentic "
                         "prompt is 100K+ tokens, e.g. 131072)")
    ap.add_argument("--no-fences", action="store_true",
                    help="--gpu: READY only after the stage saw each copy complete (no interprocess events)")
    ap.add_argument("--mps", action="store_true",
                    help="--gpu: run under a private NVIDIA MPS daemon (started and stopped here), so the 4 decode "
                         "processes sharing cuda:1 run concurrently instead of time-sliced, as one rank per GPU would")
    args = ap.parse_args()
    with _mps(args.gpu and args.mps):
        print(json.dumps(run_gpu(args) if args.gpu else run_tcp(args), indent=2, default=str))


@contextlib.contextmanager
def _mps(enabled: bool):
    """A private CUDA MPS control daemon (own pipe and log folders) for the run, quit afterwards.
    Must start before any process of the run creates a CUDA context."""
    if not enabled:
        yield
        return
    dirs = {"CUDA_MPS_PIPE_DIRECTORY": tempfile.mkdtemp(prefix="kvpool-mps-pipe-"),
            "CUDA_MPS_LOG_DIRECTORY": tempfile.mkdtemp(prefix="kvpool-mps-log-")}
    env = {**os.environ, **dirs}
    try:
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SystemExit(f"--mps: cannot start nvidia-cuda-mps-control: {exc}") from None
    os.environ.update(dirs)
    try:
        yield
    finally:
        # the daemon quits once its last client is gone: this process holds a context until exit,
        # so ask without waiting for it
        quit_ = subprocess.Popen(["nvidia-cuda-mps-control"], stdin=subprocess.PIPE, env=env, start_new_session=True)
        quit_.stdin.write(b"quit\n")
        quit_.stdin.close()
        for k in dirs:
            os.environ.pop(k, None)


if __name__ == "__main__":
    main()
