#!/usr/bin/env python3
"""Decode beside prefill: how much a decoding sequence slows while a prompt is prefilled next to it.

One ``kvpool serve SCENARIO`` (started here, stopped at the end). Per prompt length L of
``--prompt-tokens``: one sequence with a ``--context``-token prompt decodes ``--decode-tokens``
tokens; once it streams and ``--settle`` seconds later, ``--prompts`` fresh prompts of L tokens
are sent one after another. From the sequence's token arrival times (the client's clock) and the
prompts' prefill windows (their records, moved onto the client's clock by their ``arrival_s``):
the median gap between tokens before the first window (alone), inside the windows (beside a
prefill), and after the last one. JSON on stdout (and in ``--out``): per L the three medians in
ms, their counts, the windows' lengths, and ``beside_over_before``, the slowdown.

    python bench/contention.py --scenario cpu-tiny --out bench/results/contention-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

import aiohttp
from json_out import emit

ROOT = Path(__file__).resolve().parents[1]


async def probe(url: str, s, a) -> list[dict]:
    from kvpool.backend.serve.calibrate import Client

    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=s.serve.request_timeout_s)) as http:
        c = Client(http, url, s.model.name, s.serve.vocab, a.seed, lambda _label: None)
        for length in a.prompt_tokens:
            streaming = asyncio.Event()
            decoding = asyncio.ensure_future(c.complete(c.fresh(a.context), a.decode_tokens, "decode", streaming))
            await streaming.wait()
            await asyncio.sleep(a.settle)
            windows = []
            for _ in range(a.prompts):
                out = await c.complete(c.fresh(length), 1, "prompt")
                rec = out["record"]
                sent = out["t0"] - float(rec["arrival_s"])  # the record's clock (the router's) on the client's
                windows.append((sent + float(rec["prefill_start_s"]), sent + float(rec["prefill_end_s"])))
            dec = await decoding
            times = [dec["t0"] + t for t in dec["token_times_s"]]
            gaps = list(zip(times, times[1:]))
            parts = {"before": [b - x for x, b in gaps if b <= windows[0][0]],
                     "beside": [b - x for x, b in gaps if any(lo <= x and b <= hi for lo, hi in windows)],
                     "after": [b - x for x, b in gaps if x >= windows[-1][1]]}
            row = {"prompt_tokens": length, "windows_s": [round(hi - lo, 3) for lo, hi in windows]}
            for name, xs in parts.items():
                row[f"gap_ms_{name}"] = round(1e3 * statistics.median(xs), 2) if xs else None
                row[f"gaps_{name}"] = len(xs)
            before, beside = row["gap_ms_before"], row["gap_ms_beside"]
            row["beside_over_before"] = round(beside / before, 3) if before and beside else None
            rows.append(row)
            print(f"[contention] {length} tokens: {row}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="cpu-tiny")
    p.add_argument("--prompt-tokens", type=lambda v: [int(x) for x in v.split(",")], default=[1024, 3072, 6144])
    p.add_argument("--context", type=int, default=2048, help="the decoding sequence's prompt tokens")
    p.add_argument("--decode-tokens", type=int, default=600)
    p.add_argument("--prompts", type=int, default=2, help="prompts per length, one after another")
    p.add_argument("--settle", type=float, default=1.0, help="seconds of decoding alone before the first prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from kvpool.backend.serve.launch import start_serve
    from kvpool.scenario.load import load_scenario

    s = load_scenario(a.scenario, a.sets)
    served = start_serve(a.scenario, a.sets, ROOT / "out" / "contention" / "serve")
    try:
        rows = asyncio.run(probe(served.url, s, a))
    finally:
        served.stop()
    doc = {"scenario": a.scenario, "sets": a.sets, "devices": list(s.serve.devices), "context_tokens": a.context,
           "decode_tokens": a.decode_tokens, "prompts_per_length": a.prompts, "rows": rows}
    emit(doc, a.out)


if __name__ == "__main__":
    main()
