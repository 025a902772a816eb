"""``kvpool scenario``: list, validate and show scenarios."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from kvpool.cli.common import SET_HELP, load_or_exit
from kvpool.scenario import builtin_names, load_scenario, summarize, to_toml

app = typer.Typer(help="List, validate and show deployment scenarios (TOML).", no_args_is_help=True, rich_markup_mode=None)


@app.command("list")
def list_() -> None:
    """List the built-in scenarios with their descriptions."""
    table = Table("name", "description")
    for name in builtin_names():
        table.add_row(name, load_scenario(name).description)
    Console().print(table)


@app.command()
def validate(
    file: str = typer.Argument(..., help="Scenario TOML file or built-in name."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Check a scenario; print 'ok' or one line per problem (field, value, what is allowed)."""
    s = load_or_exit(file, set_)
    typer.echo(f"ok: {s.name}")


def _fmt_bytes(n: float) -> str:
    for unit, div in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,.0f} B"


@app.command()
def show(
    name: str = typer.Argument(..., help="Built-in scenario name or TOML file."),
    json_: bool = typer.Option(False, "--json", help="Print one JSON object (keys in docs/scenario.md)."),
    toml_: bool = typer.Option(False, "--toml", help="Print the full scenario as TOML."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Show a scenario and what follows from it: KV sizes, GPU KV and pool capacity, handoff plan."""
    s = load_or_exit(name, set_)
    d = summarize(s)
    if json_:
        typer.echo(json.dumps({**d, "scenario": s.model_dump(mode="json")}, indent=2))
        return
    if toml_:
        typer.echo(to_toml(s))
        return
    from rich.markup import escape

    c = Console(highlight=False)
    if set_:
        # the description is text of the file as written; the tables below show the overridden values
        c.print(f"[bold]{escape(s.name)}[/bold] with " + ", ".join(f"--set {escape(x)}" for x in set_))
        c.print(f"  description as written, before those overrides: {escape(s.description)}")
    else:
        c.print(f"[bold]{escape(s.name)}[/bold] — {escape(s.description)}")
    t = Table("deployment", "", show_header=False)
    t.add_row("model", f"{s.model.name}: {s.model.layers} layers (+{s.model.mtp_layers} MTP), {s.model.record_bytes} B record")
    t.add_row("cluster", f"{s.cluster.servers} x {s.cluster.gpus_per_server} {s.gpu.name}, {s.cluster.numa_per_server} NUMA nodes each")
    t.add_row("prefill", f"{s.prefill.instances} x PP{s.prefill.pp} TP{s.prefill.tp}, stages {list(s.prefill.stage_layers)}")
    t.add_row("decode", f"{s.decode.instances} x TP{s.decode.tp} DCP{s.decode.dcp}")
    t.add_row("pool", f"{s.pool.mode}, {s.pool.parts} part(s), {s.pool.services_per_server} x {s.pool.gib_per_service:g} GiB per server, {s.pool.eviction_policy} at {s.pool.high_watermark:.0%} / {s.pool.evict_ratio:.0%}")
    t.add_row("workload", f"{s.workload.mode}, {s.workload.traces or 'synthetic ' + s.workload.preset}, {s.workload.duration_s:g} s")
    c.print(t)
    f = Table("what follows", "value")
    f.add_row("KV bytes per token", f"{d['kv_bytes_per_token']:,} B ({_fmt_bytes(d['kv_bytes_per_token'] * 100_000)} per 100K tokens)")
    f.add_row("KV bytes per token per stage", ", ".join(f"{b:,}" for b in d["kv_bytes_per_token_per_stage"]))
    f.add_row("chunk object per stage", ", ".join(_fmt_bytes(b) for b in d["chunk_object_bytes_per_stage"]) + f" ({d['chunk_tokens']} tokens)")
    f.add_row("prefill GPU KV (all prefill GPUs)", _fmt_bytes(d["prefill_gpu_kv_bytes"]))
    f.add_row("prefill GPU KV capacity per instance", f"{d['prefill_gpu_kv_capacity_tokens']:,} tokens")
    f.add_row("decode GPU KV capacity per instance", f"{d['decode_gpu_kv_capacity_tokens']:,} tokens")
    copies = d["pool_copies_per_token"]
    f.add_row("pool capacity", f"{_fmt_bytes(d['pool_capacity_bytes'])} = {d['pool_capacity_tokens']:,} tokens"
              + (f" ({copies} copies of each: one per TP rank)" if copies > 1 else ""))
    if d["pool_to_prefill_gpu_kv_ratio"] is not None:
        f.add_row("pool / prefill GPU KV", f"{d['pool_to_prefill_gpu_kv_ratio']:.2f}x")
    f.add_row("sessions of 10 GiB history in the pool", f"{d['pool_sessions_10gib']:.0f}")
    f.add_row(
        f"handoff of {d['handoff_tokens']:,} tokens, {d['handoff_stage_layers']}-layer stage",
        f"{d['handoff_writes_naive']:,} naive writes vs {d['handoff_writes_batched']} writes of <= {_fmt_bytes(d['handoff_max_write_bytes'])} ({d['handoff_bytes'] / 1e6:.1f} MB)",
    )
    c.print(f)
