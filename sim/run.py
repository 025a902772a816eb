"""Run the simulator: one load point, or a sweep of loads in parallel processes.

Contract:
    * ``run_point(scenario, load, traces=None)`` simulates one load (AgentX sessions, or RPS for
      production replay) and returns a plain dict: the metrics of ``kvpool.workload.records.summarize``
      (keys in docs/metrics.md) plus time series for the plots. Deterministic: the same scenario
      (seed included), load and traces give identical results, in any process.
    * The workload is the scenario's trace set (``workload.traces``, or ``traces=`` here), else its
      synthetic preset (``workload.preset`` x ``workload.synthetic_sessions``, generated in memory
      and kept as a pickle in ``cache_dir()``; a kept file is read back only when it is a regular
      file of this user that nobody else may write, and only a ``Workload`` in it is used).
    * ``sweep`` runs several loads through ``sim.executor``: in worker processes (``workers``; 1 runs
      in-process) or on a Ray cluster (``executor="ray"``, ``address``; none starts a local runtime),
      with an optional progress callback per finished load; results come back in load order and are
      identical whichever executor ran them.
    * Progress inside a load: ``run_point(..., on_progress=f)`` calls ``f(RunProgress)`` as its
      simulated time advances (``sim.engine``); ``sweep(..., on_progress=f)`` calls ``f(load,
      RunProgress)`` for the loads that run in this process or in local worker processes (whose
      reports come back through a queue, ``sim.executor``); Ray tasks report only when they finish
      (``on_done``). The callback changes no result.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from kvpool.scenario.model import Scenario
from kvpool.workload.errors import TraceError
from kvpool.workload.model import Workload

if TYPE_CHECKING:
    from kvpool.sim.engine import RunProgress
    from kvpool.sim.executor import Runner


@lru_cache(maxsize=4)
def _traces(path: str) -> Workload:
    from kvpool.workload.load import load_workload

    return load_workload(path)


def cache_dir() -> Path:
    """Where synthetic workloads are kept: ``$KVPOOL_CACHE_DIR``, default ``~/.cache/kvpool``."""
    return Path(os.environ.get("KVPOOL_CACHE_DIR", Path.home() / ".cache" / "kvpool"))


def _synthetic_path(preset: str, sessions: int, seed: int, context_scale: float = 1.0) -> Path:
    """The cache file of a synthetic workload, under a key that covers the preset's parameters and
    the generator's source, so a changed generator never serves stale sessions."""
    import hashlib
    import inspect
    import json

    from kvpool.workload import synth

    params = synth.preset_params(preset).with_context_scale(context_scale).to_dict()
    key = hashlib.sha256(json.dumps([params, sessions, seed, inspect.getsource(synth)], sort_keys=True,
                                    default=str).encode()).hexdigest()[:24]
    scale = "" if context_scale == 1 else f"x{context_scale:g}-"
    return cache_dir() / f"synth-{preset}-{scale}{sessions}-{seed}-{key}.pkl"


def synthetic_to_build(s: Scenario, traces: str | None = None) -> bool:
    """Whether running ``s`` first generates its synthetic workload (no trace set, nothing cached)."""
    if traces or s.workload.traces:
        return False
    return not _synthetic_path(s.workload.preset, s.workload.synthetic_sessions, s.seed, s.workload.context_scale).is_file()


def build_synthetic(s: Scenario, on_session: Callable[[int], None] | None = None) -> Workload:
    """``s``'s synthetic workload (``workload_for`` without a trace set), with ``on_session(k)``
    called as each session is made when it is generated here rather than read from the cache."""
    w = s.workload
    return _synthetic(w.preset, w.synthetic_sessions, s.seed, w.context_scale, on_session)


_SYNTHETIC_KEPT = 4  # synthetic workloads kept in memory per process
_synthetic_kept: dict[tuple[str, int, int, float], Workload] = {}


def _synthetic(preset: str, sessions: int, seed: int, context_scale: float = 1.0,
               on_session: Callable[[int], None] | None = None) -> Workload:
    """A synthetic workload: kept in memory (the last few) and in the user's cache directory
    (``cache_dir``), generated once (``on_session``: progress, when it is generated here)."""
    key = (preset, sessions, seed, context_scale)
    got = _synthetic_kept.get(key)
    if got is None:
        got = _load_or_generate(preset, sessions, seed, context_scale, on_session)
        if len(_synthetic_kept) >= _SYNTHETIC_KEPT:
            del _synthetic_kept[next(iter(_synthetic_kept))]
        _synthetic_kept[key] = got
    return got


def _load_or_generate(preset: str, sessions: int, seed: int, context_scale: float,
                      on_session: Callable[[int], None] | None) -> Workload:
    """The synthetic workload from the cache directory, or generated and written there."""
    import pickle

    from kvpool.workload import synth

    root = cache_dir()
    path = _synthetic_path(preset, sessions, seed, context_scale)
    if _own_file(path):
        try:
            with path.open("rb") as f:
                kept = pickle.load(f)
            if isinstance(kept, Workload):
                return kept
        except Exception:  # noqa: BLE001 - a truncated or foreign cache entry: generate again
            pass
    w = synth.synthetic_workload(preset, sessions, seed, context_scale=context_scale, on_session=on_session)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        try:
            with tmp.open("wb") as f:
                pickle.dump(w, f, protocol=pickle.HIGHEST_PROTOCOL)
            tmp.replace(path)
        except BaseException:  # a failed write or a Ctrl-C leaves no partial file behind
            tmp.unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a read-only home still runs, just slower
    return w


def _own_file(path: Path) -> bool:
    """Whether ``path`` is a regular file (not a link) of this user that nobody else may write: a
    cache entry is unpickled only then (a pickle runs code; a shared ``KVPOOL_CACHE_DIR`` must not
    let another user's file in)."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def workload_for(s: Scenario, traces: str | None = None) -> Workload:
    """The scenario's workload: a trace set when given, else its synthetic preset; its prompts
    scaled by ``workload.token_scale`` (``workload.token_scale.scale_workload``; 1: as recorded)."""
    path = traces or s.workload.traces
    if path:
        if s.workload.context_scale != 1:
            raise TraceError(f"workload.context_scale={s.workload.context_scale:g} applies to the synthetic presets only; "
                             "a trace set keeps its recorded sizes (use --set workload.context_scale=1)", file=str(path))
        return _scaled_traces(os.path.abspath(path), s.workload.token_scale)
    w = _synthetic(s.workload.preset, s.workload.synthetic_sessions, s.seed, s.workload.context_scale)
    return w if s.workload.token_scale == 1 else _scaled(w, s.workload.token_scale)


@lru_cache(maxsize=4)
def _scaled_traces(path: str, token_scale: float) -> Workload:
    return _traces(path) if token_scale == 1 else _scaled(_traces(path), token_scale)


_scaled_kept: dict[tuple[int, float], tuple[Workload, Workload]] = {}


def _scaled(w: Workload, token_scale: float) -> Workload:
    """``scale_workload(w, token_scale)``, kept for the last few workloads (by identity)."""
    from kvpool.workload.token_scale import scale_workload

    key = (id(w), token_scale)
    got = _scaled_kept.get(key)
    if got is None or got[0] is not w:
        if len(_scaled_kept) >= _SYNTHETIC_KEPT:
            del _scaled_kept[next(iter(_scaled_kept))]
        got = _scaled_kept[key] = (w, scale_workload(w, token_scale))
    return got[1]


def make_replay(s: Scenario, workload: Workload, load: float):
    """The replay schedule of one load: ``load`` sessions (agentx) or requests/s (replay)."""
    from kvpool.workload.replay import AgentXReplay, ProductionReplay

    w = s.workload
    if w.mode == "agentx":
        return AgentXReplay(workload, lanes=int(load), seed=s.seed, duration_s=w.duration_s, idle_cap_s=w.idle_cap_s,
                            warmup_requests=w.warmup_requests, start_fraction_min=w.start_fraction_min,
                            start_fraction_max=w.start_fraction_max, max_context_tokens=w.max_context_tokens,
                            max_output_tokens=w.max_output_tokens)
    return ProductionReplay(workload, lanes=w.lanes, rps=float(load), seed=s.seed, duration_s=w.duration_s,
                            start_fraction_min=w.start_fraction_min, start_fraction_max=w.start_fraction_max,
                            max_context_tokens=w.max_context_tokens, max_output_tokens=w.max_output_tokens)


def load_key(s: Scenario) -> str:
    """``sessions`` for AgentX lanes, ``rps`` for production replay."""
    return "sessions" if s.workload.mode == "agentx" else "rps"


def run_point(s: Scenario, load: float, traces: str | None = None,
              on_progress: Callable[["RunProgress"], None] | None = None) -> dict:
    """Simulate one load; see the module docstring."""
    from kvpool.sim.engine import Simulation
    from kvpool.workload.records import summarize

    workload = workload_for(s, traces)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    replay = make_replay(s, workload, load)
    sim = Simulation(s, replay)
    records = sim.run(on_progress)
    # the measured window starts when profiling does (AgentX) or at the replay's start; responses
    # after duration + grace are not counted (AIPerf's benchmark grace period)
    start = getattr(replay, "profile_start_s", None)
    start = getattr(replay, "start_s", 0.0) if start is None else start
    cutoff = start + s.workload.duration_s + s.workload.grace_s
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    tl = sim.timeline
    out = {
        "scenario": s.name,
        load_key(s): int(load) if load_key(s) == "sessions" else float(load),
        "duration_s": s.workload.duration_s,
        **summarize(records, gpus=sim.gpus, occupancy=(tl.decode_t, tl.decode_occ), cutoff_s=cutoff,
                    lane_window=(start, start + s.workload.duration_s)),
        "simulated_s": sim.env.now,
        "wall_s": wall,
        "cpu_s": cpu,
        "sim_s_per_wall_s": sim.env.now / wall if wall > 0 else 0.0,
        "pool_evicted_groups": sim.pool.evicted_groups if sim.pool is not None else 0,
        **({"cost_notes": sim.cost.fallback_lines()} if hasattr(sim.cost, "fallback_lines") else {}),
        **({"kv_notes": lines} if (lines := prefill_kv_notes(s, records)) else {}),
        "timeline": {  # at most ~400 samples per series (every k-th point)
            "pool_t": tl.pool_t[::max(1, len(tl.pool_t) // 400)],
            "pool_used": tl.pool_used[::max(1, len(tl.pool_used) // 400)],
            "pool_evicted": tl.pool_evicted[::max(1, len(tl.pool_evicted) // 400)],
            "decode_t": tl.decode_t[::max(1, len(tl.decode_t) // 400)],
            "decode_occ": tl.decode_occ[::max(1, len(tl.decode_occ) // 400)],
        },
        "restore_stage_s": sorted(x for r in records if r.measured and r.pool_tokens for x in r.restore_stage_s)[::4],
    }
    return out


def prefill_kv_notes(s: Scenario, records) -> list[str]:
    """Why requests failed with ``prefill_kv``: a prompt of more pages than its prefill instance's
    KV holds fails, as ``kvpool serve`` answers 413 (``sim.steps.pages``); empty when none did."""
    from kvpool.scenario.derive import prefill_kv_capacity_tokens

    failed = [r for r in records if r.error == "prefill_kv"]
    if not failed:
        return []
    where = ("serve.prefill_kv_tokens" if s.cost.kv_capacity == "serve"
             else "derived from HBM: prefill.gpu_mem_utilization, prefill.reserved_gb_per_gpu, model.weights_gb")
    return [f"{len(failed):,} of {len(records):,} requests failed: their prompts (up to {max(r.in_tokens for r in failed):,} "
            f"tokens) need more pages than one prefill instance's KV holds ({prefill_kv_capacity_tokens(s):,} "
            f"tokens, {where}), as kvpool serve refuses them (413)"]


def _point_task(args: tuple[Scenario, float, str | None],
                report: Callable[["RunProgress"], None] | None = None) -> dict:
    s, load, traces = args
    return run_point(s, load, traces, on_progress=report)


def sweep(
    s: Scenario,
    loads: Sequence[float],
    *,
    traces: str | None = None,
    workers: int = 1,
    executor: str = "local",
    address: str | None = None,
    on_done: Callable[[float, dict], None] | None = None,
    runner: "Runner | None" = None,
    on_progress: Callable[[float, "RunProgress"], None] | None = None,
) -> list[dict]:
    """Run ``loads`` (in load order in the result); ``on_done(load, result)`` after each, and
    ``on_progress(load, RunProgress)`` as a load's simulated time advances (see the module docstring).

    Where the points run is ``sim.executor``'s choice: ``executor``/``workers``/``address`` open a
    runner for this sweep, or pass an open ``runner`` to share one (a Ray runtime) across sweeps.
    """
    from kvpool.sim.executor import runner as open_runner

    tasks = [(s, float(x), traces) for x in loads]

    def done(i: int, result: dict) -> None:
        if on_done:
            on_done(tasks[i][1], result)

    def progress(i: int, p: "RunProgress") -> None:
        on_progress(tasks[i][1], p)

    report = progress if on_progress else None
    if runner is not None:
        return runner.map(_point_task, tasks, done, report)
    with open_runner(executor, workers=workers, address=address) as r:
        return r.map(_point_task, tasks, done, report)
