"""``kvpool serve``: production mode. One supervisor starts the scenario's prefill and decode engines
(``kvpool.backend.serve``), runs the OpenAI-compatible router on 127.0.0.1:PORT, and stops everything
on SIGTERM or Ctrl-C (docs/serve.md)."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

import typer

from kvpool.cli.common import SET_HELP, UserError, load_or_exit
from kvpool.errors import printable
from kvpool.outputs import output_dir

DEVICE = re.compile(r"^(cpu|cuda(:[0-9]{1,3})?)$")
ON_WORKER_EXIT = ("shutdown", "restart")


def parse_devices(text: str | None) -> tuple[str, ...] | None:
    """``--devices cpu,cuda:0,...`` as a tuple (``None``: the scenario's ``serve.devices``)."""
    if text is None:
        return None
    devs = tuple(d.strip() for d in text.split(","))
    bad = [d for d in devs if not DEVICE.match(d)]
    if bad or not devs:
        raise UserError(f"--devices {text}: {bad[0] if bad else text!r} is not a device; allowed: cpu, cuda, cuda:N "
                        "(comma-separated)")
    return devs


def check_devices(devs: tuple[str, ...], label: str) -> None:
    """A ``UserError`` naming ``label`` when a CUDA device of ``devs`` is not on this machine (checked
    before any worker starts, so a typo is one line, not a worker's traceback)."""
    cuda = [d for d in devs if d.startswith("cuda")]
    if not cuda:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for d in cuda:
        index = int(d.partition(":")[2] or 0)
        if index >= count:
            have = f"CUDA devices cuda:0..cuda:{count - 1}" if count else "no CUDA device torch can use"
            raise UserError(f"{label} {','.join(devs)}: {d} is not on this machine, which has {have}")


def physical_memory_bytes() -> int:
    """This machine's physical memory, bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(label: str, s, config, devs: tuple[str, ...]) -> None:
    """A ``UserError`` when the reference model's weights (built on the CPU whatever the devices), with
    every worker's paged KV when all workers are on the CPU, exceed this machine's physical memory."""
    memory_bytes = physical_memory_bytes()
    have = f"more than the {memory_bytes / 2**30:,.1f} GiB of memory of this machine"
    kv_bytes = 0
    if all(d == "cpu" for d in devs):
        token_bytes = config.bytes_per_token
        kv_bytes = token_bytes * (s.prefill.instances * s.serve.prefill_kv_tokens
                                  + s.decode.instances * s.serve.decode_kv_tokens)
    if kv_bytes + config.weight_bytes <= memory_bytes:
        return
    if kv_bytes > config.weight_bytes:
        raise UserError(f"{label}: the workers' paged KV takes {kv_bytes / 2**30:,.1f} GiB (serve.prefill_kv_tokens "
                        f"{s.serve.prefill_kv_tokens} x {s.prefill.instances} prefill, serve.decode_kv_tokens "
                        f"{s.serve.decode_kv_tokens} x {s.decode.instances} decode, {token_bytes} B per token), "
                        f"with the weights {have}")
    raise UserError(f"{label}: the reference model's weights take {config.weight_bytes / 2**30:,.1f} GiB "
                    f"(serve.d_model {s.serve.d_model}, serve.ffn_dim {s.serve.ffn_dim}, serve.vocab {s.serve.vocab}, "
                    f"serve.heads {s.serve.heads}, {config.layers} layers), {have}")


def fresh_run_dir(name: str, root: Path = Path("out/serve")) -> Path:
    """A new directory under ``root`` for one serve run's plan, ready files and logs."""
    from kvpool.outputs import safe_name

    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{safe_name(name)}-", dir=root))


def serve(
    scenario: str = typer.Argument("cpu-tiny", help="Built-in scenario name or TOML file (cpu-tiny: every worker on the CPU)."),
    port: int = typer.Option(8000, "--port", help="Port of the router on 127.0.0.1 (0: any free port)."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    devices: str = typer.Option(None, "--devices", help="Torch devices the workers take in order, e.g. cpu or cuda:0,cuda:1 (default: serve.devices)."),
    run_dir: Path = typer.Option(None, "--run-dir", help="Directory for the plan, ready files and logs: a new or empty one (default: a new one under out/serve/)."),
    pool: str = typer.Option(None, "--pool", help="embedded (an in-process pool per prefill stage) or mooncake (starts a Mooncake master and store services; default: serve.pool)."),
    pool_address: str = typer.Option(None, "--pool-address", help="Join the Mooncake pool at this address (mooncake://HOST:PORT, from kvpool pool up) instead of starting one; implies --pool mooncake."),
    on_worker_exit: str = typer.Option("shutdown", "--on-worker-exit", help="What a worker's exit while serving does: shutdown (stop everything, exit status 1)."),
) -> None:
    """Serve SCENARIO: start its prefill and decode engines and an OpenAI-compatible router on
    http://127.0.0.1:PORT (POST /v1/completions, GET /v1/models, /health, /metrics); SIGTERM or
    Ctrl-C drains in-flight requests for serve.drain_s, then stops every process."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port}: expected 0-65535")
    if on_worker_exit not in ON_WORKER_EXIT:
        raise UserError(f"--on-worker-exit {on_worker_exit}: allowed: {', '.join(ON_WORKER_EXIT)}")
    if on_worker_exit == "restart":
        raise UserError("--on-worker-exit restart: not supported yet (a restarted engine's peers would have to "
                        "reconnect to it); use shutdown")
    devs = parse_devices(devices)
    if pool is not None and pool not in ("embedded", "mooncake"):
        raise UserError(f"--pool {pool}: allowed: embedded, mooncake")
    if pool_address is not None and pool == "embedded":
        raise UserError("--pool-address joins a Mooncake pool: it cannot go with --pool embedded")
    if pool_address is not None or pool is not None:
        set_ = [*set_, f'serve.pool="{"mooncake" if pool_address is not None else pool}"']
    s = load_or_exit(scenario, set_)
    from kvpool.backend.serve.model_config import ServeConfigError, ref_config

    try:
        config = ref_config(s)
    except ServeConfigError as e:
        raise UserError(f"{scenario}: the reference model cannot serve it: {e}") from None
    check_memory(scenario, s, config, devs or s.serve.devices)
    from kvpool.backend.serve.pool_setup import ServePoolError
    from kvpool.backend.serve.supervisor import PortError, StartError, run

    check_devices(devs if devs is not None else s.serve.devices, "--devices" if devs is not None else "serve.devices")
    if run_dir is not None:
        output_dir(run_dir, "--run-dir", create=False)
        held = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
        if held:
            raise UserError(f"--run-dir {printable(str(run_dir))}: not empty ({len(held)} entries, e.g. "
                            f"{printable(held[0])}); serve writes its plan, ready files and logs there: give a new "
                            "or empty directory")
    where = output_dir(run_dir, "--run-dir") if run_dir is not None else fresh_run_dir(s.name)
    try:
        status = run(s, port=port, run_dir=where, devices=devs, pool_address=pool_address)
    except (PortError, ServePoolError) as e:
        raise UserError(str(e)) from None
    except StartError as e:
        lines = str(e).splitlines()
        typer.echo(f"error: {lines[0]}", err=True)
        for line in lines[1:]:
            typer.echo(line, err=True)
        sys.exit(1)
    raise typer.Exit(status)
