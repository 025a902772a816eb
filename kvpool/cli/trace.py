"""``kvpool trace``: Agent-session traces: stats, synthetic generation, conversion.

* ``kvpool trace stats PATH [--json] [--skip-bad]``: statistics of a trace file/dir (keys in
  docs/traces.md).
* ``kvpool trace synth --preset NAME --sessions N --seed S --out PATH``: synthetic sessions in
  the Weka format (``.jsonl``/``.jsonl.gz``: one file; otherwise a directory of ``.json.gz``).
* ``kvpool trace convert SRC --to mooncake|weka --out PATH``: between Weka and Mooncake JSONL.

A bad trace prints ``error: <file>: trace <id>: <request>: <why>`` and exits with status 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer

from kvpool.cli.common import UserError
from kvpool.errors import printable

app = typer.Typer(help="Agent-session traces: stats, synthetic generation, conversion.", no_args_is_help=True, rich_markup_mode=None)


def _load(path: Path, skip_bad: bool, quiet: bool = False):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvpool.workload import TraceError, load_workload

    try:
        if quiet:
            w = load_workload(path, skip_bad=skip_bad)
        else:
            with Progress(
                TextColumn("loading traces"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                transient=True, disable=None,
            ) as bar:
                task = bar.add_task("load", total=None)
                w = load_workload(path, skip_bad=skip_bad, progress=lambda done, total: bar.update(task, completed=done, total=total))
    except TraceError as e:
        raise UserError(str(e)) from None
    for s in w.skipped:
        where = ": ".join(x for x in (s.file, s.trace_id and f"trace {s.trace_id}", s.request) if x)
        typer.echo(f"skipped: {printable(where)}: {printable(s.message)}", err=True)
    return w


_GROUPS = [
    ("Counts", ["traces", "requests", "main_requests", "subagent_requests", "subagent_groups",
                "sessions_with_subagents", "sessions_with_subagents_fraction", "subagent_groups_per_session_p50",
                "subagent_requests_per_group_p50", "dropped_subagents"]),
    ("Input tokens", ["input_tokens_all_p50", "input_tokens_all_mean", "input_tokens_main_p50", "input_tokens_main_p90",
                      "input_tokens_main_p99", "input_tokens_sub_p50", "input_tokens_sub_p90", "input_tokens_max"]),
    ("Output tokens", ["output_tokens_main_p50", "output_tokens_main_mean", "output_tokens_main_p90"]),
    ("Reuse (infinite prefix cache)", ["new_tokens_p50", "new_tokens_mean", "new_tokens_p99", "overlap_prev_main", "reuse_ceiling"]),
    ("Sessions", ["main_turns_per_session_p50", "main_turns_per_session_p90", "peak_context_p50", "peak_context_max"]),
    ("Pauses (main thread, end to start)", ["pause_p50_s", "pause_p90_s", "pause_p99_s", "pause_mean_s",
                                            "pause_over_300s_fraction", "pause_over_1800s_fraction",
                                            "think_time_p50_s", "api_time_p50_s"]),
]


_SHARES = ("overlap_prev_main", "reuse_ceiling")


def _fmt(key: str, v) -> str:
    """A statistic as the table shows it: shares in percent, times in seconds, counts and token
    numbers as integers when whole (a median of counts: "3", not "3.0000"), else one decimal."""
    if isinstance(v, float) and math.isnan(v):
        return "-"
    if key.endswith("_fraction") or key in _SHARES:
        return f"{v:.1%}"
    if key.endswith("_s"):
        return f"{v:,.2f} s" if abs(v) < 100 else f"{v:,.0f} s"
    if isinstance(v, int) or float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.1f}"


@app.command()
def stats(
    path: Path = typer.Argument(..., help="trace file (.json, .json.gz, .jsonl) or directory"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="leave malformed traces out (reported on stderr)"),
) -> None:
    """Statistics of a workload: sizes, reuse ceiling, pauses, sessions (see docs/traces.md)."""
    from kvpool.workload import workload_stats

    w = _load(path, skip_bad, quiet=as_json)
    st = workload_stats(w)
    if as_json:
        typer.echo(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in st.items()}, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"trace stats: {printable(str(path))}", show_header=True)
    table.add_column("statistic")
    table.add_column("value", justify="right")
    for title, keys in _GROUPS:
        table.add_section()
        table.add_row(f"[bold]{title}[/bold]", "")
        for k in keys:
            table.add_row(k, _fmt(k, st[k]))
    Console().print(table)


@app.command()
def synth(
    preset: str = typer.Option(..., "--preset", help="kv-cache-tester or agentx-062126"),
    sessions: int = typer.Option(..., "--sessions", min=1, help="number of sessions"),
    seed: int = typer.Option(0, "--seed", help="random seed (same seed, same output)"),
    out: Path = typer.Option(..., "--out", help=".jsonl/.jsonl.gz file, or a directory of .json.gz traces"),
    context_scale: float = typer.Option(
        1.0, "--context-scale", help="every prompt-side token count times this (workload.context_scale); outputs unchanged"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing --out file (a directory: its trace files)"),
) -> None:
    """Generate synthetic agent sessions in the Weka format. Every input is checked before anything
    is written; the file appears under its name only when complete."""
    from rich.progress import Progress

    from kvpool.outputs import atomic_path, check_path_length, output_dir, output_file, refuse_existing
    from kvpool.scenario.fields import check
    from kvpool.scenario.model import synthetic_size_error
    from kvpool.workload.presets import PRESETS
    from kvpool.workload.synth import generate_session, preset_params

    if preset not in PRESETS:
        raise UserError(f"unknown preset '{preset}'; choose one of: {', '.join(PRESETS)}")
    check("workload.synthetic_sessions", sessions, "--sessions")
    check("seed", seed, "--seed")
    check("workload.context_scale", context_scale, "--context-scale")
    if (why := synthetic_size_error(sessions, context_scale)) is not None:
        raise UserError(f"--sessions x --context-scale: {why}")
    params = preset_params(preset).with_context_scale(context_scale)
    from kvpool.workload.load import write_weka_jsonl
    from kvpool.workload.synth import write_weka_dir

    check_path_length(out, "--out")
    single = out.name.endswith((".jsonl", ".jsonl.gz"))
    if not single and out.name.endswith((".json", ".gz", ".json.gz")):
        raise UserError(f"--out {out}: a file name, but not .jsonl or .jsonl.gz; give a .jsonl/.jsonl.gz file, "
                        "or a directory name (without such a suffix) for one .json.gz per session")
    if single:
        output_file(out)
        refuse_existing(out, "--out", force)
    else:
        if out.exists() and out.is_dir() and any(out.iterdir()) and not force:
            raise UserError(f"--out {out}: the directory is not empty; give --force to write into it, or another name")
        output_dir(out)
    with Progress(transient=True, disable=None) as bar:
        task = bar.add_task("generating", total=sessions)

        def gen():
            for k in range(sessions):
                yield generate_session(params, seed=seed, index=k)
                bar.advance(task)

        if single:
            with atomic_path(out) as tmp:
                n = write_weka_jsonl(gen(), tmp)
        else:
            n = _write_dir_atomically(gen(), out, write_weka_dir)
    typer.echo(f"wrote {n} sessions ({preset}, seed {seed}) to {out}")


def _write_dir_atomically(docs, out: Path, write) -> int:
    """``write(docs, folder)`` into a temporary folder beside ``out``, then each file renamed into ``out``."""
    import os
    import shutil

    tmp = out.parent / f".{out.name[:150]}.{os.getpid()}.tmp"
    try:
        n = write(docs, tmp)
        for f in sorted(tmp.iterdir()):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return n


@app.command()
def convert(
    src: Path = typer.Argument(..., help="trace file or directory (Weka or Mooncake JSONL)"),
    to: str = typer.Option(..., "--to", help="mooncake or weka"),
    out: Path = typer.Option(..., "--out", help="output .jsonl (or .jsonl.gz) file"),
    stagger_s: float = typer.Option(0.0, "--stagger-s", min=0.0, help="to mooncake: start session k at k * this (at most 86400 s)"),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="leave malformed traces out"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing --out file"),
) -> None:
    """Convert between the Weka (AgentX) format and Mooncake JSONL (512-token blocks). The output
    appears under its name only when complete, and never replaces the source."""
    from kvpool.outputs import atomic_path, check_path_length, output_file, refuse_existing

    from kvpool.workload.load import write_jsonl_rows, write_weka_jsonl
    from kvpool.workload.mooncake import MOONCAKE_BLOCK_TOKENS, sessions_to_mooncake_rows, weka_to_mooncake_rows

    if to not in ("mooncake", "weka"):
        raise UserError(f"--to must be 'mooncake' or 'weka', got '{to}'")
    if not out.name.endswith((".jsonl", ".jsonl.gz")):
        raise UserError(f"--out must end in .jsonl or .jsonl.gz, got '{out}'")
    if not (math.isfinite(stagger_s) and 0 <= stagger_s <= 86_400):
        raise UserError(f"--stagger-s {stagger_s}: must be a finite number of seconds, >= 0 and <= 86400")
    check_path_length(out, "--out")
    check_path_length(src, "trace")
    if out.exists() and src.exists() and (out.resolve() == src.resolve() or src.is_dir() and src.resolve() in out.resolve().parents):
        raise UserError(f"--out {out}: is the source {src} (or inside it); give another file")
    output_file(out, create=False)
    refuse_existing(out, "--out", force)
    w = _load(src, skip_bad)
    output_file(out)
    if to == "mooncake":
        flat = all(s.hash_scope == "global" and s.block_tokens == MOONCAKE_BLOCK_TOKENS and len(s.requests) == 1 for s in w)
        try:
            rows = sessions_to_mooncake_rows(w) if flat else weka_to_mooncake_rows(w, stagger_s=stagger_s)
        except ValueError as e:
            raise UserError(str(e)) from None
        with atomic_path(out) as tmp:
            n = write_jsonl_rows(rows, tmp)
        typer.echo(f"wrote {n} Mooncake rows to {out}")
    else:
        with atomic_path(out) as tmp:
            n = write_weka_jsonl(w, tmp)
        typer.echo(f"wrote {n} Weka traces to {out}")
