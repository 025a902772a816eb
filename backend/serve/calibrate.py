"""Measure a running ``kvpool serve``'s cost curves through its HTTP API (``kvpool calibrate``).

Contract: ``await measure(url, scenario, on_step=...) -> dict`` sends ``POST /v1/completions``
requests of token ids it chooses (numpy ``Generator(seed)``: equal seeds, equal prompts) and reads
the router's ``kvpool.record`` of each (``docs/serve.md``). Nothing but the public API is used, so
any server of the scenario can be measured; the prompts are private to the calibration (fresh random
ids), so they never hit a workload's cached prefixes. Three warm-up requests come first and are
not measured (a server's first requests of a kind pay one-time costs: kernel compiles, first
allocations). The phases run in the order below, restore, decode, prefill, sharing (and replay,
when asked for), so that the prefill grid is measured on a server whose GPU prefix cache is full
and which has decoded, as a replay's prefills are. The curves (``sim.calibration`` reads them):

    restore   prefixes of ``restore_tokens`` (up to the longest whose prompt fits the prefill's
              KV, so a workload's restores lie inside the curve) are sent (saved to the pool), the
              GPU prefix cache is flushed by fresh prompts filling ``serve.prefill_kv_tokens`` + one
              step, then every prefix + 16 fresh tokens restores from the pool (after one more
              prefix restored unmeasured, a first restore's one-time costs): ``restore_stage_s``
              per stage over the bytes per stage; fitted ``fixed_s + bytes / bytes_per_s``
    decode    ``batch`` concurrent requests sharing a cached prefix (so prefill is short), prompt
              lengths from ``decode_contexts``, ``DECODE_TOKENS`` generated: in the window where all
              of them stream, tokens per second per sequence -> step time; fitted over (batch, total
              context) as ``fixed_s + per_seq_s x batch + per_ctx_token_s x context``
    prefill   for every cached context c of ``cached_tokens`` (a prefix sent first, then held by the
              GPU prefix cache) and every new-token count n of ``new_tokens`` (n <= the step budget):
              the prefill window ``prefill_end_s - prefill_start_s`` of the prompt c + n, over
              ``prefill.pp``: one stage's step, the fastest of ``reps`` (a first allocation of a
              size or a neighbour's burst only ever lengthens a window)
    handoff   ``handoff_s`` (the hand-off alone) over ``handoff_bytes`` of the prefill and restore
              phases' requests, which go one at a time (no hand-off queues behind another's, as the
              decode phase's do); fitted ``fixed_s + bytes / bytes_per_s`` (every such fit is
              Theil-Sen's, ``_robust_line``: a few transfers that waited for something else do not
              tilt it)
    save      the same requests that saved: ``save_s`` over ``save_bytes`` per stage (the stages
              save in parallel, beside the hand-off); fitted ``fixed_s + bytes / bytes_per_s``
    sharing   workers that share a device (``serve.devices``) slow one another: ``SHARE_PROMPTS``
              fresh prompts are prefilled alone (of the prefill grid's shortest ``new_tokens``, at
              least ``share.prompt_tokens``, whose window spans ``SHARE_WINDOW_STEPS`` decode steps
              by the grid; its longest when none does); then ``share.batch``
              sequences of ``share.context_tokens``-token prompts (a shared prefix sent first)
              decode, and once they have streamed for ``SHARE_SETTLE_STEPS`` steps, as many fresh
              prompts of that length are sent one after another beside them. A single-step
              prompt's stages compute one after another, so inside its prefill window exactly one
              stage computes beside the decode: ``decode_slowdown_per_worker`` is the decode's step
              inside the windows over its step before them, less 1; ``prefill_slowdown_per_worker``
              the median window beside the decode over the median window alone, less 1 (both >= 0).
              ``prefill_alone_over_grid``, the median window alone over the prefill grid's window
              of the same prompt, says whether the server's speed held through the calibration
              (1: it did); the simulator does not read it
    replay    with ``replay`` (a ``calibrate_replay.ReplayPhase``): a trace set the calibration is
              not asked to predict, replayed against the server, and what the prefill stages
              spent per computed token in it by the engines' own accounts
              (``calibrate_replay.measure_replay``; its probes are prompts of the sharing phase's
              length); ``sim.replay_fit`` then sets ``prefill.replay_scale`` (1 until it does)
    overheads ``control_plane_s``: median over the single-token prefill requests of client TTFT less
              the prefill window and the longer of ``handoff_s`` and ``save_s`` (the prefill's
              answer, which carries the first token, waits for both; so does the simulator's)

``on_step(label)`` is called after every request (a progress bar; the replay phase's own requests
count as one step); ``plan_size(grid, s, replay)`` says how many calls there will be.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Callable, Sequence

import aiohttp
import numpy as np

from kvpool.backend.serve.calibrate_replay import PROBE_PROMPTS, ReplayPhase, measure_replay
from kvpool.backend.serve.model_config import EOS_TOKEN
from kvpool.backend.serve.replay_client import _sse_data

DECODE_TOKENS = 48
RESTORE_NEW_TOKENS = 16
WARM_UP_REQUESTS = 3  # _warm_up's
NO_BYTE_COST_BYTES_PER_S = 1e15  # a fitted rate where the samples show no cost per byte
SHARE_PROMPTS = 3  # prompts prefilled alone; and at least as many beside the decode
SHARE_SETTLE_STEPS = 16  # decode steps streamed before the first prompt beside them
SHARE_WINDOW_STEPS = 8  # decode steps a prompt's prefill window should span


def default_grid(s) -> dict:
    """The measurement grid of scenario ``s`` (``serve.*`` capacities and ``prefill.max_batched_tokens``)."""
    step = s.prefill.max_batched_tokens
    kv = s.serve.prefill_kv_tokens
    page = s.model.page_tokens
    new = sorted({1, max(1, step // 8), max(1, step // 2), step})
    top = (kv - step) // page * page
    cached = sorted({0, top // 8 // page * page, top // 2 // page * page, top} - {-1})
    restore_unit = max(s.pool.min_load_tokens, s.pool.chunk_tokens)
    longest_restore = (kv - RESTORE_NEW_TOKENS - page) // restore_unit * restore_unit  # its prompt fits the cache
    restore = sorted({restore_unit * k for k in (1, 4, 16, 64) if restore_unit * k <= longest_restore}
                     | ({longest_restore} if longest_restore > 0 else set()))
    budget = _decode_budget_tokens(s)
    batches = sorted({1, 2, 4, max(1, s.decode.max_seqs // 2), s.decode.max_seqs})
    long_ctx = lambda b: max(64, min(kv // 2, budget // b - DECODE_TOKENS - page) // page * page)  # noqa: E731
    share_batch = min(4, s.decode.max_seqs)
    return {"new_tokens": new, "cached_tokens": [c for c in cached if c >= 0], "restore_tokens": restore,
            "decode": [(b, L) for b in batches for L in sorted({64, long_ctx(b)})], "reps": 2,
            "share": {"prompt_tokens": max(1, step // 8), "batch": share_batch, "context_tokens": long_ctx(share_batch)}}


def _decode_budget_tokens(s) -> int:
    """The KV tokens the decode instance admits at once: its KV, or the gate's budget when smaller."""
    budget = int(s.gate.tokens_per_decode * s.gate.budget_fraction) if s.gate.enabled else s.serve.decode_kv_tokens
    return min(budget, s.serve.decode_kv_tokens)


def flush_sizes(s) -> list[int]:
    """Prompt lengths of the fresh prompts that push every saved prefix out of the GPU prefix cache
    (``serve.prefill_kv_tokens`` plus one step, a step's tokens at a time)."""
    step = s.prefill.max_batched_tokens
    total = s.serve.prefill_kv_tokens + step
    return [min(step, total - start) for start in range(0, total, step)]


def plan_size(grid: dict, s, replay: bool = False) -> int:
    """The progress steps ``measure`` reports for ``grid`` on scenario ``s``: one per request,
    one when the GPU prefix cache has been flushed, and with ``replay`` one for the replay and
    one per probe prompt around it."""
    g = grid
    prefill = len([c for c in g["cached_tokens"] if c]) + len(g["cached_tokens"]) * len(g["new_tokens"]) * g["reps"]
    warm_up = WARM_UP_REQUESTS
    restore = 2 * (len(g["restore_tokens"]) + 1) + len(flush_sizes(s)) + 1  # with the warm-up prefix
    decode = sum(1 + b for b, _ in g["decode"])
    sharing = 2 * SHARE_PROMPTS + 1 + g["share"]["batch"]  # prompts alone and beside, the prefix, the sequences
    replayed = 1 + 2 * PROBE_PROMPTS if replay else 0
    return warm_up + prefill + restore + decode + sharing + replayed


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
    and the samples (the restore, the hand-off and the save curves). The line is Theil-Sen's
    (``_robust_line``): a transfer that waited for something else (a compile, a busy core) does not
    tilt it. Samples that do not grow with their bytes give ``NO_BYTE_COST_BYTES_PER_S`` (and
    ``gb_s`` ``None``): the fixed time is the whole cost."""
    fixed, slope = _robust_line([b for b, _ in samples], [t for _, t in samples])
    return {"fit": {"fixed_s": fixed, "bytes_per_s": 1.0 / slope if slope > 0 else NO_BYTE_COST_BYTES_PER_S},
            "bytes_range": [0, max(b for b, _ in samples)],
            "gb_s": (1.0 / slope / 1e9) if slope > 0 else None,
            "samples": [{"bytes": b, "s": t} for b, t in samples]}


def _robust_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the Theil-Sen line: the slope is the median of the slopes between
    every two samples of different x, clamped at >= 0; the intercept the median of ``y - slope x``,
    clamped at >= 0 (the slope then the median of ``y / x``). A minority of samples far above the
    rest (fewer than about three in ten) moves neither."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    i, j = np.triu_indices(len(x), k=1)
    apart = x[i] != x[j]
    slope = max(0.0, float(np.median((y[j] - y[i])[apart] / (x[j] - x[i])[apart]))) if apart.any() else 0.0
    icpt = float(np.median(y - slope * x))
    if icpt < 0:
        positive = x > 0
        return 0.0, float(np.median(y[positive] / x[positive])) if positive.any() else 0.0
    return icpt, slope


async def _warm_up(c: Client, s) -> None:
    """Requests that are not measured: a server's first requests of a kind pay one-time costs
    (kernel compiles, first allocations) that its later ones do not. A one-token prompt, a prompt of
    an eighth of a step (saved to the pool) and the same prompt again with ``RESTORE_NEW_TOKENS``
    more (a GPU prefix hit), two tokens each."""
    prompt = c.fresh(max(1, s.prefill.max_batched_tokens // 8))
    for ids in (c.fresh(1), prompt, prompt + c.fresh(RESTORE_NEW_TOKENS)):
        await c.complete(ids, 2, "warm-up")


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
            rows[n][cached] = min(got)
    grid_s = [[max(1e-6, rows[n][cc]) for cc in grid["cached_tokens"]] for n in grid["new_tokens"]]
    return grid_s, samples, residual


async def _restore(c: Client, s, grid: dict) -> tuple[dict, list[dict]]:
    warm_up = c.fresh(grid["restore_tokens"][0])  # restored first, not measured (a first restore's costs)
    prefixes = [c.fresh(p) for p in grid["restore_tokens"]]
    for p in [warm_up, *prefixes]:
        await c.complete(p, 1, f"restore: save {len(p)}")
    for n in flush_sizes(s):
        await c.complete(c.fresh(n), 1, "restore: flush the GPU cache")
    c.on_step("restore: flushed")
    await c.complete(warm_up + c.fresh(RESTORE_NEW_TOKENS), 1, "restore: warm-up")
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


async def _sharing(c: Client, s, grid: dict, decode: dict, prefill_grid: list[list[float]]) -> dict:
    """How much the decode and a prefill stage slow each other on a shared device (the module docstring)."""
    g = grid["share"]
    batch, ctx = g["batch"], g["context_tokens"]
    step_s = _measured_step_s(decode, batch, ctx)
    prompt = _share_prompt_tokens(g["prompt_tokens"], grid["new_tokens"], [row[0] for row in prefill_grid],
                                  SHARE_WINDOW_STEPS * step_s / s.prefill.pp)
    alone = [await c.complete(c.fresh(prompt), 1, "sharing: prompt alone") for _ in range(SHARE_PROMPTS)]
    prompt_s = max(o["ttft_s"] for o in alone)  # one prompt's request, end to end, alone
    # long enough to stream through the prompts beside them even if each took four times as long
    tokens = SHARE_SETTLE_STEPS + math.ceil(4 * SHARE_PROMPTS * prompt_s / step_s) + SHARE_SETTLE_STEPS
    page = s.model.page_tokens
    room = _decode_budget_tokens(s) // batch - ctx - page  # every sequence's KV fits beside the others'
    tokens = min(tokens, max(2 * SHARE_SETTLE_STEPS + 1, room))
    if s.gate.enabled:
        tokens = min(tokens, s.gate.max_output_tokens)
    shared = c.fresh(max(0, ctx - page) // page * page)  # prefilled once: the sequences start together
    await c.complete(shared, 1, "sharing: decode prefix")
    streaming = [asyncio.Event() for _ in range(batch)]
    decoding = [asyncio.ensure_future(c.complete(shared + c.fresh(ctx - len(shared)), tokens,
                                                 f"sharing: decode {batch} x {ctx}", ev))
                for ev in streaming]
    for ev in streaming:
        await ev.wait()
    await asyncio.sleep(SHARE_SETTLE_STEPS * step_s)
    windows = []
    for _ in range(SHARE_PROMPTS):
        out = await c.complete(c.fresh(prompt), 1, "sharing: prompt beside the decode")
        windows.append(_client_window(out))
    decoded = await asyncio.gather(*decoding)
    arrivals = [[o["t0"] + t for t in o["token_times_s"]] for o in decoded]
    streamed = (max(ts[0] for ts in arrivals), min(ts[-1] for ts in arrivals))  # every sequence streams
    beside = [w for w in windows if streamed[0] <= w[0] and w[1] <= streamed[1]]
    if not beside or windows[0][0] <= streamed[0]:
        raise RuntimeError(f"sharing: the {batch} decoding sequences did not stream through the prompts beside them "
                           f"({tokens} tokens each)")
    before_s = batch * (windows[0][0] - streamed[0]) / _tokens_within(arrivals, [(streamed[0], windows[0][0])])
    beside_s = batch * sum(hi - lo for lo, hi in beside) / _tokens_within(arrivals, beside)
    windows_alone_s = [_window(o["record"]) for o in alone]
    windows_beside_s = [hi - lo for lo, hi in beside]
    window_alone = statistics.median(windows_alone_s)
    window_beside = statistics.median(windows_beside_s)
    return {"prompt_tokens": prompt, "batch": batch, "context_tokens": ctx, "decode_tokens": tokens,
            "prefill_window_alone_s": windows_alone_s, "prefill_window_beside_s": windows_beside_s,
            "decode_step_before_s": before_s * s.decode.mtp_accept_tokens,
            "decode_step_beside_s": beside_s * s.decode.mtp_accept_tokens,
            "decode_slowdown_per_worker": max(0.0, beside_s / before_s - 1.0),
            "prefill_slowdown_per_worker": max(0.0, window_beside / window_alone - 1.0),
            "prefill_alone_over_grid": _alone_over_grid(window_alone, s.prefill.pp, prompt, grid, prefill_grid)}


def _alone_over_grid(window_alone_s: float, pp: int, prompt_tokens: int, grid: dict,
                     prefill_grid: list[list[float]]) -> float | None:
    """The sharing phase's median window alone over the window the prefill grid measured for the same
    prompt (its cell at no cached context, times ``pp``): 1 when the server computes a prompt at the
    end of the calibration as fast as in its prefill phase; ``None`` without that cell."""
    _, cell_s = _grid_cell(grid, prefill_grid, prompt_tokens)
    return None if cell_s is None else window_alone_s / (pp * cell_s)


def _share_prompt_tokens(least: int, new_tokens: Sequence[int], uncached_step_s: Sequence[float],
                         stage_step_s: float) -> int:
    """The shortest prompt of the prefill grid's ``new_tokens`` (at least ``least``) whose measured
    stage step (no cached context) lasts ``stage_step_s``, so that its window spans several decode
    steps; the longest of them when none does."""
    fits = [n for n, t in zip(new_tokens, uncached_step_s) if n >= least and t >= stage_step_s]
    return min(fits) if fits else max(new_tokens)


def _measured_step_s(decode: dict, batch: int, ctx: int) -> float:
    """The decode phase's step of ``batch`` sequences of ``ctx``-token prompts (the plane's if not measured)."""
    for x in decode["samples"]:
        if x["batch"] == batch and x["prompt_tokens"] == ctx:
            return x["step_s"]
    d = decode["fit"]
    return d["fixed_s"] + d["per_seq_s"] * batch + d["per_ctx_token_s"] * batch * ctx


def _client_window(out: dict) -> tuple[float, float]:
    """A request's prefill window (``prefill_start_s``, ``prefill_end_s``) on the client's clock: its
    record's clock is the router's, whose ``arrival_s`` is when the client sent it."""
    rec = out["record"]
    sent = out["t0"] - float(rec["arrival_s"])
    return sent + float(rec["prefill_start_s"]), sent + float(rec["prefill_end_s"])


def _tokens_within(arrivals: Sequence[Sequence[float]], spans: Sequence[tuple[float, float]]) -> int:
    """Tokens (of every sequence) that arrived inside one of ``spans`` (after its start, by its end), at least 1."""
    return max(1, sum(1 for ts in arrivals for t in ts for lo, hi in spans if lo < t <= hi))


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
                  replay: ReplayPhase | None = None, on_step: Callable[[str], None] = lambda label: None) -> dict:
    """The curves of the server at ``url`` running scenario ``s`` (see the module docstring), and
    with ``replay`` the replay phase's section ``replay``."""
    grid = grid or default_grid(s)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=s.serve.request_timeout_s)) as http:
        c = Client(http, url.rstrip("/"), model or s.model.name, s.serve.vocab, seed, on_step)
        t0 = time.perf_counter()
        phase_s = {}

        def phase_ended(name: str) -> None:
            phase_s[name] = time.perf_counter() - t0 - sum(phase_s.values())

        await _warm_up(c, s)
        phase_ended("warm_up")
        # the requests sent one at a time (the decode phase's come together); the restore's warm-up is one
        one_at_a_time = []
        sent = len(c.records)
        restore, _ = await _restore(c, s, grid)
        one_at_a_time += [o["record"] for o in c.records[sent:]]
        phase_ended("restore")
        decode = await _decode(c, s, grid)
        phase_ended("decode")
        sent = len(c.records)
        prefill_grid, prefill_samples, residual = await _prefill(c, s, grid)
        one_at_a_time += [o["record"] for o in c.records[sent:]]
        phase_ended("prefill")
        sharing = await _sharing(c, s, grid, decode, prefill_grid)
        phase_ended("sharing")
        replayed = None
        if replay is not None:
            replayed = await measure_replay(c, c.url, replay, _grid_cell(grid, prefill_grid, sharing["prompt_tokens"]))
            phase_ended("replay")
        wall = time.perf_counter() - t0
    hand = [(int(r.get("handoff_bytes", 0)), float(r.get("handoff_s", 0.0))) for r in one_at_a_time if r.get("handoff_bytes")]
    pp = s.prefill.pp
    saves = [(int(r["save_bytes"]) // pp, float(r.get("save_s", 0.0))) for r in one_at_a_time if r.get("save_bytes")]
    if not saves:
        raise RuntimeError("no save to the pool was observed: is pool.chunk_tokens larger than every prompt?")
    return {
        "grid": grid,
        "prefill": {"pp": s.prefill.pp, "max_batched_tokens": s.prefill.max_batched_tokens,
                    "new_tokens": grid["new_tokens"], "cached_tokens": grid["cached_tokens"],
                    "step_s": prefill_grid, "replay_scale": 1.0, "samples": prefill_samples},
        "decode": decode,
        "restore": restore,
        "handoff": _bytes_fit(hand),
        "save": _bytes_fit(saves),
        "sharing": sharing,
        "overheads": _overheads(statistics.median(residual) if residual else 0.0),
        **({"replay": replayed} if replayed is not None else {}),
        "requests": len(c.records),
        "wall_s": wall,
        "phase_s": phase_s,
    }


def _grid_cell(grid: dict, prefill_grid: list[list[float]], prompt_tokens: int) -> tuple[int, float | None]:
    """(``prompt_tokens``, the prefill grid's stage step of that fresh prompt), the step ``None``
    where the grid has no such cell (no such ``new_tokens`` or no column without cached context)."""
    if prompt_tokens not in grid["new_tokens"] or grid["cached_tokens"][0] != 0:
        return prompt_tokens, None
    return prompt_tokens, prefill_grid[grid["new_tokens"].index(prompt_tokens)][0]


def _overheads(residual_s: float) -> dict:
    """``control_plane_s``: the median TTFT residual (>= 0)."""
    return {"control_plane_s": max(0.0, residual_s), "ttft_residual_s_median": residual_s}


def refit(doc: dict) -> dict:
    """``doc`` (a calibration document) with its fitted curves recomputed from its samples by this
    module's fits: restore, hand-off and save (``_bytes_fit``), decode (``fit_decode``) and the
    overheads (from ``ttft_residual_s_median``). The measured grids and samples stay as they are."""
    out = dict(doc)
    out["restore"] = {**_bytes_fit([(x["bytes_per_stage"], x["stage_s"]) for x in doc["restore"]["samples"]]),
                      "samples": doc["restore"]["samples"]}
    for curve in ("handoff", "save"):
        out[curve] = _bytes_fit([(x["bytes"], x["s"]) for x in doc[curve]["samples"]])
    out["decode"] = fit_decode(doc["decode"]["samples"])
    out["overheads"] = _overheads(doc["overheads"]["ttft_residual_s_median"])
    return out
