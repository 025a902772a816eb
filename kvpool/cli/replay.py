"""``kvpool replay``: drive a running server (``kvpool serve``) with the simulator's replay schedule.

``kvpool replay --url URL [SCENARIO] [--traces PATH] [--sessions N | --rps R] [--duration S]
[--seed S] [--set ...] [--token-scale F] [--timeout S] [--out DIR] [--json]``

The schedule is the one ``kvpool sim run`` replays (``sim.run.make_replay``: AgentX lanes with
warm-up, capped waits, subagent spawn and join; or production replay), in wall-clock time; each
request is a streamed ``POST /v1/completions`` of token ids (``backend.serve.replay_client``,
prompts from the traces' hash ids: ``backend.serve.prompts``). Outputs, in ``--out``:
``replay-NAME-LOADKEY-LOAD-ID.jsonl`` (one ``RequestRecord`` per request plus ``error``) and
``replay-NAME-LOADKEY-LOAD-ID.json`` (``{id, provenance, results: [one summary], run}``, the
summary with the keys of ``kvpool sim run --json``'s results plus ``wall_s`` and ``errors``).
Ctrl-C stops the replay, cancels what is in flight and writes what it has (exit status 130).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
from fractions import Fraction
from pathlib import Path
from urllib.parse import urlsplit

import typer

from kvpool.cli.common import SET_HELP, UserError, load_or_exit

TOKEN_SCALE_HELP = (
    "Scale the prompts to a small model: every recorded hash block of B tokens becomes "
    "b = max(1, round(B * F)) tokens, and a prompt of N tokens becomes max(1, round(N * b / B)) tokens, rounding halves up; "
    "output lengths are kept. A number or a fraction, e.g. 1/64; it sets workload.token_scale, which kvpool sim run "
    "applies alike (default: the scenario's workload.token_scale, 1: as recorded).")


def parse_token_scale(text: str) -> float:
    """``"1/64"`` or ``"0.015625"`` -> the factor; a ``UserError`` naming ``--token-scale`` otherwise."""
    try:
        value = float(Fraction(text.strip())) if "/" in text else float(text)
    except (ValueError, ZeroDivisionError):
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 1):
        raise UserError(f"--token-scale {text!r}: must be a number or fraction > 0 and <= 1, e.g. 1/64")
    return value


def check_url(url: str) -> str:
    """``url`` without a trailing slash when it is ``http(s)://HOST[:PORT]``; a ``UserError`` otherwise."""
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        parts, port_ok = None, False
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
            or parts.query or parts.fragment:
        raise UserError(f"--url {url!r}: expected http://HOST:PORT of a running server, e.g. http://127.0.0.1:8000")
    return url.rstrip("/")


def _summary(s, load_key: str, load: float, result, cutoff_s: float | None) -> dict:
    from kvpool.sim.report import public
    from kvpool.workload.records import summarize

    gpus = s.prefill.instances * s.prefill.gpus + s.decode.instances * s.decode.gpus
    row = {"scenario": s.name, load_key: int(load) if load_key == "sessions" else float(load),
           "duration_s": s.workload.duration_s, **summarize(result.records, gpus=gpus, cutoff_s=cutoff_s),
           "wall_s": result.wall_s}
    return {**public(row), "wall_s": result.wall_s, "errors": result.errors}


async def _replay_main(replay, url: str, prompts, timeout_s: float, grace_s: float, on_update):
    from kvpool.backend.serve.replay_client import ReplayError, check_server, run_replay

    try:
        model = await check_server(url)
    except ReplayError as e:
        raise UserError(f"--url {url}: {e}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
    try:
        return await run_replay(replay, url=url, prompts=prompts, model=model, request_timeout_s=timeout_s,
                                grace_s=grace_s, on_update=on_update, stop=stop)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)


def replay(
    scenario: str = typer.Argument("cpu-tiny", help="Built-in scenario name or TOML file: the one the server runs."),
    url: str = typer.Option(..., "--url", help="The server, e.g. http://127.0.0.1:8000 (kvpool serve's router)."),
    traces: str = typer.Option(None, "--traces", help="Replay these traces (file, directory or traces.jsonl) instead of the scenario's workload."),
    sessions: int = typer.Option(None, "--sessions", help="AgentX lanes (concurrent session trees; default: the scenario's)."),
    rps: float = typer.Option(None, "--rps", help="Production replay at this many requests per second."),
    duration: float = typer.Option(None, "--duration", help="Measured window, seconds (default: the scenario's)."),
    seed: int = typer.Option(None, "--seed", help="Seed of every random choice of the schedule (default: the scenario's)."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    token_scale: str = typer.Option(None, "--token-scale", help=TOKEN_SCALE_HELP),
    timeout: float = typer.Option(None, "--timeout", help="Longest one request may take, seconds (default: serve.request_timeout_s + 30)."),
    out: Path = typer.Option(Path("out"), "--out", help="Directory for the JSONL of requests and the JSON summary."),
    json_: bool = typer.Option(False, "--json", help="Print the summary document (id, provenance, results, run)."),
) -> None:
    """Replay agent sessions against a running server (kvpool serve) with the simulator's schedule;
    write one record per request (JSONL) and a summary with the keys of kvpool sim run --json."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvpool.backend.serve.prompts import PromptBuilder
    from kvpool.cli.sim import prepare_workload, refuse_other_run, run_overrides
    from kvpool.outputs import atomic_path, output_dir, safe_name
    from kvpool.scenario.fields import check
    from kvpool.sim.provenance import provenance, short_id
    from kvpool.sim.run import load_key as load_key_of
    from kvpool.sim.run import make_replay, workload_for
    from kvpool.workload.errors import TraceError

    url = check_url(url)
    scale = None if token_scale is None else parse_token_scale(token_scale)
    if sessions is not None:
        check("workload.sessions", sessions, "--sessions")
    if rps is not None:
        check("workload.rps", rps, "--rps")
    overrides = run_overrides(set_, duration=duration, seed=seed,
                              sessions=None if sessions is None else str(sessions), rps=None if rps is None else str(rps))
    if scale is not None:
        overrides.append(f"workload.token_scale={scale!r}")
    s = load_or_exit(scenario, overrides)
    if timeout is not None and not (math.isfinite(timeout) and 0 < timeout <= 86_400):
        raise UserError(f"--timeout {timeout:g}: must be > 0 and <= 86400 seconds")
    timeout_s = timeout if timeout is not None else s.serve.request_timeout_s + 30.0
    if traces is not None and not os.path.exists(traces):
        raise UserError(f"--traces {traces}: no such file or directory")
    output_dir(out)
    key = load_key_of(s)
    load = (sessions if sessions is not None else s.workload.sessions) if key == "sessions" else \
        (rps if rps is not None else s.workload.rps)
    console = Console(stderr=True)
    try:
        prepare_workload(s, traces, console)
        workload = workload_for(s, traces)
        schedule = make_replay(s, workload, load)
    except TraceError as e:
        raise UserError(str(e)) from None
    prompts = PromptBuilder(s.serve.vocab)  # the workload's sessions are scaled already (workload_for)
    prov = provenance(s, source=scenario, overrides=overrides, set_overrides=set_, traces=traces, load_key=key,
                      loads=[load])
    prov["serve"] = {"url": url, "token_scale": s.workload.token_scale}
    run_id = short_id(prov)
    stem = f"replay-{safe_name(s.name)}-{key}-{load:g}-{run_id}"
    refuse_other_run(out / f"{stem}.json", run_id)
    with Progress(TextColumn("[bold]replaying[/] " + s.name), BarColumn(),
                  TextColumn("{task.completed}/{task.total} done, {task.fields[errors]} errors"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("replay", total=0, errors=0)

        def on_update(done: int, dispatched: int, errors: int) -> None:
            progress.update(task, completed=done, total=dispatched, errors=errors)

        result = asyncio.run(_replay_main(schedule, url, prompts, timeout_s, s.workload.grace_s, on_update))
    summary = _summary(s, key, load, result, result.window_end_s)
    doc = {"id": run_id, "provenance": prov, "results": [summary],
           "run": {"url": url, "wall_s": result.wall_s, "dispatched": len(result.outcomes), "errors": result.errors,
                   "cancelled": result.cancelled, "interrupted": result.interrupted}}
    jsonl, js = out / f"{stem}.jsonl", out / f"{stem}.json"
    with atomic_path(jsonl) as tmp, tmp.open("w", encoding="utf-8") as f:
        for o in result.outcomes:
            f.write(json.dumps(o.as_dict(), separators=(",", ":")) + "\n")
    with atomic_path(js) as tmp:
        tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    if json_:
        typer.echo(json.dumps(doc, indent=2))
    else:
        from kvpool.cli.sim import inputs_label
        from kvpool.sim.report import table

        screen = Console()
        screen.print(table([summary], title=f"replay of {s.name} at {url}, {inputs_label(prov)}", width=screen.width))
        console.print(f"wrote {jsonl}, {js}")
    if result.errors:
        typer.echo(f"warning: {result.errors} of {len(result.outcomes)} requests failed (the JSONL's error field says why)",
                   err=True)
    if result.interrupted:
        typer.echo("interrupted: the replay stopped early; the outputs hold what it had", err=True)
        raise typer.Exit(130)
