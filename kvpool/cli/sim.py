"""``kvpool sim``: run the simulator on a scenario, one load or a sweep."""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvpool.cli.common import SET_HELP, UserError, load_or_exit
from kvpool.loads import parse_loads
from kvpool.errors import printable
from kvpool.outputs import atomic_path, output_dir, safe_name
from kvpool.run_inputs import run_overrides

app = typer.Typer(
    help="Run the simulator: single runs, sweeps over sessions or RPS, comparisons and capacity search.",
    no_args_is_help=True,
    rich_markup_mode=None,  # help texts are plain: a [...] in them is shown, not read as markup
)


MAX_WORKERS = 256


def check_load(s, load: float, flag: str) -> None:
    """A load given as one number (``sim plan --load``): valid for the scenario's load field."""
    from kvpool.scenario.fields import check

    if s.workload.mode == "agentx":
        check("workload.sessions", int(load) if math.isfinite(load) and load.is_integer() else load, flag)
    else:
        check("workload.rps", load, flag)


MAX_RESULT_BYTES = 256 << 20  # a result document is a few MiB; a larger file at its name is not one


def refuse_other_run(path: Path, run_id: str) -> None:
    """A result file of this name that holds another run's document (another ``id``) is not replaced;
    what is there is read up to ``MAX_RESULT_BYTES`` (a larger file, or one that does not parse, is
    another run's)."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_file():
        raise UserError(f"--out: {path} exists and is not a regular file; move it away or give another --out")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_RESULT_BYTES + 1)
        other = json.loads(data).get("id") if len(data) <= MAX_RESULT_BYTES else None
    except (OSError, ValueError, AttributeError, RecursionError):
        other = None
    if other != run_id:
        raise UserError(f"--out: {path} exists and holds another run's content (id {other!r}, this run {run_id}); "
                        "move it away or give another --out")


def check_workers(workers: int) -> None:
    if not 0 <= workers <= MAX_WORKERS:
        raise UserError(f"--workers {workers}: must be between 0 (one per core) and {MAX_WORKERS}")


EXECUTOR_HELP = ("Where the runs go: local (processes on this machine) or ray (tasks on a Ray cluster; "
                 "without --address a private local Ray runtime on 127.0.0.1 with --workers CPUs). "
                 "Results do not depend on it.")
ADDRESS_HELP = ("Ray cluster for --executor ray: HOST:PORT of the head (ray start --head), ray://HOST:PORT "
                "(Ray Client) or auto; its nodes need kvpool installed. Default: start a local runtime.")


@contextmanager
def executor_runner(executor: str, address: str | None, workers: int, console: Console, quiet: bool):
    """The one place the CLI turns --executor/--address/--workers into a ``sim.executor`` runner,
    with every problem (unknown executor, Ray missing, cluster unreachable) as one ``error:`` line."""
    from kvpool.sim.executor import ExecutorError, check, runner

    try:
        check(executor, address)
    except ExecutorError as e:
        raise UserError(str(e)) from None
    if executor == "ray" and not quiet:
        console.print(f"connecting to the Ray cluster at {address}" if address else
                      f"starting a local Ray runtime on 127.0.0.1 ({workers} CPUs)")
    try:
        with runner(executor, workers=workers, address=address) as r:
            yield r
    except ExecutorError as e:
        raise UserError(str(e)) from None


def prepare_workload(s, traces: str | None, console: Console) -> None:
    """Generate a scenario's synthetic workload here, once, before its runs (saying so), so that it is
    cached for every worker and for the next command."""
    from kvpool.sim.run import build_synthetic, cache_dir, synthetic_to_build

    if not synthetic_to_build(s, traces):
        return
    where = str(cache_dir())
    home = str(Path.home())
    if where.startswith(home + os.sep):
        where = "~" + where[len(home):]
    sessions = s.workload.synthetic_sessions
    console.print(f"building the {s.workload.preset} workload ({sessions} sessions), cached under {where} for next time")
    with _progress(console, disable=False) as progress:
        task = progress.add_task("building sessions", total=sessions)
        build_synthetic(s, on_session=lambda _k: progress.advance(task))


def warn(lines: list[str]) -> None:
    for line in lines:
        typer.echo(f"warning: {line}", err=True)


def title_of(prov: dict) -> str:
    """``mi355x-1p1d, synthetic agentx-062126 (40 sessions), 3600 s per load, --set a=b``, with every
    non-printable character (of a trace path or an override) escaped."""
    return printable(f"{prov['scenario']['name']}, {inputs_label(prov)}")


def inputs_label(prov: dict) -> str:
    """What a run was given besides its scenario: ``synthetic agentx-062126 (40 sessions), 3600 s per load, --set a=b``."""
    from kvpool.sim.provenance import workload_label

    text = f"{workload_label(prov['workload'])}, {prov['duration_s']:g} s per load"
    if prov.get("set"):
        text += ", " + " ".join(f"--set {x}" for x in prov["set"])
    return text


OUT_NAMES = ("File names end in a short hash of the run's inputs (scenario content, overrides, seed, "
             "workload, duration, loads, kvpool version), so runs of different inputs never overwrite "
             "each other and a rerun of the same inputs replaces its own files.")


@app.command()
def run(
    scenario: str = typer.Argument("mi355x-1p1d", help="Built-in scenario name or TOML file."),
    sessions: str = typer.Option(None, "--sessions", help="AgentX loads: concurrent sessions, e.g. 56,72,96,112."),
    rps: str = typer.Option(None, "--rps", help="Production-replay loads: requests per second, e.g. 0.6,0.8,1.0."),
    duration: float = typer.Option(None, "--duration", help="Measured window per load, seconds (default: the scenario's)."),
    traces: str = typer.Option(None, "--traces", help="Replay these traces (file, directory or traces.jsonl) instead of the scenario's workload."),
    seed: int = typer.Option(None, "--seed", help="Seed of every random choice (default: the scenario's)."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    workers: int = typer.Option(0, "--workers", help="Parallel processes (or local Ray CPUs) for a sweep (0: one per core, at most one per load)."),
    executor: str = typer.Option("local", "--executor", help=EXECUTOR_HELP),
    address: str = typer.Option(None, "--address", help=ADDRESS_HELP),
    out: Path = typer.Option(Path("out"), "--out", help="Directory for the JSON, CSV and PNG of the run. " + OUT_NAMES),
    json_: bool = typer.Option(False, "--json", help="Print the run's JSON document (id, provenance, results: one object per load, run; docs/metrics.md)."),
) -> None:
    """Simulate SCENARIO at one or more loads; print a summary, write JSON/CSV and a Figure-6-style PNG
    (out/NAME-sessions-LOADS-ID.*, ID a hash of the inputs)."""
    from kvpool.cli.sweep_progress import SweepBars
    from kvpool.sim import documents, report
    from kvpool.sim.run import load_key, sweep

    overrides = run_overrides(set_, duration=duration, seed=seed, sessions=sessions, rps=rps)
    s = load_or_exit(scenario, overrides)
    output_dir(out, create=False)
    if traces is not None and not os.path.exists(traces):
        raise UserError(f"--traces {traces}: no such file or directory")
    loads = parse_loads(sessions, "--sessions", True, "workload.sessions") or parse_loads(rps, "--rps", False, "workload.rps")
    check_workers(workers)
    if not loads:
        loads = [s.workload.sessions] if s.workload.mode == "agentx" else [s.workload.rps]
    n_workers = workers or min(len(loads), os.cpu_count() or 1)
    console = Console(stderr=True)
    key = load_key(s)
    from kvpool.workload.errors import TraceError

    try:
        with executor_runner(executor, address, n_workers, console, json_) as runner:  # a bad cluster before any build
            prepare_workload(s, traces, console)
            with SweepBars(console, f"simulating {s.name}", len(loads), disable=json_) as bars:
                rows = sweep(s, loads, traces=traces, runner=runner, **bars.sweep_callbacks("", key))
    except TraceError as e:
        raise UserError(str(e)) from None
    doc = documents.run_document(s, rows, documents.Inputs(scenario, tuple(set_), tuple(overrides), traces),
                                 documents.Execution("kvpool sim run", executor, n_workers))
    prov = doc["provenance"]
    stem = f"{safe_name(s.name)}-{key}-" + "-".join(f"{x:g}" for x in loads) + f"-{doc['id']}"
    output_dir(out)
    refuse_other_run(out / f"{stem}.json", doc["id"])
    warnings = doc.get("warnings", [])
    paths = report.write_files(rows, out, stem, document=doc, title=title_of(prov))
    if json_:
        typer.echo(json.dumps(doc, indent=2))
        warn(warnings)
        return
    screen = Console()
    screen.print(report.table(rows, title=title_of(prov), width=screen.width))
    screen.print(report.lane_table({s.name: rows}, width=screen.width))
    console.print("wrote " + ", ".join(str(p) for p in paths))
    warn(warnings)


def _progress(console: Console, disable: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console, transient=True, disable=disable)


@app.command()
def compare(
    scenarios: list[str] = typer.Argument(..., help="Two or more scenarios (names or TOML files); the first is the reference of the ratios."),
    sessions: str = typer.Option(None, "--sessions", help="AgentX loads, e.g. 56,72,96,112."),
    rps: str = typer.Option(None, "--rps", help="Production-replay loads, e.g. 0.6,0.8,1.0."),
    duration: float = typer.Option(None, "--duration", help="Measured window per load, seconds."),
    traces: str = typer.Option(None, "--traces", help="Replay these traces instead of each scenario's workload."),
    seed: int = typer.Option(None, "--seed", help="Seed of every random choice, for every arm (default: each scenario's)."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP + " Applied to every arm."),
    workers: int = typer.Option(0, "--workers", help="Parallel processes, or local Ray CPUs (0: one per core, at most one per load)."),
    executor: str = typer.Option("local", "--executor", help=EXECUTOR_HELP),
    address: str = typer.Option(None, "--address", help=ADDRESS_HELP),
    out: Path = typer.Option(Path("out"), "--out", help="Directory for the JSON, CSV and PNG. " + OUT_NAMES),
    json_: bool = typer.Option(False, "--json", help="Print the comparison's JSON document: {id, provenance: {arms: {NAME: provenance}}, arms: {NAME: [results]}, ratios: {reference, over: {NAME: [per load]}}, run} (docs/metrics.md); every ratio is the first arm's value over the other arm's."),
) -> None:
    """Run arms side by side at the same loads, such as shared vs split pool, and print the ratios: the
    first arm's value over each other arm's, as the seed states them (shared first: its throughput
    ratio above 1 means it is faster). Writes JSON, CSV and PNG (out/compare-A-vs-B-ID.*)."""
    from kvpool.cli.sweep_progress import SweepBars
    from kvpool.sim import compare as cmp
    from kvpool.sim import documents, report
    from kvpool.sim.run import load_key, sweep

    if len(scenarios) < 2:
        raise UserError("compare needs two or more scenarios")
    extra = run_overrides(set_, duration=duration, seed=seed, sessions=sessions, rps=rps)
    arms_s = [load_or_exit(name, extra) for name in scenarios]
    output_dir(out, create=False)
    names = [s.name for s in arms_s]
    if len(set(names)) != len(names):
        raise UserError(f"the arms need distinct scenario names, got {names}")
    loads = parse_loads(sessions, "--sessions", True, "workload.sessions") or parse_loads(rps, "--rps", False, "workload.rps")
    check_workers(workers)
    if not loads:
        first = arms_s[0].workload
        loads = [first.sessions] if first.mode == "agentx" else [first.rps]
    console = Console(stderr=True)
    arms: dict[str, list[dict]] = {}
    n_workers = workers or min(len(loads), os.cpu_count() or 1)
    from kvpool.workload.errors import TraceError

    try:
        with executor_runner(executor, address, n_workers, console, json_) as runner:  # a bad cluster before any build
            for s in arms_s:
                prepare_workload(s, traces, console)
            with SweepBars(console, "comparing " + " vs ".join(names), len(loads) * len(arms_s), disable=json_) as bars:
                for s in arms_s:
                    arms[s.name] = sweep(s, loads, traces=traces, runner=runner,
                                         **bars.sweep_callbacks(f"{s.name}: ", load_key(s)))
    except TraceError as e:
        raise UserError(str(e)) from None
    doc = documents.compare_document(arms_s, arms, [documents.Inputs(src, tuple(set_), tuple(extra), traces)
                                                    for src in scenarios],
                                     documents.Execution("kvpool sim compare", executor, n_workers))
    prov = doc["provenance"]
    warnings = doc.get("warnings", [])
    stem = "compare-" + safe_name("-vs-".join(names)) + f"-{doc['id']}"
    output_dir(out)
    refuse_other_run(out / f"{stem}.json", doc["id"])
    with atomic_path(out / f"{stem}.json") as tmp:
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
    with atomic_path(out / f"{stem}.csv") as tmp:
        cmp.write_csv(arms, tmp)
    title = printable(" vs ".join(names) + ", " + inputs_label(prov["arms"][names[0]]))
    with atomic_path(out / f"{stem}.png") as tmp:
        cmp.figure(arms, tmp, title=title)
    if json_:
        typer.echo(json.dumps(doc, indent=2))
        warn(warnings)
        return
    screen = Console()
    screen.print(cmp.ratio_table(arms, width=screen.width))
    screen.print(report.lane_table(arms, width=screen.width))
    console.print(f"wrote {out / (stem + '.json')}, {out / (stem + '.csv')}, {out / (stem + '.png')}")
    warn(warnings)


@app.command()
def plan(
    scenario: str = typer.Argument(..., help="Built-in scenario name or TOML file."),
    target: list[str] = typer.Option(..., "--target", help="METRIC>=VALUE (or <=, >, <), repeatable, e.g. reuse>=0.95 ttft_p90_s<=2.5."),
    vary: str = typer.Option(..., "--vary", help="section.field=LO..HI, e.g. pool.gib_per_service=64..768, cluster.servers=1..8 or workload.sessions=40..160."),
    load: float = typer.Option(None, "--load", help="Sessions (or RPS) of every run when the variable is not the load (default: the scenario's)."),
    duration: float = typer.Option(None, "--duration", help="Measured window per run, seconds."),
    traces: str = typer.Option(None, "--traces", help="Replay these traces instead of the scenario's workload."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    workers: int = typer.Option(2, "--workers", help="Points evaluated in parallel per round (processes, or local Ray CPUs)."),
    executor: str = typer.Option("local", "--executor", help=EXECUTOR_HELP.replace("Results do not", "The verdicts do not")),
    address: str = typer.Option(None, "--address", help=ADDRESS_HELP),
    max_runs: int = typer.Option(24, "--max-runs", help="Upper bound on simulator runs."),
    out: Path = typer.Option(Path("out"), "--out", help="Directory for the explored curve (JSON, PNG). " + OUT_NAMES),
    json_: bool = typer.Option(False, "--json", help="Print the result and the explored curve as JSON (with provenance and run blocks)."),
) -> None:
    """Capacity search: the smallest value of a field (or the largest load) meeting every target.
    Exits with status 1, naming the target that failed and where, when no value meets them all."""
    from kvpool.sim import documents
    from kvpool.sim import plan as pl

    overrides = run_overrides(set_, duration=duration)
    base = load_or_exit(scenario, overrides)
    output_dir(out, create=False)
    try:
        targets = [pl.parse_target(t) for t in target]
        variable = pl.parse_vary(vary, base)
    except pl.PlanError as e:
        raise UserError(str(e)) from None
    if load is not None:
        check_load(base, load, "--load")
    if not 1 <= workers <= MAX_WORKERS:
        raise UserError(f"--workers {workers}: must be between 1 and {MAX_WORKERS}")
    if not 2 <= max_runs <= 1000:
        raise UserError(f"--max-runs {max_runs}: must be between 2 and 1000")
    console = Console(stderr=True)
    from kvpool.workload.errors import TraceError

    try:
        with executor_runner(executor, address, max(1, workers), console, json_) as runner:  # a bad cluster first
            prepare_workload(base, traces, console)
            with _progress(console, json_) as progress:
                task = progress.add_task(f"searching {variable.field}", total=max_runs)
                res = pl.search(base, variable, targets, load=load, traces=traces, workers=workers, max_runs=max_runs,
                                runner=runner, on_run=lambda *_: progress.advance(task))
    except TraceError as e:
        raise UserError(str(e)) from None
    summary = documents.plan_document(
        base, res, documents.Inputs(scenario, tuple(set_), tuple(overrides), traces),
        documents.Execution("kvpool sim plan", executor, workers),
        documents.Search(vary, load, workers, max_runs))
    curve, failed = summary["curve"], summary.get("failed", [])
    stem = f"plan-{safe_name(base.name)}-{variable.field}-{summary['id']}"
    output_dir(out)
    refuse_other_run(out / f"{stem}.json", summary["id"])
    with atomic_path(out / f"{stem}.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    with atomic_path(out / f"{stem}.png") as tmp:
        _plan_figure(curve, targets, variable.field, tmp)
    none_line = (f"no value of {variable.field} in {variable.lo:g}..{with_unit(variable.field, variable.hi)} "
                 "meets every target")
    if json_:
        typer.echo(json.dumps(summary, indent=2))
        if failed:
            typer.echo(f"error: {none_line}: " + "; ".join(failed), err=True)
            raise typer.Exit(1)
        return
    from kvpool.tables import Col, fitted

    unit = unit_of(variable.field)
    cols = [Col(variable.field.replace(".", ".\n") + (f"\n({unit})" if unit else ""))]
    cols += [Col(tg.metric + (f"\n({unit_of(tg.metric)})" if unit_of(tg.metric) else "")) for tg in targets]
    cols += [Col("meets", "left")]
    cells = [[f"{row['value']:g}", *[f"{row[tg.metric]:.4g}" for tg in targets], "yes" if row["meets_targets"] else "no"]
             for row in curve]
    screen = Console()
    screen.print(fitted(cols, cells, screen.width,
                        title=f"{base.name}: {variable.field} ({summary['direction']}) for {', '.join(summary['targets'])}"))
    if failed:
        typer.echo(f"error: {none_line}:", err=True)
        for line in failed:
            typer.echo(f"  {line}", err=True)
        typer.echo(f"wrote {out / (stem + '.json')}, {out / (stem + '.png')}", err=True)
        raise typer.Exit(1)
    else:
        Console().print(f"[bold]best {variable.field} = {with_unit(variable.field, res.best)}[/] ({len(curve)} runs); "
                        f"wrote {out / (stem + '.json')}, {out / (stem + '.png')}", highlight=False)


#: Units by the end of a field's or metric's name (the project names carry their units).
_UNIT_SUFFIXES = (("_tok_s", "tok/s"), ("_tokens", "tokens"), ("_bytes", "bytes"), ("_ms", "ms"), ("_s", "s"))


def unit_of(field: str) -> str:
    """The unit of a scenario field or metric, from its name: ``pool.gib_per_service`` -> ``GiB``,
    ``workload.sessions`` -> ``sessions``, ``workload.rps`` -> ``requests/s``, ``ttft_p90_s`` -> ``s``."""
    name = field.rsplit(".", 1)[-1]
    if name.startswith("gib_") or name.endswith("_gib"):
        return "GiB"
    if name == "rps":
        return "requests/s"
    if name in ("sessions", "servers", "synthetic_sessions"):
        return name
    return next((u for suffix, u in _UNIT_SUFFIXES if name.endswith(suffix)), "")


def with_unit(field: str, value: float) -> str:
    """``350.815 GiB``, ``96 sessions``: the value as it is searched, and its unit."""
    unit = unit_of(field)
    return f"{value:g} {unit}" if unit else f"{value:g}"


def _plan_figure(curve: list[dict], targets, field: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(targets), figsize=(5 * len(targets), 3.6), squeeze=False)
    xs = [c["value"] for c in curve]
    for ax, tg in zip(axes[0], targets):
        ax.plot(xs, [c[tg.metric] for c in curve], "o-")
        for c in curve:
            ax.plot(c["value"], c[tg.metric], "o", color="#55a868" if c["meets_targets"] else "#c44e52")
        ax.axhline(tg.value, color="gray", ls="--")
        ax.set_xlabel(field + (f" ({unit_of(field)})" if unit_of(field) else ""))
        ax.set_ylabel(tg.metric)
        ax.set_title(str(tg))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
