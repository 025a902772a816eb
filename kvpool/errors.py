"""The error type of a user's mistake, shared by every front end (CLI, dashboard).

Contract: ``UserError(message)`` is raised for bad user input; the CLI prints ``error: <message>``
without a traceback (exit status 2), the dashboard shows the message beside the input.
``printable(text)`` is the form of a message (or of a name inside one: a file name, a label) the
CLI prints: every character that is not printable (a newline, a carriage return, an escape that a
terminal would act on) is shown as its Python escape, so a message stays one line of plain text.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake of the user's, shown as one message naming the input and what it allows."""


def printable(text: str) -> str:
    """``text`` with each non-printable character written as its escape (``\\n``, ``\\x1b``, ``\\udcff``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
