"""The ``kvpool`` command line (``kvpool.cli.entry``): ``app``, ``main``, ``script``, ``exit_aborted``.

This package only loads it. A Ctrl-C while the command line loads (its imports and the app's
construction take a few tenths of a second) stops as one does later: ``aborted``, exit status 130,
no traceback; so every statement of the command line's modules runs inside the ``try`` below.
"""

import sys

try:
    from kvpool.cli.entry import app, exit_aborted, main, script
except KeyboardInterrupt:
    sys.stderr.write("aborted\n")
    sys.stderr.flush()
    eval("None")  # see exit_aborted: a Ctrl-C inside an import's string exec would turn 130 into SIGINT
    sys.exit(130)

__all__ = ["app", "exit_aborted", "main", "script"]
