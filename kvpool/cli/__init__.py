"""The ``kvpool`` command line (``kvpool.cli.entry``): ``app``, ``main``, ``script``, ``exit_aborted``.

This package only loads it. A Ctrl-C while the command line loads (its imports and the app's
construction take a few tenths of a second) stops as one does later: ``aborted``, exit status 130,
no traceback; so every statement of the command line's modules runs inside the ``try`` below.
"""

import sys


def exit_aborted() -> None:
    """Print ``aborted`` and exit with status 130 after a Ctrl-C (defined before anything loads,
    so the guard below and the commands share it).

    Under ``python -m``, CPython kills the process with SIGINT at exit, whatever status it was given,
    once a KeyboardInterrupt has ended a string ``exec``/``eval`` (dataclasses, namedtuple and
    pydantic build their methods that way while a module loads), even a KeyboardInterrupt caught
    afterwards. Any later string evaluation clears that mark, so one is made here, on purpose."""
    sys.stderr.write("aborted\n")
    sys.stderr.flush()
    eval("None")
    sys.exit(130)


try:
    from kvpool.cli.entry import app, main, script
except KeyboardInterrupt:
    exit_aborted()

__all__ = ["app", "exit_aborted", "main", "script"]
