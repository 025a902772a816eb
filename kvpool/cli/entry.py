"""The ``kvpool`` command line: one typer app with a sub-app per area (``kvpool.cli`` loads it).

Every user mistake (bad scenario, bad flag value) is printed as a one-line ``error:`` message and
exits with status 2; no traceback. Numbers and paths on the command line are read strictly
(``kvpool.cli.flags``).
"""

from __future__ import annotations

import sys

import typer

from kvpool.cli import calibrate as calibrate_cli
from kvpool.cli import exit_aborted  # the package's, defined before this module loads
from kvpool.cli import dashboard as dashboard_cli
from kvpool.cli import pool as pool_cli
from kvpool.cli import replay as replay_cli
from kvpool.cli import scenario as scenario_cli
from kvpool.cli import serve as serve_cli
from kvpool.cli import sim as sim_cli
from kvpool.cli import trace as trace_cli
from kvpool.cli.common import UserError
from kvpool.cli.flags import strict
from kvpool.errors import printable

app = typer.Typer(
    name="kvpool",
    help=(
        "Plan and run a shared KV pool for agentic LLM serving on disaggregated prefill/decode "
        "clusters: scenarios, agent traces, a SimPy simulator, a Mooncake Store pool and a dashboard."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts are plain: a [...] in them is shown, not read as markup
)
app.add_typer(scenario_cli.app, name="scenario")
app.add_typer(trace_cli.app, name="trace")
app.add_typer(sim_cli.app, name="sim")
app.add_typer(pool_cli.app, name="pool")
app.command("serve")(serve_cli.serve)
app.command("replay")(replay_cli.replay)
app.command("calibrate")(calibrate_cli.calibrate)
app.command("dashboard")(dashboard_cli.dashboard)
strict(app)  # every int, float and path flag read strictly (kvpool.cli.flags)


def _version_callback(value: bool) -> None:
    if value:
        from kvpool import __version__

        typer.echo(f"kvpool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", callback=_version_callback, is_eager=True),
) -> None:
    """kvpool command line."""


def _click_exceptions():
    """The click exceptions typer raises (recent typer versions carry their own copy of click)."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``kvpool`` script. A usage mistake (unknown option or command, missing
    argument, a value of the wrong type) is one ``error:`` line naming the command's ``--help``, with
    exit status 2; a group given no command prints its help. Ctrl-C stops a command with ``aborted``
    and exit status 130, wherever it lands (while the CLI loads, inside a destructor, in a sweep's
    worker process)."""
    cx = _click_exceptions()
    sys.unraisablehook = _ctrl_c_in_a_destructor
    try:
        code = app(args=argv, standalone_mode=False)
    except UserError as e:
        typer.echo(f"error: {printable(str(e))}", err=True)
        sys.exit(2)
    except cx.NoArgsIsHelpError as e:
        if e.ctx is not None:
            typer.echo(e.ctx.get_help())
        else:
            e.show()
        sys.exit(e.exit_code)
    except cx.UsageError as e:
        where = f"{e.ctx.command_path} --help" if e.ctx else "kvpool --help"
        message = e.format_message().replace("Value error, ", "")  # pydantic's prefix of a parser's ValueError
        typer.echo(f"error: {printable(message)} (see {where})", err=True)
        sys.exit(2)
    except cx.ClickException as e:
        typer.echo(f"error: {e.format_message()}", err=True)
        sys.exit(e.exit_code)
    except (getattr(cx, "Abort", KeyboardInterrupt), KeyboardInterrupt):
        exit_aborted()
    if code == 130:  # click's own answer to Ctrl-C, and a command's Exit(130) after it stopped
        exit_aborted()
    sys.exit(code if isinstance(code, int) else 0)


def script() -> None:
    """The ``kvpool`` script and ``python -m kvpool.cli``: ``main()``, then Ctrl-C is ignored while
    the process exits, so a Ctrl-C that comes as a finished command shuts down cannot kill it by
    SIGINT (its outputs are written; its status stays the command's). A Ctrl-C that lands after the
    command answered but before that is still ``aborted``, status 130."""
    import signal

    try:
        main()
    except KeyboardInterrupt:
        exit_aborted()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


_default_unraisablehook = sys.unraisablehook


def _ctrl_c_in_a_destructor(unraisable) -> None:
    """A Ctrl-C that lands in a destructor or a weakref callback cannot stop the command there (Python
    would print it as "Exception ignored" and go on): deliver it to the main thread again instead.
    It goes again a moment later, from a timer's thread: sent from inside this hook, it could land
    in the hook itself, where Python ignores it as well."""
    try:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            _ctrl_c_again_soon()
            return
        _default_unraisablehook(unraisable)
    except KeyboardInterrupt:  # a further Ctrl-C that lands in this hook
        _ctrl_c_again_soon()


#: how long after a Ctrl-C in a destructor the main thread gets it again (this hook has returned by then)
CTRL_C_AGAIN_AFTER_S = 0.01


def _ctrl_c_again_soon() -> None:
    import _thread
    import threading

    timer = threading.Timer(CTRL_C_AGAIN_AFTER_S, _thread.interrupt_main)
    timer.daemon = True
    timer.start()
