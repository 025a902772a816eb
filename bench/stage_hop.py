#!/usr/bin/env python3
"""One prefill hop's hidden states between processes: the stage link against a plain ZMQ message.

A prefill step's hidden states go stage -> engine -> next stage (``backend.serve.stage_link``):
``[tokens, d_model]`` float32, 32 MiB for a full 8,192-token step of the ``h200-tiny`` model. This
bench times one leg of that path, sender to receiver in another process, and the transport's own
limit in the same run:

    link         ``stage_link.encode`` (a view of the tensor's bytes), ``send_multipart(copy=False)``
                 over TCP on 127.0.0.1, ``recv_multipart(copy=False)``, ``stage_link.decode`` (a
                 tensor over the received frame): what the engine and the stages do per leg
    plain_zmq    the same bytes as one prepared frame, sent and received without copies and never
                 decoded: what ZMQ on loopback carries

Both are round trips (the receiver answers with a one-byte frame), medians of ``--reps``; GB/s
counts the payload once. ``ratio`` = link / plain_zmq. JSON on stdout (and in ``--out``).

    python bench/stage_hop.py --tokens 8192 --d-model 1024
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import torch
import zmq
from json_out import emit

from kvpool.backend.serve import stage_link as link


def echo(endpoint: str, decode: bool, messages: int) -> None:
    """The receiver: ``messages`` times, take one message (decoded as the stages do, or not) and answer."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(endpoint)
    for _ in range(messages):
        frames = sock.recv_multipart(copy=False)
        if decode:
            _, tensors = link.decode(frames)
            assert tensors[0].numel() > 0
        sock.send(b"k")
    sock.close(0)
    ctx.term()


def leg_s(payload: torch.Tensor, decode: bool, reps: int) -> list[float]:
    """Each rep's round trip of ``payload`` to a receiver process (one warm-up rep first)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("spawn").Process(target=echo, args=(f"tcp://127.0.0.1:{port}", decode, reps + 1))
    proc.start()
    plain = [b'{"id": 0, "cmd": "compute"}', memoryview(payload.view(torch.uint8).reshape(-1).numpy())]
    times = []
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            frames = link.encode({"id": 0, "cmd": "compute"}, [payload]) if decode else plain
            sock.send_multipart(frames, copy=False)
            if not sock.poll(60_000):
                raise SystemExit("the receiver did not answer within 60 s")
            sock.recv()
            times.append(time.perf_counter() - t0)
    finally:
        proc.join(30)
        sock.close(0)
        ctx.term()
    return times[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the step (rows of the hidden states)")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    payload = torch.randn(a.tokens, a.d_model, generator=torch.Generator().manual_seed(0))
    nbytes = payload.numel() * payload.element_size()
    rows = {}
    for name, decode in (("plain_zmq", False), ("link", True)):
        t = statistics.median(leg_s(payload, decode, a.reps))
        rows[name] = {"leg_ms": round(1e3 * t, 2), "gb_s": round(nbytes / t / 1e9, 2)}
        print(f"[stage-hop] {name}: {rows[name]['leg_ms']} ms a leg, {rows[name]['gb_s']} GB/s", file=sys.stderr)
    doc = {"bench": "stage_hop", "tokens": a.tokens, "d_model": a.d_model, "bytes": nbytes, "reps": a.reps,
           **rows, "ratio": round(rows["plain_zmq"]["leg_ms"] / rows["link"]["leg_ms"], 3)}
    emit(doc, a.out)


if __name__ == "__main__":
    main()
