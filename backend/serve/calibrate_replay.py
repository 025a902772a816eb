"""The calibration's replay phase (``kvpool calibrate --replay-traces``): what a prefill stage's step
costs on the server while a replay runs, from the engines' own time accounts.

A prefill grid measured one request at a time describes a quiet server; in a replay the same step
may take longer (the other workers compute beside it, a hand-off and a save run beside it, the
GPU's clocks and the allocator are in another state). This phase replays a trace set that the
calibration is not asked to predict and reads what the stages spent on the steps they computed, so
that ``sim.replay_fit`` can scale the grid to it.

Contract:
    * ``ReplayPhase(scenario, traces, engine_urls, schedule)``: the scenario the replay runs (its
      ``workload.*``: sessions, duration, token scale, output cap, warm-up; AgentX mode), the trace
      set (a file or a folder, ``workload.load.trace_files``), each engine's URL
      (``engine_accounts.engine_urls`` of the server's run directory) and the replay's schedule,
      ``sim.run.make_replay`` of the scenario over the traces at ``workload.sessions``, which the
      caller builds (the backend imports no simulator).
    * ``await measure_replay(client, url, phase, cell_s)``: ``PROBE_PROMPTS`` fresh prompts of
      ``cell_s[0]`` tokens alone, one at a time (``alone_before``); then the traces replayed
      against the server at ``url`` with that schedule
      (``backend.serve.replay_client.run_replay``, as ``kvpool replay`` does), and a wait until no
      prefill engine holds a request (``IDLE_TIMEOUT_S`` at most), the engines' accounts read
      before the replay and after that wait (``engine_accounts.stage_time``: the requests the
      client cancelled at the window's end count as far as the server computed them); then the
      same prompts alone again (``alone_after``). Each probe has its windows, the forward seconds
      per token they added and ``over_grid``, the median window over ``pp x cell_s[1]`` (the
      grid's cell of that prompt): a server that is slower after the replay than before it keeps
      a state that slows it; one that is not was slowed by the replay's concurrency. Returns the
      document's ``replay`` section (below) without ``fit``, which
      ``sim.replay_fit.fit_replay_scale`` adds.
    * ``trace_digests(path) -> [{"name", "sha256"}]``: the trace files of ``path``, each by its
      content; ``replayed_files(doc, path)``: the files of ``path`` whose content a calibration
      document's replay phase replayed (a held-out prediction must have none).

The section: ``traces`` (as given), ``files`` (``trace_digests``), ``sessions``, ``duration_s``,
``token_scale``, ``seed``, ``requests`` (finished), ``errors``, ``cancelled``, ``wall_s``, ``idle``
(whether the engines went idle within ``IDLE_TIMEOUT_S``), ``prefill`` (``stage_s``, ``forward_s``,
``step_tokens``, ``steps`` and the per-token figures ``stage_us_per_token`` and
``forward_us_per_token``), ``decode`` (``step_s``, ``steps``, ``sequences``, ``mean_step_s``,
``mean_batch``), ``alone_before`` and ``alone_after`` (``prompt_tokens``, ``windows_s``,
``forward_us_per_token`` and its median, ``over_grid``).
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from kvpool.backend.serve.engine_accounts import stage_time, time_accounts

PROBE_PROMPTS = 3  # prompts alone before the replay, and as many after it
IDLE_TIMEOUT_S = 120.0  # the longest wait for the prefill engines to finish what the replay left
IDLE_POLL_S = 0.5


@dataclass(frozen=True)
class ReplayPhase:
    scenario: object  # kvpool.scenario.model.Scenario: the replay's workload settings
    traces: str
    engine_urls: dict[str, str]
    schedule: object  # sim.run.make_replay's replay of the traces (kvpool.workload.replay)


def trace_digests(path: str | Path) -> list[dict]:
    """The trace files ``path`` names (``workload.load.trace_files``), each with its content's SHA-256."""
    from kvpool.workload.load import trace_files

    return [{"name": f.name, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()} for f in trace_files(path)]


def replayed_files(doc: dict, path: str | Path) -> list[str]:
    """The names of ``path``'s trace files whose content the calibration document ``doc``'s replay
    phase replayed (none for a document without one)."""
    replay = doc.get("replay") or {}
    seen = {f.get("sha256") for f in replay.get("files") or [] if isinstance(f, dict)}
    return [f["name"] for f in trace_digests(path) if f["sha256"] in seen]


async def measure_replay(client, url: str, phase: ReplayPhase, cell_s: tuple[int, float | None]) -> dict:
    """The replay phase (see the module docstring); ``client`` is ``backend.serve.calibrate.Client``,
    ``cell_s`` (prompt tokens, the prefill grid's stage step of that prompt with no cached context,
    ``None`` where the grid has none: ``over_grid`` is then ``None``)."""
    from kvpool.backend.serve.prompts import PromptBuilder
    from kvpool.backend.serve.replay_client import run_replay
    s = phase.scenario
    w = s.workload
    files = trace_digests(phase.traces)
    schedule = phase.schedule
    urls = phase.engine_urls
    alone_before = await _alone(client, urls, s.prefill.pp, cell_s, "replay: a prompt alone before it")
    before = await asyncio.to_thread(time_accounts, urls)
    t0 = time.perf_counter()
    result = await run_replay(schedule, url=url, prompts=PromptBuilder(s.serve.vocab), model=client.model,
                              request_timeout_s=s.serve.request_timeout_s + 30.0, grace_s=w.grace_s)
    idle = await _wait_idle(urls)
    after = await asyncio.to_thread(time_accounts, urls)
    wall = time.perf_counter() - t0
    client.on_step(f"replay: {w.sessions} sessions")
    spent = stage_time(before, after)
    done = [o for o in result.outcomes if not o.error and o.record.end_s > 0]
    return {"traces": phase.traces, "files": files, "sessions": w.sessions, "duration_s": w.duration_s,
            "token_scale": w.token_scale, "seed": s.seed, "requests": len(done), "errors": result.errors,
            "cancelled": result.cancelled, "wall_s": wall, "idle": idle,
            "prefill": _per_token(spent["prefill"]), "decode": _decode(spent["decode"]),
            "alone_before": alone_before,
            "alone_after": await _alone(client, urls, s.prefill.pp, cell_s, "replay: a prompt alone after it")}


async def _wait_idle(urls: dict[str, str]) -> bool:
    """Wait until no prefill engine holds a request (running or waiting for pages); whether it came
    within ``IDLE_TIMEOUT_S``."""
    end = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        now = await asyncio.to_thread(time_accounts, urls)
        if all(a.get("running", 0) == 0 and a.get("waiting", 0) == 0 for a in now.values()):
            return True
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(IDLE_POLL_S)


def _per_token(p: dict) -> dict:
    tokens = p["step_tokens"]
    return {**p, "stage_us_per_token": 1e6 * p["stage_s"] / tokens if tokens else None,
            "forward_us_per_token": 1e6 * p["forward_s"] / tokens if tokens else None}


def _decode(d: dict) -> dict:
    steps = d["steps"]
    return {**d, "mean_step_s": d["step_s"] / steps if steps else None,
            "mean_batch": d["sequences"] / steps if steps else None}


async def _alone(client, urls: dict[str, str], pp: int, cell_s: tuple[int, float | None], label: str) -> dict:
    """``PROBE_PROMPTS`` fresh prompts of ``cell_s[0]`` tokens, one at a time."""
    tokens, stage_s = cell_s
    windows, forward = [], []
    for _ in range(PROBE_PROMPTS):
        before = await asyncio.to_thread(time_accounts, urls)
        out = await client.complete(client.fresh(tokens), 1, label)
        spent = stage_time(before, await asyncio.to_thread(time_accounts, urls))["prefill"]
        rec = out["record"]
        windows.append(float(rec["prefill_end_s"]) - float(rec["prefill_start_s"]))
        forward.append(1e6 * spent["forward_s"] / spent["step_tokens"] if spent["step_tokens"] else None)
    known = [f for f in forward if f is not None]
    return {"prompt_tokens": tokens, "windows_s": windows, "forward_us_per_token": forward,
            "forward_us_per_token_median": statistics.median(known) if known else None,
            "over_grid": statistics.median(windows) / (pp * stage_s) if stage_s else None}
