#!/usr/bin/env python3
"""One prompt's prefill across a server's life: does a step cost the same on a fresh server as on one
that has filled its GPU prefix cache and decoded?

A calibration's prefill cells hold for a replay only if the server's speed is steady: on one H100
a 1,024-token prompt alone took 1.49x the layers' time per token after the calibration's replay
phase that it took before it, the GPU's clocks at their maximum throughout (``docs/fidelity.md``,
"Why a replay's prefill step costs more than the grid's"). This bench sends the same kind of prompt
(``--prompt-tokens`` fresh tokens, ``--prompts`` of them one after another) to one ``kvpool serve
SCENARIO`` (started here, stopped at the end) in five conditions, in this order:

    fresh         after the calibration's warm-up requests only
    cache_full    after fresh prompts have filled ``serve.prefill_kv_tokens`` plus one step
                  (``backend.serve.calibrate.flush_sizes``)
    after_decode  after ``--batch`` sequences of ``--context``-token prompts have decoded
                  ``--decode-tokens`` tokens together and finished
    beside_decode while such a batch decodes (each prompt sent once the batch streams)
    beside_handoff the prompts sent one ``fresh`` median window apart, so that each one's compute
                  follows the one before while that one's hand-off and save run on the stages
                  (the stages' forward seconds of the whole group, shared evenly by its prompts)

then, with prompts of a whole step (``prefill.max_batched_tokens`` tokens), ``--pairs`` times each:

    full_step_alone       one such prompt at a time
    full_steps_pipelined  two sent together: the second's step follows the first's through the
                          stages, so the stages compute beside one another (on one device, the
                          way a replay's pipeline runs)

Per condition: every prompt's (or pair's: the longer) prefill window (its record's
``prefill_end_s - prefill_start_s``) and the model's time per computed token, all stages together
(the prefill engine's ``kvpool:prefill_stage_forward_seconds`` before and after), the medians, and
each median over its reference's (``REFERENCE``: ``fresh`` for the first five,
``full_step_alone`` for the last two). JSON on stdout (and in ``--out``).

    python bench/prefill_drift.py --scenario cpu-tiny --prompt-tokens 256 --out /tmp/drift.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

import aiohttp
from kvpool.backend.serve.engine_accounts import engine_urls, time_accounts
from json_out import emit

#: each condition and the one its medians are divided by (the same prompt size, an earlier state)
REFERENCE = {"fresh": "fresh", "cache_full": "fresh", "after_decode": "fresh", "beside_decode": "fresh",
             "beside_handoff": "fresh", "full_step_alone": "full_step_alone",
             "full_steps_pipelined": "full_step_alone"}


def log(msg: str) -> None:
    print(f"[prefill-drift] {msg}", file=sys.stderr, flush=True)


def prefill_forward_s(urls: dict[str, str]) -> list[float]:
    """Every prefill engine's stage forward seconds so far, stage by stage, engines in name order."""
    accounts = time_accounts(urls)
    return [x for name in sorted(accounts) for x in accounts[name].get("stage_forward_s", [])]


async def timed_prompts(c, urls: dict[str, str], tokens: int, count: int, label: str,
                        together: int = 1) -> list[dict]:
    """``count`` times, ``together`` fresh prompts of ``tokens`` tokens sent at once (one after
    another when 1; with whole-step prompts, the second's step follows the first's through the
    stages, so each stage but the first computes beside the stage before it): each time the longest
    window, the tokens and the stages' forward seconds they added."""
    out = []
    for _ in range(count):
        before = prefill_forward_s(urls)
        answers = await asyncio.gather(*(c.complete(c.fresh(tokens), 1, label) for _ in range(together)))
        after = prefill_forward_s(urls)
        out.append({"window_s": max(window_s(a) for a in answers), "tokens": together * tokens,
                    "stage_forward_s": [b - a for a, b in zip(before, after)]})
    return out


async def staggered_prompts(c, urls: dict[str, str], tokens: int, count: int, gap_s: float, label: str) -> list[dict]:
    """``count`` fresh prompts of ``tokens`` tokens, the k-th sent ``k * gap_s`` after the first:
    each one's window, and the stages' forward seconds of all of them shared evenly."""
    async def send(k: int) -> dict:
        await asyncio.sleep(k * gap_s)
        return await c.complete(c.fresh(tokens), 1, label)

    before = prefill_forward_s(urls)
    answers = await asyncio.gather(*(send(k) for k in range(count)))
    share = [(b - a) / count for a, b in zip(before, prefill_forward_s(urls))]
    return [{"window_s": window_s(a), "tokens": tokens, "stage_forward_s": share} for a in answers]


def window_s(answer: dict) -> float:
    rec = answer["record"]
    return float(rec["prefill_end_s"]) - float(rec["prefill_start_s"])


async def decoding_batch(c, batch: int, context: int, decode_tokens: int, label: str):
    """``batch`` sequences of ``context``-token fresh prompts decoding ``decode_tokens`` tokens
    together: the future of their answers and the events set once each streams."""
    streaming = [asyncio.Event() for _ in range(batch)]
    answers = asyncio.gather(*(c.complete(c.fresh(context), decode_tokens, label, ev) for ev in streaming))
    return answers, streaming


async def probe(url: str, urls: dict[str, str], s, a) -> dict[str, list[dict]]:
    from kvpool.backend.serve.calibrate import Client, _warm_up, flush_sizes

    timeout = aiohttp.ClientTimeout(total=s.serve.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        c = Client(http, url, s.model.name, s.serve.vocab, a.seed, lambda _label: None)
        await _warm_up(c, s)
        got = {"fresh": await timed_prompts(c, urls, a.prompt_tokens, a.prompts, "fresh")}
        log("fresh done; filling the GPU prefix cache")
        for n in flush_sizes(s):
            await c.complete(c.fresh(n), 1, "fill")
        got["cache_full"] = await timed_prompts(c, urls, a.prompt_tokens, a.prompts, "cache full")
        log("cache full done; a decode batch")
        answers, _ = await decoding_batch(c, a.batch, a.context, a.decode_tokens, "decode")
        await answers
        got["after_decode"] = await timed_prompts(c, urls, a.prompt_tokens, a.prompts, "after decode")
        log("after decode done; prompts beside a decode batch")
        answers, streaming = await decoding_batch(c, a.batch, a.context, a.decode_tokens, "decode beside")
        for ev in streaming:
            await ev.wait()
        got["beside_decode"] = await timed_prompts(c, urls, a.prompt_tokens, a.prompts, "beside decode")
        await answers
        gap_s = statistics.median(r["window_s"] for r in got["fresh"])
        log(f"beside decode done; prompts {gap_s * 1e3:.0f} ms apart, beside the hand-off and save before")
        got["beside_handoff"] = await staggered_prompts(c, urls, a.prompt_tokens, a.prompts, gap_s, "beside hand-off")
        step = s.prefill.max_batched_tokens
        log(f"beside hand-off done; prompts of a whole step ({step} tokens) alone, then in pairs")
        got["full_step_alone"] = await timed_prompts(c, urls, step, a.pairs, "full step alone")
        got["full_steps_pipelined"] = await timed_prompts(c, urls, step, a.pairs, "full steps pipelined", together=2)
    return got


def summarize(got: dict[str, list[dict]]) -> dict[str, dict]:
    """Per condition the windows and the forward seconds per computed token, their medians and the
    medians over those of the condition's ``REFERENCE``."""
    rows = {}
    for name in REFERENCE:
        runs = got[name]
        rows[name] = {"window_ms": [round(1e3 * r["window_s"], 1) for r in runs],
                      "forward_us_per_token": [round(1e6 * sum(r["stage_forward_s"]) / r["tokens"], 2) for r in runs]}
        rows[name]["window_ms_median"] = statistics.median(rows[name]["window_ms"])
        rows[name]["forward_us_per_token_median"] = statistics.median(rows[name]["forward_us_per_token"])
    for name, row in rows.items():
        ref = rows[REFERENCE[name]]
        row["window_over_reference"] = round(row["window_ms_median"] / ref["window_ms_median"], 3)
        row["forward_over_reference"] = (round(row["forward_us_per_token_median"] / ref["forward_us_per_token_median"], 3)
                                         if ref["forward_us_per_token_median"] > 0 else None)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="cpu-tiny")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="fresh tokens of every timed prompt")
    p.add_argument("--prompts", type=int, default=3, help="timed prompts per condition, one after another")
    p.add_argument("--batch", type=int, default=4, help="sequences of the decode batch")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens of each decoding sequence")
    p.add_argument("--decode-tokens", type=int, default=96, help="tokens each decoding sequence generates")
    p.add_argument("--pairs", type=int, default=2,
                   help="prompts of a whole step alone, and pairs of them sent together (full_step_*)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from kvpool.backend.serve.launch import start_serve
    from kvpool.scenario.load import load_scenario

    s = load_scenario(a.scenario, a.sets)
    log(f"starting kvpool serve {a.scenario}")
    served = start_serve(a.scenario, a.sets, Path(tempfile.mkdtemp(prefix="kvpool-prefill-drift-")) / "run")
    try:
        got = asyncio.run(probe(served.url, engine_urls(served.run_dir), s, a))
    finally:
        served.stop()
    doc = {"bench": "prefill_drift", "scenario": a.scenario, "sets": a.sets, "devices": list(s.serve.devices),
           "prompt_tokens": a.prompt_tokens, "prompts": a.prompts, "batch": a.batch, "context_tokens": a.context,
           "decode_tokens": a.decode_tokens, "step_tokens": s.prefill.max_batched_tokens, "pairs": a.pairs,
           "conditions": summarize(got)}
    try:
        import torch

        if torch.cuda.is_available():
            doc["device"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    emit(doc, a.out)


if __name__ == "__main__":
    main()
