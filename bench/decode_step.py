"""One decode step of the reference model: time and kernel launches per step, before and after.

For each batch size and context length: ``DecodeModel.step`` over a batch of sequences of that
context (every DCP rank on ``--device``, the scenario's model), timed over ``--reps`` steps after a
warm-up, and counted once: torch operator calls that run a kernel (views and allocations left out),
launches of ``kvpool.kernels.attention``'s Triton kernels, and on a GPU the kernels the profiler
sees. ``new`` is this checkout's ``DecodeModel``; ``baseline`` is ``backend/serve/decode_model.py``
of ``--baseline-rev`` (read with ``git show``), run on the same weights in the same process.

    .venv/bin/python bench/decode_step.py --device cpu --batches 1,8 --contexts 256 --layers 4
    .venv/bin/python bench/decode_step.py --device cuda:0 --batches 1,8,32 --contexts 1024,5779

Limits measured in the same run, per case: ``memory_floor_s``, the bytes a step must read at
least (every layer's weights and the output head once, each sequence's KV records of every layer)
over the read rate of a device copy (a 256 MiB copy reads and writes each byte, so half its
traffic), and ``launch_floor_s``, the step's kernel launches (profiled CUDA kernels on a GPU,
torch operators and Triton launches on the CPU) times the time one launch of a one-element add
takes; ``step_over_memory_floor`` and ``step_over_launch_floor`` are the step's median over each.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from device_timing import sync, times_s
from torch.utils._python_dispatch import TorchDispatchMode

from kvpool.backend.refmodel import RefModel
from kvpool.backend.serve import decode_model as new_impl
from kvpool.backend.serve.model_config import ref_config
from kvpool.kernels import attention
from kvpool.scenario.load import load_scenario

ROOT = Path(__file__).resolve().parent.parent
BASELINE_REV = "5ac563d"   # the decode step with per-head and per-sequence launches
_NO_KERNEL = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.lift_fresh.default",
              "aten._local_scalar_dense.default"}


class OpCounter(TorchDispatchMode):
    """Counts torch operator calls that run a kernel (not views, not bare allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.paused = False   # inside a Triton launch (the interpreter's own tensor copies)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if not self.paused and not func.is_view and str(func) not in _NO_KERNEL:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def load_baseline(rev: str) -> Any:
    """``backend/serve/decode_model.py`` at ``rev`` as a module."""
    src = subprocess.run(["git", "show", f"{rev}:backend/serve/decode_model.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "decode_model_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("decode_model_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def count_launches(step, seqs, dev: torch.device) -> dict:
    """Launches of one step: torch ops, Triton attention launches, and (GPU) profiled kernels."""
    triton_launches = [0]
    launch = attention._launch
    ops = OpCounter()

    def counting(*args, **kwargs):
        triton_launches[0] += 1
        ops.paused = True
        try:
            return launch(*args, **kwargs)
        finally:
            ops.paused = False

    attention._launch = counting
    try:
        with ops:
            step.step(seqs)
        out = {"torch_ops_per_step": ops.ops, "triton_launches_per_step": triton_launches[0]}
        if dev.type == "cuda":
            from torch.profiler import ProfilerActivity, profile
            sync(dev)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step.step(seqs)
                sync(dev)
            out["cuda_kernels_per_step"] = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    finally:
        attention._launch = launch
    return out


def run_case(impl: Any, name: str, model: RefModel, config, dcp: int, batch: int, ctx: int, dev: torch.device,
             reps: int, kwargs: dict) -> dict:
    P = config.page_tokens
    pages = max(new_impl.rank_pages(ctx + reps + 8, r, dcp, P) for r in range(dcp))
    kv = impl.DcpCaches(config, dcp, pages * batch, [dev])
    tables = [[torch.arange(b * pages, (b + 1) * pages, device=dev) for _ in range(dcp)] for b in range(batch)]
    step = impl.DecodeModel(model, kv, [dev], **kwargs)
    seqs = [impl.DecodeSeq(1 + b, ctx, t, [x.tolist() for x in t]) for b, t in enumerate(tables)]
    step.step(seqs)            # warm-up (compiles the kernels)
    counts = count_launches(step, seqs, dev)
    times = times_s(lambda: step.step(seqs), (dev,), reps)
    return {"impl": name, "batch": batch, "context_tokens": ctx, "step_s": statistics.median(times),
            "step_s_min": min(times), **counts}


def copy_read_bytes_per_s(dev: torch.device, nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Bytes per second a device copy reads (best of ``reps``; it also writes as many)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return nbytes / min(times_s(lambda: b.copy_(a), (dev,), reps))


def launch_s(dev: torch.device, launches: int = 2000) -> float:
    """Seconds per launch of a one-element add (launched back to back, synchronised at the end)."""
    x = torch.zeros(1, device=dev)
    for _ in range(10):
        x.add_(1)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(launches):
        x.add_(1)
    sync(dev)
    return (time.perf_counter() - t0) / launches


def weight_bytes(model: RefModel) -> int:
    """Bytes of every layer's weights and the output head (what a step reads at least once)."""
    tensors = [t for layer in model.layers for t in layer.values()] + [model.lm_head, model.ln_f]
    return sum(t.numel() * t.element_size() for t in tensors)


def with_floors(case: dict, config, weights_bytes: int, read_bytes_per_s: float, per_launch_s: float) -> dict:
    """``case`` with its memory and launch floors (see the module docstring)."""
    kv_bytes = case["batch"] * case["context_tokens"] * config.layers * config.record_bytes
    launches = case.get("cuda_kernels_per_step", case["torch_ops_per_step"] + case["triton_launches_per_step"])
    memory_floor_s = (weights_bytes + kv_bytes) / read_bytes_per_s
    launch_floor_s = launches * per_launch_s
    return {**case, "bytes_read_floor": weights_bytes + kv_bytes, "memory_floor_s": memory_floor_s,
            "launch_floor_s": launch_floor_s, "step_over_memory_floor": case["step_s"] / memory_floor_s,
            "step_over_launch_floor": case["step_s"] / launch_floor_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="h200-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="256,1024", help="context tokens per sequence, comma-separated")
    ap.add_argument("--layers", type=int, default=0, help="override the model's layer count (0: the scenario's); the indexer keeps its layers below it")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--attention", default="auto", choices=new_impl.ATTENTION_BACKENDS,
                    help="the new DecodeModel's attention backend")
    ap.add_argument("--baseline-rev", default=BASELINE_REV, help="git revision of the baseline ('' for none)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads on the CPU (0: torch's default)")
    a = ap.parse_args()
    try:
        batches = [int(b) for b in a.batches.split(",")]
        contexts = [int(c) for c in a.contexts.split(",")]
    except ValueError:
        sys.exit(f"error: --batches and --contexts take comma-separated integers, got {a.batches!r}, {a.contexts!r}")
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    scenario = load_scenario(a.scenario)
    config = ref_config(scenario)
    if a.layers:  # the indexer stays on those of its layers the shorter model has
        config = replace(config, stage_layers=(a.layers,),
                         indexer_layers=tuple(k for k in config.indexer_layers if k < a.layers))
    dcp = scenario.decode.dcp
    model = RefModel(config, dev)
    impls = [("new", new_impl, {"attention": a.attention})]
    if a.baseline_rev:
        # after the new one: under Triton's interpreter (the CPU with --attention triton) a kernel
        # first interpreted after the baseline's step fails to run; the other order works
        impls.append(("baseline", load_baseline(a.baseline_rev), {}))
    read_bytes_per_s, per_launch_s, weights = copy_read_bytes_per_s(dev), launch_s(dev), weight_bytes(model)
    results = []
    for ctx in contexts:
        for batch in batches:
            for name, impl, kwargs in impls:
                case = run_case(impl, name, model, config, dcp, batch, ctx, dev, a.reps, kwargs)
                results.append(with_floors(case, config, weights, read_bytes_per_s, per_launch_s))
                print(json.dumps(results[-1]), file=sys.stderr)
    speedups = []
    for r in results:
        base = [b for b in results if b["impl"] == "baseline" and (b["batch"], b["context_tokens"]) ==
                (r["batch"], r["context_tokens"])]
        if r["impl"] == "new" and base:
            b = base[0]
            speedups.append({"batch": r["batch"], "context_tokens": r["context_tokens"],
                             "step_speedup": b["step_s"] / r["step_s"],
                             "torch_ops_ratio": b["torch_ops_per_step"] / max(1, r["torch_ops_per_step"] +
                                                                               r["triton_launches_per_step"]),
                             **({"cuda_kernels_ratio": b["cuda_kernels_per_step"] / r["cuda_kernels_per_step"]}
                                if "cuda_kernels_per_step" in r else {})})
    print(json.dumps({"bench": "decode_step", "scenario": a.scenario, "device": a.device,
                      "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                      "layers": config.layers, "d_model": config.d_model, "heads": config.heads, "dcp": dcp,
                      "cache_dtype": str(config.cache_dtype), "attention": a.attention,
                      "baseline_rev": a.baseline_rev,
                      "limits": {"copy_read_gb_s": read_bytes_per_s / 1e9, "launch_us": per_launch_s * 1e6,
                                 "weights_bytes": weights},
                      "results": results, "speedups": speedups}, indent=1))


if __name__ == "__main__":
    main()
