"""The engines' own time accounts: what the serving stack costs (``bench/serve.py``, ``bench/fidelity.py``)
and what a prefill stage's step costs in a replay (``kvpool calibrate --replay-traces``).

    engine_urls(run_dir)           each prefill and decode engine's URL, by worker name, from a
                                   ``kvpool serve`` run directory's ready files
    time_accounts(urls)            each engine's accounts now, from its ``GET /metrics``
    stage_time(before, after)      what the prefill engines' stages spent on their steps between two
                                   readings, summed over the engines: ``stage_s`` (per engine the
                                   mean over its stages of the compute calls' round trips less
                                   their waits behind a stage's earlier step: the layers, the
                                   stage's other work and the hops, what a simulated stage's step
                                   stands for), ``forward_s`` (the same mean of the layers alone),
                                   ``step_tokens`` and ``steps`` (computed in steps); and the
                                   decode engines' ``step_s``, ``steps`` and ``sequences`` (summed
                                   over their steps' batches)
    stack_cost(before, after, s)   what the engines did between two readings ``s`` seconds apart:
                                   per engine its busy time and the model's share of it
                                   (``forward_share``), the bottleneck (the engine busy the largest
                                   share of the window) and ``stack_cost``: for a decode engine
                                   1 - its ``forward_share``, for a prefill engine its
                                   ``stack_share`` (of its steps' time in flight, the share outside
                                   the stages' layers and their queues: the stages' other work, the
                                   hops, the engine's relaying; the pipeline's fill,
                                   ``mean_steps_in_flight`` of ``prefill.pp``, is the plan's: the
                                   simulator forms the same steps and passes them through the same
                                   pipeline); a prefill engine also how its busy time splits:
                                   ``computable_share`` (a step in flight or tokens a step could
                                   take), ``loading_only_share`` (nothing computable, a request
                                   loading from the pool) and ``pages_only_share`` (requests
                                   waiting for pages only), and where its compute calls' round
                                   trips went (``stage_calls``: the layers, waiting at a stage,
                                   the stage's other work, the hop between processes).
                                   ``docs/serve.md`` ("What the serving stack costs") says what
                                   each account counts.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvpool.backend.serve.plan import ServePlan


def engine_urls(run_dir: Path) -> dict[str, str]:
    """Each prefill and decode engine's URL, by worker name, from the run directory's ready files."""
    plan = ServePlan.read(run_dir / "plan.json")
    return {w.name: json.loads(plan.ready_path(w.name).read_text())["url"]
            for w in plan.workers if w.role in ("prefill_engine", "decode_engine")}


def time_accounts(urls: dict[str, str]) -> dict[str, dict]:
    """Each engine's time accounts now: a prefill engine's ``pending_s``, ``steps_in_flight_s``,
    ``steps`` and ``step_tokens`` (steps done and the tokens they computed), ``running`` and
    ``waiting`` (requests it holds now) and ``stage_forward_s`` (by stage, and its siblings); a
    decode engine's ``busy_s``, ``step_s`` (the sum of its steps' seconds), ``steps`` and
    ``sequences`` (the sum of its steps' batch sizes)."""
    out = {}
    for name, url in urls.items():
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
        samples = {(s.name, s.labels.get("stage", "")): s.value
                   for fam in text_string_to_metric_families(text) for s in fam.samples}
        if ("kvpool:prefill_pending_seconds", "") in samples:
            def per_stage(metric: str) -> list[float]:
                got = {int(stage): v for (n, stage), v in samples.items() if n == metric}
                return [got[k] for k in sorted(got)]

            out[name] = {"pending_s": samples[("kvpool:prefill_pending_seconds", "")],
                         "computable_s": samples[("kvpool:prefill_computable_seconds", "")],
                         "loading_only_s": samples[("kvpool:prefill_loading_only_seconds", "")],
                         "steps_in_flight_s": samples[("kvpool:prefill_steps_in_flight_seconds", "")],
                         "running": samples[("kvpool:prefill_running_requests", "")],
                         "waiting": samples[("kvpool:prefill_waiting_requests", "")],
                         "steps": samples[("kvpool:prefill_steps_done", "")],
                         "step_tokens": samples[("kvpool:prefill_step_tokens_done", "")],
                         "stage_forward_s": per_stage("kvpool:prefill_stage_forward_seconds"),
                         "stage_queued_s": per_stage("kvpool:prefill_stage_queued_seconds"),
                         "stage_handled_s": per_stage("kvpool:prefill_stage_handled_seconds"),
                         "stage_round_trip_s": per_stage("kvpool:prefill_stage_round_trip_seconds")}
        else:
            out[name] = {"busy_s": samples[("kvpool:decode_busy_seconds_total", "")],
                         "step_s": samples[("kvpool:decode_step_seconds_sum", "")],
                         "steps": samples[("kvpool:decode_step_seconds_count", "")],
                         "sequences": samples[("kvpool:decode_batch_sequences_sum", "")]}
    return out


def stack_cost(before: dict[str, dict], after: dict[str, dict], window_s: float) -> dict:
    """What the engines did in ``window_s`` between two ``time_accounts`` (see the module docstring)."""
    engines = {}
    for name, a in after.items():
        b = before[name]
        if "pending_s" in a:
            busy_s = a["pending_s"] - b["pending_s"]
            forward_s = [x - y for x, y in zip(a["stage_forward_s"], b["stage_forward_s"])]
            in_flight_s = a["steps_in_flight_s"] - b["steps_in_flight_s"]
            computable_s = a["computable_s"] - b["computable_s"]
            loading_only_s = a["loading_only_s"] - b["loading_only_s"]
            queued_s = _spent(a, b, "stage_queued_s")
            engines[name] = {"pending_s": busy_s, "stage_forward_s": forward_s,
                             "forward_share": max(forward_s) / busy_s if busy_s > 0 else None,
                             "mean_steps_in_flight": in_flight_s / busy_s if busy_s > 0 else None,
                             "stack_share": _stack_share(in_flight_s, sum(forward_s), queued_s),
                             **_split(busy_s, computable_s, loading_only_s),
                             "stage_calls": _stage_calls(_spent(a, b, "stage_round_trip_s"),
                                                         _spent(a, b, "stage_handled_s"), queued_s, sum(forward_s))}
        else:
            busy_s = a["busy_s"] - b["busy_s"]
            step_s = a["step_s"] - b["step_s"]
            engines[name] = {"busy_s": busy_s, "step_s": step_s,
                             "forward_share": step_s / busy_s if busy_s > 0 else None}
        engines[name]["busy_share_of_window"] = busy_s / window_s
    bottleneck = max(engines, key=lambda n: engines[n]["busy_share_of_window"])
    e = engines[bottleneck]
    if "stack_share" in e:
        cost = e["stack_share"]
    else:
        cost = None if e["forward_share"] is None else 1.0 - e["forward_share"]
    return {"window_s": window_s, "engines": engines, "bottleneck": bottleneck, "stack_cost": cost}


def stage_time(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """What the engines' steps cost between two ``time_accounts`` (see the module docstring)."""
    prefill = {"stage_s": 0.0, "forward_s": 0.0, "step_tokens": 0, "steps": 0}
    decode = {"step_s": 0.0, "steps": 0, "sequences": 0}
    for name, a in after.items():
        b = before[name]
        if "pending_s" in a:
            stages = len(a["stage_round_trip_s"])
            prefill["stage_s"] += (_spent(a, b, "stage_round_trip_s") - _spent(a, b, "stage_queued_s")) / stages
            prefill["forward_s"] += _spent(a, b, "stage_forward_s") / stages
            prefill["step_tokens"] += int(a["step_tokens"] - b["step_tokens"])
            prefill["steps"] += int(a["steps"] - b["steps"])
        else:
            decode["step_s"] += a["step_s"] - b["step_s"]
            decode["steps"] += int(a["steps"] - b["steps"])
            decode["sequences"] += int(a["sequences"] - b["sequences"])
    return {"prefill": prefill, "decode": decode}


def _stack_share(in_flight_s: float, forward_s: float, queued_s: float) -> float | None:
    """Of the time a prefill engine's steps were in flight (summed over the steps), the share spent
    neither in a stage's layers nor waiting behind a stage's earlier step: the stages' other work,
    the hops and the engine's relaying between them, which the pipeline itself does not need."""
    if in_flight_s <= 0:
        return None
    return max(0.0, in_flight_s - forward_s - queued_s) / in_flight_s


def _split(pending_s: float, computable_s: float, loading_only_s: float) -> dict:
    """A prefill engine's busy time by what it could do: compute, only load, only wait for pages."""
    if pending_s <= 0:
        return {"computable_share": None, "loading_only_share": None, "pages_only_share": None}
    return {"computable_share": computable_s / pending_s, "loading_only_share": loading_only_s / pending_s,
            "pages_only_share": max(0.0, pending_s - computable_s - loading_only_s) / pending_s}


def _spent(after: dict, before: dict, key: str) -> float:
    """The seconds a per-stage account grew between two readings, summed over the stages."""
    return sum(after[key]) - sum(before[key])


def _stage_calls(round_trip_s: float, handled_s: float, queued_s: float, forward_s: float) -> dict:
    """Where a prefill engine's compute calls spent their round trips, all stages together: the
    layers (``forward``), waiting behind a stage's earlier step (``queued``), the stage's own work
    around the layers (``stage_other``: the input's copy on, the output's copy off the device)
    and the hop (``hop``: the messages from the stage through the engine)."""
    if round_trip_s <= 0:
        return {"round_trip_s": round_trip_s}
    return {"round_trip_s": round_trip_s, "forward_share": forward_s / round_trip_s,
            "queued_share": queued_s / round_trip_s,
            "stage_other_share": max(0.0, handled_s - queued_s - forward_s) / round_trip_s,
            "hop_share": max(0.0, round_trip_s - handled_s) / round_trip_s}
