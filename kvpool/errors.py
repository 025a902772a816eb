"""The error type of a user's mistake, shared by every front end (CLI, dashboard).

Contract: ``UserError(message)`` is raised for bad user input; the CLI prints ``error: <message>``
without a traceback (exit status 2), the dashboard shows the message beside the input.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake of the user's, shown as one message naming the input and what it allows."""
