"""Measure a running ``kvpool serve``'s cost curves through its HTTP API (``kvpool calibrate``).

Contract: ``await measure(url, scenario, on_step=...) -> dict`` sends ``POST /v1/completions``
requests of token ids it chooses (numpy ``Generator(seed)``: equal seeds, equal prompts) and reads
the router's ``kvpool.record`` of each (``docs/serve.md``). Nothing but the public API is used, so
any server of the scenario can be measured; the prompts are private to the calibration (fresh random
ids), so they never hit a workload's cached prefixes. The curves (``sim.calibration`` reads them):

    prefill   for every cached context c of ``cached_tokens`` (a prefix sent first, then held by the
              GPU prefix cache) and every new-token count n of ``new_tokens`` (n <= the step budget):
              the prefill window ``prefill_end_s - prefill_start_s`` of the prompt c + n, over
              ``prefill.pp``: one stage's step (median of ``reps``)
    restore   prefixes of ``restore_tokens`` are sent (saved to the pool), the GPU prefix cache is
              flushed by fresh prompts filling ``serve.prefill_kv_tokens`` + one step, then every
              prefix + 16 fresh tokens restores from the pool: ``restore_stage_s`` per stage over the
              bytes per stage; fitted ``fixed_s + bytes / bytes_per_s``
    decode    ``batch`` concurrent requests sharing a cached prefix (so prefill is short), prompt
              lengths from ``decode_contexts``, ``DECODE_TOKENS`` generated: in the window where all
              of them stream, tokens per second per sequence -> step time; fitted over (batch, total
              context) as ``fixed_s + per_seq_s x batch + per_ctx_token_s x context``
    handoff   ``handoff_s`` (the hand-off alone) over ``handoff_bytes`` of the prefill and restore
              phases' requests, which go one at a time (no hand-off queues behind another's, as the
              decode phase's do); fitted ``fixed_s + bytes / bytes_per_s``
    save      the same requests that saved: ``save_s`` over ``save_bytes`` per stage (the stages
              save in parallel, beside the hand-off); fitted ``fixed_s + bytes / bytes_per_s``
    overheads ``control_plane_s``: median over the single-token prefill requests of client TTFT less
              the prefill window and the longer of ``handoff_s`` and ``save_s`` (the prefill's
              answer waits for both), less the fitted decode step of one sequence (the simulator's
              first token comes one decode step after the hand-off and the save; the server's with
              the prefill's answer)

``on_step(label)`` is called after every request (a progress bar); ``plan_size(grid, s)`` says how
many calls there will be.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Callable, Sequence

import aiohttp
import numpy as np

from kvpool.backend.serve.model_config import EOS_TOKEN
from kvpool.backend.serve.replay_client import _sse_data

DECODE_TOKENS = 48
RESTORE_NEW_TOKENS = 16


def default_grid(s) -> dict:
    """The measurement grid of scenario ``s`` (``serve.*`` capacities and ``prefill.max_batched_tokens``)."""
    step = s.prefill.max_batched_tokens
    kv = s.serve.prefill_kv_tokens
    page = s.model.page_tokens
    new = sorted({1, max(1, step // 8), max(1, step // 2), step})
    top = (kv - step) // page * page
    cached = sorted({0, top // 8 // page * page, top // 2 // page * page, top} - {-1})
    restore = sorted({max(s.pool.min_load_tokens, s.pool.chunk_tokens) * k for k in (1, 4, 16, 64)
                      if max(s.pool.min_load_tokens, s.pool.chunk_tokens) * k <= kv // 2})
    budget = int(s.gate.tokens_per_decode * s.gate.budget_fraction) if s.gate.enabled else s.serve.decode_kv_tokens
    budget = min(budget, s.serve.decode_kv_tokens)
    batches = sorted({1, 2, 4, max(1, s.decode.max_seqs // 2), s.decode.max_seqs})
    long_ctx = lambda b: max(64, min(kv // 2, budget // b - DECODE_TOKENS - page) // page * page)  # noqa: E731
    return {"new_tokens": new, "cached_tokens": [c for c in cached if c >= 0], "restore_tokens": restore,
            "decode": [(b, L) for b in batches for L in sorted({64, long_ctx(b)})], "reps": 1}


def flush_sizes(s) -> list[int]:
    """Prompt lengths of the fresh prompts that push every saved prefix out of the GPU prefix cache
    (``serve.prefill_kv_tokens`` plus one step, a step's tokens at a time)."""
    step = s.prefill.max_batched_tokens
    total = s.serve.prefill_kv_tokens + step
    return [min(step, total - start) for start in range(0, total, step)]


def plan_size(grid: dict, s) -> int:
    """The progress steps ``measure`` reports for ``grid`` on scenario ``s``: one per request,
    and one when the GPU prefix cache has been flushed."""
    g = grid
    prefill = len([c for c in g["cached_tokens"] if c]) + len(g["cached_tokens"]) * len(g["new_tokens"]) * g["reps"]
    restore = 2 * len(g["restore_tokens"]) + len(flush_sizes(s)) + 1
    decode = sum(1 + b for b, _ in g["decode"])
    return prefill + restore + decode


class Client:
    """Streamed completions of fresh random prompts (``fresh``: numpy ``Generator(seed)``), each
    with its record and the client's token arrival times (``complete``); ``records`` keeps every
    answer in order, and ``on_step(label)`` is called after each."""

    def __init__(self, http: aiohttp.ClientSession, url: str, model: str, vocab: int, seed: int,
                 on_step: Callable[[str], None]) -> None:
        self.http, self.url, self.model, self.vocab = http, url, model, vocab
        self.rng = np.random.default_rng(seed)
        self.on_step = on_step
        self.records: list[dict] = []

    def fresh(self, n: int) -> list[int]:
        ids = self.rng.integers(0, self.vocab - 1, size=n)
        return (ids + (ids >= EOS_TOKEN)).tolist()

    async def complete(self, prompt: Sequence[int], max_tokens: int, label: str,
                       streaming: asyncio.Event | None = None) -> dict:
        """One streamed request: its record, client TTFT and token arrival times; ``streaming`` is
        set once its first token has arrived."""
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        t0 = time.perf_counter()
        times: list[float] = []
        record: dict = {}
        async with self.http.post(f"{self.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"POST /v1/completions answered HTTP {resp.status}: {(await resp.text())[:300]}")
            import json

            async for data in _sse_data(resp):
                if data.strip() == "[DONE]":
                    break
                ev = json.loads(data)
                now = time.perf_counter() - t0
                if isinstance(ev, dict):
                    if ev.get("error"):
                        raise RuntimeError(f"stream error: {ev['error']}")
                    for ch in ev.get("choices") or []:
                        times.extend([now] * len(ch.get("token_ids") or []))
                    if times and streaming is not None:
                        streaming.set()
                    rec = (ev.get("kvpool") or {}).get("record")
                    if isinstance(rec, dict):
                        record = rec
        out = {"ttft_s": times[0] if times else time.perf_counter() - t0, "token_times_s": times, "record": record,
               "in_tokens": len(prompt), "t0": t0}
        self.records.append(out)
        self.on_step(label)
        return out


def _window(rec: dict) -> float:
    return float(rec["prefill_end_s"]) - float(rec["prefill_start_s"]) - float(rec.get("restore_spread_s") or 0.0)


def _answer_wait_s(rec: dict) -> float:
    """What the prefill's answer waited for after its last step: the hand-off and the save, together."""
    return max(float(rec.get("handoff_s") or 0.0), float(rec.get("save_s") or 0.0))


def _bytes_fit(samples: Sequence[tuple[int, float]]) -> dict:
    """``fixed_s + bytes / bytes_per_s`` over (bytes, seconds) samples, with its range, its rate
    and the samples (the restore, the hand-off and the save curves)."""
    fixed, slope = _linfit([b for b, _ in samples], [t for _, t in samples])
    return {"fit": {"fixed_s": fixed, "bytes_per_s": 1.0 / slope if slope > 0 else 1e15},
            "bytes_range": [0, max(b for b, _ in samples)],
            "gb_s": (1.0 / slope / 1e9) if slope > 0 else math.inf,
            "samples": [{"bytes": b, "s": t} for b, t in samples]}


def _linfit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of least squares, the intercept clamped at 0 (slope refitted through 0 then)."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if len(x) < 2 or np.ptp(x) == 0:
        return 0.0, float(np.mean(y) / np.mean(x)) if np.mean(x) else 0.0
    slope, icpt = np.polyfit(x, y, 1)
    if icpt < 0:
        return 0.0, float((x @ y) / (x @ x))
    return float(icpt), max(float(slope), 1e-15)


async def _prefill(c: Client, s, grid: dict) -> tuple[list[list[float]], list[dict], list[float]]:
    pp = s.prefill.pp
    rows = {n: {} for n in grid["new_tokens"]}
    samples, residual = [], []
    for cached in grid["cached_tokens"]:
        prefix = c.fresh(cached)
        if cached:
            await c.complete(prefix, 1, f"prefill prefix {cached}")
        for n in grid["new_tokens"]:
            got = []
            for _ in range(grid["reps"]):
                out = await c.complete(prefix + c.fresh(n), 1, f"prefill {n} new after {cached}")
                rec = out["record"]
                w = _window(rec)
                got.append(w / pp)
                samples.append({"new_tokens": n, "cached_tokens": cached, "gpu_tokens": rec.get("gpu_tokens"),
                                "prefill_s": w, "handoff_s": rec.get("handoff_s"), "ttft_s": out["ttft_s"]})
                residual.append(out["ttft_s"] - w - _answer_wait_s(rec))
            rows[n][cached] = statistics.median(got)
    grid_s = [[max(1e-6, rows[n][cc]) for cc in grid["cached_tokens"]] for n in grid["new_tokens"]]
    return grid_s, samples, residual


async def _restore(c: Client, s, grid: dict) -> tuple[dict, list[dict]]:
    prefixes = [c.fresh(p) for p in grid["restore_tokens"]]
    for p in prefixes:
        await c.complete(p, 1, f"restore: save {len(p)}")
    for n in flush_sizes(s):
        await c.complete(c.fresh(n), 1, "restore: flush the GPU cache")
    c.on_step("restore: flushed")
    samples = []
    for p in prefixes:
        out = await c.complete(p + c.fresh(RESTORE_NEW_TOKENS), 1, f"restore {len(p)}")
        rec = out["record"]
        stages = rec.get("restore_stage_s") or []
        if not rec.get("pool_tokens") or not stages:
            continue
        per_stage = int(rec.get("restore_bytes", 0)) // len(stages)
        for t in stages:
            samples.append({"tokens": rec["pool_tokens"], "bytes_per_stage": per_stage, "stage_s": float(t)})
    if not samples:
        raise RuntimeError("no restore from the pool was observed: is the pool empty or pool.min_load_tokens too large?")
    curve = _bytes_fit([(x["bytes_per_stage"], x["stage_s"]) for x in samples])
    return {**curve, "samples": samples}, samples


async def _decode(c: Client, s, grid: dict) -> dict:
    samples = []
    page = s.model.page_tokens
    for batch, ctx in grid["decode"]:
        shared = c.fresh(max(0, ctx - page) // page * page)
        if shared:
            await c.complete(shared, 1, f"decode prefix {len(shared)}")
        else:
            c.on_step("decode prefix")
        outs = await asyncio.gather(*(c.complete(shared + c.fresh(ctx - len(shared)), DECODE_TOKENS,
                                                 f"decode batch {batch} x {ctx}") for _ in range(batch)))
        # absolute arrival times: t0 + relative; the window where every sequence streams
        starts = [o["t0"] + o["token_times_s"][1] for o in outs if len(o["token_times_s"]) > 2]
        ends = [o["t0"] + o["token_times_s"][-1] for o in outs if len(o["token_times_s"]) > 2]
        if len(starts) < batch:
            continue
        lo, hi = max(starts), min(ends)
        if hi - lo <= 0:
            continue
        rates = []
        for o in outs:
            ts = [o["t0"] + t for t in o["token_times_s"]]
            n = sum(1 for t in ts if lo < t <= hi)
            rates.append(n / (hi - lo))
        rate = statistics.mean(rates)
        if rate <= 0:
            continue
        samples.append({"batch": batch, "prompt_tokens": ctx, "context_tokens": batch * (ctx + DECODE_TOKENS // 2),
                        "step_s": s.decode.mtp_accept_tokens / rate, "window_s": hi - lo})
    if len(samples) < 3:
        raise RuntimeError("too few decode measurements (the windows where every sequence streams were empty)")
    return fit_decode(samples)


def fit_decode(samples: Sequence[dict]) -> dict:
    """The decode curve of measured steps: ``fixed_s + per_seq_s x batch + per_ctx_token_s x context``,
    non-negative least squares over relative errors (short and long steps weigh alike)."""
    from scipy.optimize import nnls

    A = np.array([[1.0, x["batch"], x["context_tokens"]] for x in samples])
    y = np.array([x["step_s"] for x in samples])
    coef, _ = nnls(A / y[:, None], np.ones_like(y))
    return {"fit": {"fixed_s": float(coef[0]), "per_seq_s": float(coef[1]), "per_ctx_token_s": float(coef[2])},
            "batch_range": [1, max(x["batch"] for x in samples)],
            "context_range": [0, max(x["context_tokens"] for x in samples)], "samples": list(samples)}


async def measure(url: str, s, *, grid: dict | None = None, model: str | None = None, seed: int = 0,
                  on_step: Callable[[str], None] = lambda label: None) -> dict:
    """The curves of the server at ``url`` running scenario ``s`` (see the module docstring)."""
    grid = grid or default_grid(s)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=s.serve.request_timeout_s)) as http:
        c = Client(http, url.rstrip("/"), model or s.model.name, s.serve.vocab, seed, on_step)
        t0 = time.perf_counter()
        prefill_grid, prefill_samples, residual = await _prefill(c, s, grid)
        restore, _ = await _restore(c, s, grid)
        one_at_a_time = [o["record"] for o in c.records]  # the decode phase's requests come together
        decode = await _decode(c, s, grid)
        wall = time.perf_counter() - t0
    hand = [(int(r.get("handoff_bytes", 0)), float(r.get("handoff_s", 0.0))) for r in one_at_a_time if r.get("handoff_bytes")]
    pp = s.prefill.pp
    saves = [(int(r["save_bytes"]) // pp, float(r.get("save_s", 0.0))) for r in one_at_a_time if r.get("save_bytes")]
    if not saves:
        raise RuntimeError("no save to the pool was observed: is pool.chunk_tokens larger than every prompt?")
    d = decode["fit"]
    first_step = d["fixed_s"] + d["per_seq_s"] + d["per_ctx_token_s"] * 64
    control = max(0.0, statistics.median(residual) - first_step) if residual else 0.0
    return {
        "grid": grid,
        "prefill": {"pp": s.prefill.pp, "max_batched_tokens": s.prefill.max_batched_tokens,
                    "new_tokens": grid["new_tokens"], "cached_tokens": grid["cached_tokens"],
                    "step_s": prefill_grid, "samples": prefill_samples},
        "decode": decode,
        "restore": restore,
        "handoff": _bytes_fit(hand),
        "save": _bytes_fit(saves),
        "overheads": {"control_plane_s": control, "ttft_residual_s_median": statistics.median(residual) if residual else 0.0,
                      "first_decode_step_s": first_step},
        "requests": len(c.records),
        "wall_s": wall,
    }
