#!/usr/bin/env python3
"""Production mode on one GPU: ``kvpool serve`` driven by ``kvpool replay`` at several loads.

One run, in order:

    serve     ``kvpool serve SCENARIO`` (default ``h200-tiny``: every worker on cuda:0, the
              embedded pool), started and stopped by this script
    loads     ``kvpool replay`` of real traces at each ``--loads`` sessions for ``--duration`` s,
              prompts scaled by ``--token-scale`` (workload.token_scale): throughput per GPU,
              TTFT p50/p90, token sources, restore per stage, hand-off GB/s (from the records'
              hand-off bytes and seconds)
    check     the GPU correctness check: a multi-turn session (each turn = the previous prompt, its
              answer and new tokens; the first one 600 tokens, or index_topk + 64 with the DSA
              indexer so that every turn selects) whose answers must equal ``reference_generate``
              on the same device, the no-cache recompute (no GPU prefix cache, no pool, no hand-off)
    stack     per load, from the engines' own time accounts (``GET /metrics`` before and after the
              replay): each prefill engine's ``pending_s`` (it held prompt tokens not yet computed)
              and each stage's forward seconds, each decode engine's ``busy_s`` (loop iterations
              that ran a step) and its steps' seconds. ``forward_share`` is the model's part of the
              engine's busy time (the busiest stage's forward over ``pending_s``; the steps over
              ``busy_s``), and a prefill engine's ``mean_steps_in_flight`` says how full its
              pipeline was over ``pending_s`` (``pp`` when every stage holds a step) and its
              ``computable_share``, ``loading_only_share`` and ``pages_only_share`` what it could
              do in that time (compute; only load from the pool; only wait for pages), and
              ``stage_calls`` where its compute calls' round trips went (the layers, waiting at a
              stage, the stage's other work, the hops between the processes). The
              bottleneck is the engine busy the largest share of the window, and ``stack_cost``
              the time HTTP, routing, scheduling, the connector, the hand-off and the messages
              between processes keep it from computing: for a decode engine 1 - its
              ``forward_share``; for a prefill engine its ``stack_share``, the part of its steps'
              time in flight spent neither in a stage's layers nor waiting behind a stage's earlier
              step (the pipeline's fill, ``mean_steps_in_flight`` of ``prefill.pp``, follows from
              the steps the policy forms, which the simulator forms and pipelines alike). The
              forward seconds are measured inside the workers as they share the device, so the
              workers' slowing of one another is not counted as the stack's.
    limits    measured in the same run after the server stopped: pinned host -> device copy and a
              device copy (GB/s, 256 MiB); when the prefill stages and the decode ranks are on
              different GPUs, the GPU-to-GPU copy of every stage-to-decode pair (the hand-off's
              paths; ``handoff_to_peer_copy`` per load is the hand-off GB/s over their median);
              and the bare model forward pass over the work of the
              highest load, in one process with nothing beside it: prefill of its requests'
              computed tokens (a sample of them, the cached prefix computed first and not timed)
              and decode steps at its concurrency; ``bare_throughput_tok_s`` is the served tokens
              over the prefill and the decode run one after the other (the server overlaps them).

Prints one JSON document (and writes it to ``--out``). Usage, on a machine with a GPU:
    python bench/serve.py [--loads 2,4,8] [--duration 60] [--token-scale 1/16]
on the CPU (no copy limits; the correctness check's reference runs on the CPU):
    python bench/serve.py --scenario cpu-tiny --loads 2,4,8 --token-scale 1/32 --out bench/results/serve-cpu.json
and on eight GPUs (the seed's 1P1D, one GPU per worker):
    python bench/serve.py --scenario h200x8-tiny --loads 4,8,16 --out bench/results/serve-h200x8.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import torch
from device_timing import sync, times_s
from kvpool.backend.serve.engine_accounts import engine_urls, stack_cost, time_accounts
from json_out import emit

ROOT = Path(__file__).resolve().parents[1]
KVPOOL = [sys.executable, "-m", "kvpool.cli"]


def log(msg: str) -> None:
    print(f"[serve-bench] {msg}", file=sys.stderr, flush=True)


def replay(scenario: str, url: str, traces: str, sessions: int, duration_s: float, token_scale: str,
           out: Path, sets: list[str]) -> tuple[dict, list[dict]]:
    args = [*KVPOOL, "replay", scenario, "--url", url, "--traces", traces, "--sessions", str(sessions),
            "--duration", str(duration_s), "--token-scale", token_scale, "--out", str(out), "--json"]
    for s in sets:
        args += ["--set", s]
    log(f"replay: {sessions} sessions for {duration_s:g} s")
    done = subprocess.run(args, capture_output=True, text=True, timeout=duration_s + 400)
    if done.returncode != 0:
        raise SystemExit(f"kvpool replay failed ({done.returncode}):\n{done.stderr[-4000:]}")
    doc = json.loads(done.stdout)
    (jsonl,) = sorted(out.glob(f"replay-*-sessions-{sessions}-*.jsonl"))
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return doc["results"][0], records


def log_prefill_accounts(name: str, e: dict) -> None:
    """A prefill engine's time accounts of one load (``engine_accounts.stack_cost``), in two lines."""
    if e.get("computable_share") is not None:
        log(f"  {name} busy {percent(e['busy_share_of_window'])} of the window: computable "
            f"{percent(e['computable_share'])}, loading only {percent(e['loading_only_share'])}, "
            f"waiting for pages only {percent(e['pages_only_share'])}; {e['mean_steps_in_flight']:.2f} steps in flight, "
            f"stack share of their time {percent(e['stack_share'])}")
    calls = e["stage_calls"]
    if "hop_share" in calls:
        log(f"  {name} compute calls' round trips: layers {percent(calls['forward_share'])}, queued at a stage "
            f"{percent(calls['queued_share'])}, the stage's other work {percent(calls['stage_other_share'])}, "
            f"hops {percent(calls['hop_share'])}")


def handoff_gb_s(records: list[dict]) -> float:
    ok = [r for r in records if not r.get("error") and r.get("handoff_s", 0) > 0]
    secs = sum(r["handoff_s"] for r in ok)
    return sum(r["handoff_bytes"] for r in ok) / secs / 1e9 if secs else 0.0


def percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def post(url: str, body: dict, timeout_s: float = 300) -> dict:
    import urllib.request

    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def correctness_session(url: str, model: str, vocab: int, turns: int, first_tokens: int, grow_tokens: int,
                        out_tokens: int, seed: int) -> list[dict]:
    """A multi-turn session; each turn's prompt, the server's answer and its record."""
    rng = random.Random(seed)
    prompt = [rng.randrange(256) for _ in range(first_tokens)]
    session = []
    for t in range(turns):
        ans = post(url, {"model": model, "prompt": prompt, "max_tokens": out_tokens, "ignore_eos": True})
        ids = ans["choices"][0]["token_ids"]
        session.append({"turn": t, "prompt": list(prompt), "answer": ids, "record": ans["kvpool"]["record"]})
        prompt = prompt + ids + [rng.randrange(256) for _ in range(grow_tokens)]
    return session


def gb_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def best_s(fn, devices: tuple[torch.device, ...], reps: int) -> float:
    """The fastest of ``reps`` runs of ``fn``, each timed from and to an idle ``devices``."""
    return min(times_s(fn, devices, reps))


def copy_limits(dev: torch.device, nbytes: int = 256 << 20, reps: int = 5) -> dict:
    if dev.type != "cuda":
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return {"h2d_pinned_gb_s": gb_s(nbytes, best_s(lambda: a.copy_(host, non_blocking=True), (dev,), reps)),
            "device_copy_gb_s": gb_s(nbytes, best_s(lambda: b.copy_(a), (dev,), reps))}


def peer_copy_limits(plan, nbytes: int = 256 << 20, reps: int = 5) -> dict:
    """GPU-to-GPU copy GB/s from every prefill stage's device to every decode device of ``plan``
    (the hand-off's paths), best of ``reps``; empty when no such pair is on two different GPUs."""
    stages = sorted({w.devices[0] for w in plan.workers if w.role == "prefill_stage"})
    decodes = sorted({d for w in plan.workers if w.role == "decode_engine" for d in w.devices})
    pairs = [(a, b) for a in stages for b in decodes if a != b and a.startswith("cuda") and b.startswith("cuda")]
    if not pairs:
        return {}
    by_pair = {}
    for a, b in pairs:
        src = torch.empty(nbytes, dtype=torch.uint8, device=a)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=b)
        seconds = best_s(lambda: dst.copy_(src, non_blocking=True), (src.device, dst.device), reps)
        by_pair[f"{a}->{b}"] = gb_s(nbytes, seconds)
        del src, dst
    values = sorted(by_pair.values())
    return {"peer_copy_gb_s_min": values[0], "peer_copy_gb_s_median": statistics.median(values),
            "peer_copy_gb_s": by_pair}


def bare_forward(config, records: list[dict], sessions: int, max_seqs: int, dcp: int, dev: torch.device,
                 sample: int = 12) -> dict:
    """The model's own speed on the work of ``records`` (see the module docstring)."""
    from kvpool.backend.refmodel import RefModel
    from kvpool.backend.serve.decode_model import DcpCaches, DecodeModel, DecodeSeq, rank_pages

    model = RefModel(config, dev)
    P = config.page_tokens
    done = [r for r in records if not r.get("error") and r.get("end_s", 0) > 0]
    if not done:
        return {}
    rng = random.Random(0)
    picked = rng.sample(done, min(sample, len(done)))
    computed_s, computed_tokens = 0.0, 0
    for r in picked:
        n, new = r["in_tokens"], r["computed_tokens"]
        start = ((n - new) // P) * P  # the cached prefix, whole pages
        toks = [rng.randrange(256) for _ in range(n)]
        table = torch.arange(-(-n // P), device=dev)
        caches = model.new_caches(table.numel())
        if start:
            model.prefill(toks[:start + 1], caches, table)  # fill the prefix's pages, not timed
        sync(dev)
        t0 = time.perf_counter()
        model.prefill(toks, caches, table, start_token=start)
        sync(dev)
        computed_s += time.perf_counter() - t0
        computed_tokens += n - start
    prefill_tok_s = computed_tokens / computed_s
    batch = max(1, min(sessions, max_seqs))
    ctx = int(statistics.median(r["in_tokens"] for r in done))
    pages = max(rank_pages(ctx + 64, rk, dcp, P) for rk in range(dcp))
    kv = DcpCaches(config, dcp, pages * batch, [dev])
    tables = [[torch.arange(b * pages, (b + 1) * pages, device=dev) for _ in range(dcp)] for b in range(batch)]
    step = DecodeModel(model, kv, [dev])
    seqs = [DecodeSeq(1, ctx, t, [x.tolist() for x in t]) for t in tables]
    step.step(seqs)
    sync(dev)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        step.step(seqs)
    sync(dev)
    step_s = (time.perf_counter() - t0) / reps
    prompt = sum(r["in_tokens"] for r in done)
    out = sum(r["out_tokens"] for r in done)
    bare_s = sum(r["computed_tokens"] for r in done) / prefill_tok_s + out / batch * step_s
    return {"prefill_tok_s": prefill_tok_s, "prefill_sample_requests": len(picked),
            "decode_step_s": step_s, "decode_batch": batch, "decode_context_tokens": ctx,
            "bare_s": bare_s, "bare_throughput_tok_s": (prompt + out) / bare_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="h200-tiny")
    ap.add_argument("--loads", default="2,4,8", help="AgentX sessions per load, comma-separated")
    ap.add_argument("--duration", type=float, default=60.0, help="measured window per load, s")
    ap.add_argument("--token-scale", default="1/16")
    ap.add_argument("--traces", default=str(ROOT / "tests/data/traces/kv-cache-tester"))
    ap.add_argument("--set", dest="sets", action="append", default=[], help="scenario override (repeatable)")
    ap.add_argument("--turns", type=int, default=3, help="turns of the correctness session")
    ap.add_argument("--out", default=str(ROOT / "bench/results/serve-h200.json"))
    a = ap.parse_args()

    from kvpool.backend.serve.model_config import ref_config
    from kvpool.backend.serve.launch import start_serve
    from kvpool.backend.serve.plan import build_plan
    from kvpool.backend.serve.reference import reference_generate
    from kvpool.scenario.load import load_scenario

    s = load_scenario(a.scenario, a.sets)
    config = ref_config(s)
    dev = torch.device(s.serve.devices[0])
    work = Path(tempfile.mkdtemp(prefix="kvpool-serve-bench-"))
    loads = [int(x) for x in a.loads.split(",")]
    log(f"starting kvpool serve {a.scenario}")
    served = start_serve(a.scenario, a.sets, work / "run")
    url = served.url
    results, records_by_load = [], {}
    try:
        # with the DSA indexer the first turn is longer than index_topk, so every turn's prefill and
        # decode select tokens
        first = max(600, config.index_topk + 64) if config.indexer_layers else 600
        session = correctness_session(url, s.model.name, s.serve.vocab, a.turns, first_tokens=first,
                                      grow_tokens=300, out_tokens=16, seed=s.seed)
        urls = engine_urls(served.run_dir)
        for n in loads:
            before, t0 = time_accounts(urls), time.monotonic()
            summary, records = replay(a.scenario, url, a.traces, n, a.duration, a.token_scale, work / f"load{n}", a.sets)
            summary["stack"] = stack_cost(before, time_accounts(urls), time.monotonic() - t0)
            summary["handoff_gb_s"] = handoff_gb_s(records)
            # every worker of the plan runs on these devices: throughput per physical GPU beside the
            # scenario's per-GPU figure (which counts the GPUs of its layout)
            summary["devices"] = len(set(s.serve.devices))
            summary["throughput_per_device_tok_s"] = summary["throughput_tok_s"] / summary["devices"]
            results.append(summary)
            records_by_load[n] = records
            log(f"{n} sessions: {summary['throughput_per_gpu_tok_s']:.0f} tok/s/GPU, TTFT p50 "
                f"{summary['ttft_p50_s']:.2f} s p90 {summary['ttft_p90_s']:.2f} s, gpu/pool/computed "
                f"{summary['share_gpu']:.2f}/{summary['share_pool']:.2f}/{summary['share_computed']:.2f}, "
                f"bottleneck {summary['stack']['bottleneck']} (stack cost {percent(summary['stack']['stack_cost'])})")
            for name, e in summary["stack"]["engines"].items():
                if "stage_calls" in e:
                    log_prefill_accounts(name, e)
    finally:
        status = served.stop()
    check = []
    for turn in session:
        want = reference_generate(config, turn["prompt"], len(turn["answer"]), s.decode.dcp, device=str(dev))
        r = turn["record"]
        check.append({"turn": turn["turn"], "prompt_tokens": len(turn["prompt"]), "equal": want == turn["answer"],
                      "gpu_tokens": r["gpu_tokens"], "pool_tokens": r["pool_tokens"],
                      "computed_tokens": r["computed_tokens"]})
    limits = copy_limits(dev)
    limits.update(peer_copy_limits(build_plan(s, work / "plan", router_port=0)))
    if "peer_copy_gb_s_median" in limits:
        for summary in results:
            summary["handoff_to_peer_copy"] = summary["handoff_gb_s"] / limits["peer_copy_gb_s_median"]
    top = loads[-1]
    bare = bare_forward(config, records_by_load[top], top, s.decode.max_seqs, s.decode.dcp, dev)
    doc = {"bench": "serve", "scenario": a.scenario, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%d"), "loads": loads, "duration_s": a.duration,
           "token_scale": str(Fraction(a.token_scale)), "traces": os.path.relpath(a.traces, ROOT),
           "sets": a.sets, "results": results, "gpu_correctness": {"all_equal": all(c["equal"] for c in check),
                                                                   "turns": check},
           "limits": limits, "bare_forward": bare, "serve_exit_status": status}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    emit(doc, a.out)


if __name__ == "__main__":
    main()
