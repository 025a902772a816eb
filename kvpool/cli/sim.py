"""``kvpool sim``: run the simulator on a scenario, one load or a sweep."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvpool.cli.common import SET_HELP, UserError, load_or_exit

app = typer.Typer(
    help="Run the simulator: single runs, sweeps over sessions or RPS, comparisons and capacity search.",
    no_args_is_help=True,
)


def parse_loads(text: str | None, flag: str, integer: bool) -> list[float]:
    """``56,72,96`` -> [56, 72, 96]; every value positive."""
    if text is None:
        return []
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            v = int(part) if integer else float(part)
        except ValueError:
            raise UserError(f"{flag} {text!r}: {part!r} is not a{'n integer' if integer else ' number'}; "
                            f"give a comma-separated list such as {'56,72,96,112' if integer else '0.6,0.8,1.0'}") from None
        if v <= 0:
            raise UserError(f"{flag} {text!r}: every value must be > 0, got {part}")
        out.append(v)
    return out


@app.command()
def run(
    scenario: str = typer.Argument("mi355x-1p1d", help="Built-in scenario name or TOML file."),
    sessions: str = typer.Option(None, "--sessions", help="AgentX loads: concurrent sessions, e.g. 56,72,96,112."),
    rps: str = typer.Option(None, "--rps", help="Production-replay loads: requests per second, e.g. 0.6,0.8,1.0."),
    duration: float = typer.Option(None, "--duration", help="Measured window per load, seconds (default: the scenario's)."),
    traces: str = typer.Option(None, "--traces", help="Replay these traces (file, directory or traces.jsonl) instead of the scenario's workload."),
    seed: int = typer.Option(None, "--seed", help="Seed of every random choice (default: the scenario's)."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    workers: int = typer.Option(0, "--workers", help="Parallel processes for a sweep (0: one per core, at most one per load)."),
    executor: str = typer.Option("local", "--executor", help="local (processes on this machine) or ray."),
    address: str = typer.Option(None, "--address", help="Ray cluster address for --executor ray."),
    out: Path = typer.Option(Path("out"), "--out", help="Directory for the JSON, CSV and PNG of the run."),
    json_: bool = typer.Option(False, "--json", help="Print one JSON list (one object per load; keys in docs/metrics.md)."),
) -> None:
    """Simulate SCENARIO at one or more loads; print a summary, write JSON/CSV and a Figure-6-style PNG."""
    from kvpool.sim import report
    from kvpool.sim.run import load_key, sweep

    extra = list(set_)
    if duration is not None:
        if duration <= 0:
            raise UserError(f"--duration {duration:g}: must be > 0 seconds")
        extra.append(f"workload.duration_s={duration}")
    if seed is not None:
        extra.append(f"seed={seed}")
    if sessions is not None and rps is not None:
        raise UserError("give --sessions (AgentX lanes) or --rps (production replay), not both")
    if sessions is not None:
        extra.append('workload.mode="agentx"')
    if rps is not None:
        extra.append('workload.mode="replay"')
    s = load_or_exit(scenario, extra)
    if traces is not None and not os.path.exists(traces):
        raise UserError(f"--traces {traces}: no such file or directory")
    loads = parse_loads(sessions, "--sessions", True) or parse_loads(rps, "--rps", False)
    if not loads:
        loads = [s.workload.sessions] if s.workload.mode == "agentx" else [s.workload.rps]
    if executor not in ("local", "ray"):
        raise UserError(f"--executor {executor!r}: allowed: local, ray")
    if executor == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise UserError("--executor ray needs Ray: pip install 'ray[default]'") from None
    n_workers = workers or min(len(loads), os.cpu_count() or 1)
    console = Console(stderr=True)
    key = load_key(s)
    from kvpool.sim.workload.errors import TraceError

    try:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} loads"),
                      TimeElapsedColumn(), console=console, transient=True, disable=json_) as progress:
            task = progress.add_task(f"simulating {s.name}", total=len(loads))
            rows = sweep(s, loads, traces=traces, workers=n_workers, executor=executor, address=address,
                         on_done=lambda load, _r: progress.advance(task))
    except TraceError as e:
        raise UserError(str(e)) from None
    stem = f"{s.name}-{key}-" + "-".join(f"{x:g}" for x in loads)
    paths = report.write_files(rows, out, stem)
    if json_:
        typer.echo(json.dumps([report.public(r) for r in rows], indent=2))
        return
    wide = Console(width=max(Console().width, 150))
    wide.print(report.table(rows, title=f"{s.name}: {s.workload.mode}, {s.workload.duration_s:g} s per load"))
    console.print("wrote " + ", ".join(str(p) for p in paths))
