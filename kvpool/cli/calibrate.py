"""``kvpool calibrate``: measure a production-mode server's cost curves and write a calibration file.

``kvpool calibrate [SCENARIO] [--url URL [--run-dir DIR]] [--set ...] [--out FILE] [--seed S]
[--replay-traces PATH [--replay-sessions N] [--replay-duration S]]``
``kvpool calibrate --refit FILE [--out FILE]``

With ``--url``: the running ``kvpool serve`` there, which must run SCENARIO (its model, KV sizes
and step budget choose the grid). Without: ``kvpool serve SCENARIO --port 0`` is started in a new
run directory under ``out/calibrate/`` (``backend.serve.launch.start_serve``), measured and stopped. The measurement is
``backend.serve.calibrate.measure`` (a progress bar counts its requests); the file is
``sim.calibration``'s format (``docs/fidelity.md``): ``format``, ``version``, ``kvpool_version``,
``created_utc``, ``device``, ``scenario`` (name and SHA-256), ``model`` (the served model's
configuration), ``grid``, the curves (``prefill``, ``decode``, ``restore``, ``handoff``, ``save``),
``sharing`` (how workers on one device slow one another) and ``overheads``. A scenario uses it
with ``--set cost.calibration="FILE"``.

With ``--replay-traces PATH``: a last phase replays PATH's traces against the server (AgentX,
``--replay-sessions`` lanes for ``--replay-duration`` seconds, no grace; the workload's other
settings, e.g. ``workload.token_scale``, from ``--set``) and reads the engines' time accounts
(``backend.serve.calibrate_replay``; the engines' URLs come from the server's run directory:
``--run-dir`` with ``--url``); ``sim.replay_fit`` then scales the prefill grid
(``prefill.replay_scale``) so that the simulator replaying the same traces spends what the real
stages spent per computed token. The file's ``replay`` section records the trace files (name and
SHA-256), the accounts and the fit. PATH must not hold traces the file is then asked to predict.

With ``--refit FILE``: no server; FILE's fitted curves (restore, hand-off, save, decode and the
overheads that follow) are recomputed from its samples by this kvpool's fits
(``backend.serve.calibrate.refit``) and written to ``--out`` (default: FILE with ``.refit.json``
in place of ``.json``), stamped ``refitted_utc``. A version 3 file's ``prefill.replay_scale`` and
``replay`` section stay as measured (the fit needs the traces and the scenario, not in the file).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import time
from pathlib import Path

import typer

from kvpool.cli.common import SET_HELP, UserError, load_or_exit

SERVE_READY_S = 600.0
REPLAY_SESSIONS = 8
REPLAY_DURATION_S = 40.0


def _device_name(s) -> str:
    devs = sorted(set(s.serve.devices))
    if any(d.startswith("cuda") for d in devs):
        try:
            import torch

            return torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001 - no torch or no device here: name what the scenario says
            return ",".join(devs)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _write_json(path: Path, doc: dict) -> None:
    """``doc`` as strict JSON (no Infinity or NaN), written atomically."""
    from kvpool.outputs import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n", encoding="utf-8")


def _transfer(fit: dict) -> str:
    """A transfer fit as a reader says it: its fixed time and its rate, or none where the fit found
    no cost per byte (``NO_BYTE_COST_BYTES_PER_S``, or a tenth of it: a file with a least-squares fit
    holds ``1 / 1e-15``, a hair under it)."""
    from kvpool.backend.serve.calibrate import NO_BYTE_COST_BYTES_PER_S

    fixed = f"{fit['fixed_s'] * 1e3:.2f} ms"
    if fit["bytes_per_s"] >= NO_BYTE_COST_BYTES_PER_S / 10:
        return f"{fixed} (no measurable cost per byte)"
    return f"{fixed} + {fit['bytes_per_s'] / 1e9:.2f} GB/s"


def calibration_document(s, measured: dict, *, url: str, device: str) -> dict:
    from kvpool import __version__
    from kvpool.sim.calibration import FORMAT, VERSION
    from kvpool.sim.provenance import scenario_sha256

    sv = s.serve
    return {
        "format": FORMAT, "version": VERSION, "kvpool_version": __version__,
        "created_utc": _utc_now(),
        "device": {"name": device, "devices": list(sv.devices)},
        "scenario": {"name": s.name, "sha256": scenario_sha256(s)},
        "server": {"url": url},
        "model": {"name": s.model.name, "layers": s.model.layers, "record_bytes": s.model.record_bytes,
                  "page_tokens": s.model.page_tokens, "d_model": sv.d_model, "heads": sv.heads, "ffn_dim": sv.ffn_dim,
                  "vocab": sv.vocab, "cache_dtype": sv.cache_dtype, "stage_layers": list(s.prefill.stage_layers),
                  "decode_tp": s.decode.tp, "decode_dcp": s.decode.dcp,
                  "prefill_kv_tokens": sv.prefill_kv_tokens, "decode_kv_tokens": sv.decode_kv_tokens},
        **measured,
    }


def calibrate(
    scenario: str = typer.Argument("cpu-tiny", help="Built-in scenario name or TOML file: the one the server runs (or is started with)."),
    url: str = typer.Option(None, "--url", help="A running kvpool serve of SCENARIO, e.g. http://127.0.0.1:8000 (default: start one)."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    out: Path = typer.Option(None, "--out", help="The calibration file to write (default: out/calibration-NAME.json; with --refit: FILE.refit.json)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the calibration's prompt tokens."),
    refit_file: Path = typer.Option(
        None, "--refit", help="Measure nothing: recompute this calibration file's fitted curves from its samples."),
    replay_traces: str = typer.Option(
        None, "--replay-traces", help="Last, replay these traces (file or directory; never the ones the file is to "
        "predict) and scale the prefill grid to what the engines' accounts show per computed token in that replay."),
    replay_sessions: int = typer.Option(REPLAY_SESSIONS, "--replay-sessions", help="AgentX lanes of the replay phase."),
    replay_duration: float = typer.Option(REPLAY_DURATION_S, "--replay-duration",
                                          help="The replay phase's window, seconds (no grace after it)."),
    run_dir: Path = typer.Option(None, "--run-dir", help="With --url and --replay-traces: the server's run directory "
                                 "(kvpool serve --run-dir), whose ready files give the engines' URLs."),
) -> None:
    """Measure the workers' cost curves (prefill, decode, restore, hand-off, save, sharing, control plane) through the
    server's API and write a calibration file the simulator reads (cost.calibration)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvpool.backend.serve.calibrate import default_grid, measure, plan_size
    from kvpool.backend.serve.calibrate_replay import ReplayPhase
    from kvpool.backend.serve.launch import ServeStartError, start_serve
    from kvpool.cli.replay import check_url
    from kvpool.outputs import safe_name

    if refit_file is not None:
        _refit(refit_file, out)
        return
    s = load_or_exit(scenario, list(set_))
    replay_s = _replay_scenario(scenario, list(set_), replay_traces, replay_sessions, replay_duration, url, run_dir)
    url = check_url(url) if url is not None else None
    out = out if out is not None else Path("out") / f"calibration-{safe_name(s.name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    served = None
    if url is None:
        run_dir = Path("out/calibrate") / f"{safe_name(s.name)}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        console.print(f"starting kvpool serve {scenario} (run directory {run_dir})")
        try:
            served = start_serve(scenario, list(set_), run_dir, ready_timeout_s=SERVE_READY_S)
        except ServeStartError as e:
            raise UserError(str(e)) from None
        url = served.url
        run_dir = served.run_dir
    grid = default_grid(s)
    try:
        replay = None if replay_s is None else ReplayPhase(replay_s, replay_traces, _engine_urls(run_dir),
                                                           replay_schedule(replay_s, replay_traces))
        with Progress(TextColumn("[bold]calibrating[/] " + s.name), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[what]}"), TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task("calibrate", total=plan_size(grid, s, replay is not None), what="")
            measured = asyncio.run(measure(url, s, grid=grid, seed=seed, replay=replay,
                                           on_step=lambda label: bar.update(task, advance=1, what=label)))
    except (OSError, RuntimeError, asyncio.TimeoutError) as e:  # aiohttp's errors are OSErrors
        raise UserError(f"calibrating {url}: {e}") from None
    finally:
        if served is not None:
            served.stop()
    doc = calibration_document(s, measured, url=url, device=_device_name(s))
    if replay_s is not None:
        from kvpool.sim.replay_fit import with_replay_scale

        try:
            doc = with_replay_scale(doc, replay_s, replay_traces)
        except ValueError as e:
            _write_json(out, doc)
            raise UserError(f"--replay-traces {replay_traces}: {e} (the measurement, unscaled, is in {out})") from None
    _write_json(out, doc)
    d, r, h, sv = doc["decode"]["fit"], doc["restore"]["fit"], doc["handoff"]["fit"], doc["save"]["fit"]
    share = doc["sharing"]
    console.print(f"prefill: {len(doc['prefill']['new_tokens'])} x {len(doc['prefill']['cached_tokens'])} grid; "
                  f"decode step {d['fixed_s'] * 1e3:.2f} ms + {d['per_seq_s'] * 1e3:.3f} ms/seq + "
                  f"{d['per_ctx_token_s'] * 1e6:.3f} us/ctx token; restore {_transfer(r)} per stage; "
                  f"hand-off {_transfer(h)}; save {_transfer(sv)} per stage; beside one other worker, "
                  f"a decode step +{share['decode_slowdown_per_worker']:.0%}, "
                  f"a prefill stage +{share['prefill_slowdown_per_worker']:.0%}; "
                  f"control plane {doc['overheads']['control_plane_s'] * 1e3:.1f} ms; "
                  f"{doc['requests']} requests in {doc['wall_s']:.0f} s")
    if "replay" in doc:
        console.print(replay_line(doc["replay"]))
    drift = speed_drift_warning(share.get("prefill_alone_over_grid"))
    if drift:
        typer.echo(f"warning: {drift}", err=True)
    typer.echo(f"wrote {out}")


def _replay_scenario(scenario: str, sets: list[str], traces: str | None, sessions: int, duration_s: float,
                     url: str | None, run_dir: Path | None):
    """The replay phase's scenario (``None`` without ``--replay-traces``): SCENARIO with ``--set``,
    AgentX at ``sessions`` lanes for ``duration_s`` seconds and no grace, with the server's
    capacities (``cost.kv_capacity = "serve"``: the simulator's replay of it, ``sim.replay_fit``);
    one ``UserError`` per bad option."""
    import math

    from kvpool.sim.run import workload_for
    from kvpool.workload.errors import TraceError

    if traces is None:
        return None
    if sessions < 1:
        raise UserError(f"--replay-sessions {sessions}: must be at least 1")
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise UserError(f"--replay-duration {duration_s:g}: must be a number of seconds > 0")
    if url is not None and run_dir is None:
        raise UserError("--replay-traces with --url needs --run-dir: the server's run directory, whose ready files "
                        "give its engines' URLs (their time accounts)")
    s = load_or_exit(scenario, [*sets, 'cost.kv_capacity="serve"', 'workload.mode="agentx"',
                                f"workload.sessions={sessions}", f"workload.duration_s={duration_s!r}",
                                "workload.grace_s=0"])
    try:
        workload_for(s, traces)  # read now (and kept): a bad trace set stops the command before a server starts
    except TraceError as e:
        raise UserError(f"--replay-traces: {e}") from None
    return s


def replay_schedule(s, traces: str):
    """The replay phase's schedule: ``kvpool sim run``'s replay of ``traces`` at ``s.workload.sessions``
    lanes (``sim.run.make_replay``), as ``kvpool replay`` builds it."""
    from kvpool.sim.run import make_replay, workload_for

    return make_replay(s, workload_for(s, traces), s.workload.sessions)


def _engine_urls(run_dir: Path) -> dict[str, str]:
    """The engines' URLs from ``run_dir``'s plan and ready files; a ``UserError`` naming ``--run-dir`` otherwise."""
    from kvpool.backend.serve.engine_accounts import engine_urls

    try:
        return engine_urls(Path(run_dir))
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--run-dir {run_dir}: not a running kvpool serve's run directory ({e})") from None


def replay_line(replay: dict) -> str:
    """The replay phase as a reader says it: the stages' time per computed token, real and simulated,
    the scale, and the prompts alone before and after it against their grid cell."""
    p, fit = replay["prefill"], replay.get("fit") or {}
    line = (f"replay: {replay['sessions']} sessions of {len(replay['files'])} trace files, {replay['requests']} "
            f"requests: a prefill stage {p['stage_us_per_token']:.1f} us per computed token (its layers "
            f"{p['forward_us_per_token']:.1f} us)")
    if fit:
        line += (f", the grid's cells {fit['sim_us_per_token_unscaled']:.1f} us in the simulated replay: "
                 f"prefill.replay_scale {fit['scale']:.3f}")
    before, after = replay["alone_before"]["over_grid"], replay["alone_after"]["over_grid"]
    if before is not None and after is not None:
        line += (f"; a {replay['alone_after']['prompt_tokens']}-token prompt alone took {before:.2f}x its grid cell "
                 f"before the replay, {after:.2f}x after it")
    return line


#: how far the sharing phase's prompt alone may stray from its prefill-grid window before a warning
SPEED_DRIFT_LIMIT = 1.15


def speed_drift_warning(alone_over_grid: float | None) -> str | None:
    """A warning when a prompt measured alone at the end of the calibration took more than
    ``SPEED_DRIFT_LIMIT`` times (or less than its inverse) the window the prefill grid measured for
    it; ``None`` otherwise."""
    if alone_over_grid is None or 1 / SPEED_DRIFT_LIMIT <= alone_over_grid <= SPEED_DRIFT_LIMIT:
        return None
    return (f"the sharing phase's prompts alone took {alone_over_grid:.2f}x the window the prefill grid measured "
            "for the same prompt: the server's speed changed during the calibration, so its prefill cells may "
            "not hold for a replay (sharing.prefill_alone_over_grid)")


def _refit(path: Path, out: Path | None) -> None:
    """``--refit``: ``path``'s curves refitted from its samples, checked as the simulator reads them,
    written to ``out``."""
    from kvpool.backend.serve.calibrate import refit
    from kvpool.sim.calibration import CalibrationError, load_calibration, parse_calibration

    try:
        doc = load_calibration(path).raw
        try:
            new = refit(doc)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CalibrationError(f"{path}: cannot refit: a sample field is missing or malformed ({e!r})") from None
        new["refitted_utc"] = _utc_now()
        parse_calibration(new, str(path))
    except CalibrationError as e:
        raise UserError(str(e)) from None
    out = out if out is not None else path.with_name(path.name.removesuffix(".json") + ".refit.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_json(out, new)
    for curve in ("restore", "handoff", "save"):
        before, after = doc[curve]["fit"], new[curve]["fit"]
        typer.echo(f"{curve}: {_transfer(before)} -> {_transfer(after)}")
    before_s, after_s = doc["overheads"]["control_plane_s"], new["overheads"]["control_plane_s"]
    typer.echo(f"control plane: {before_s * 1e3:.1f} -> {after_s * 1e3:.1f} ms")
    if "replay_scale" in new["prefill"]:
        typer.echo(f"prefill.replay_scale: {new['prefill']['replay_scale']:.3f}, as measured (not refitted)")
    typer.echo(f"wrote {out}")
