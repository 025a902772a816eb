"""Bad-input errors of the workload loaders.

Contract: every problem with a user's trace file becomes a :class:`TraceError` that names the
file, the trace id (when known) and the request (its path in the file, e.g.
``requests[5].requests[2]``, or a line number for JSONL), so the CLI can print one line and exit
without a traceback.
"""

from __future__ import annotations


class TraceError(ValueError):
    """A malformed trace: ``file``, ``trace_id`` and ``request`` locate it, ``message`` says why."""

    def __init__(self, message: str, *, file: str = "", trace_id: str | None = None, request: str | None = None):
        self.message = message
        self.file = file
        self.trace_id = trace_id
        self.request = request
        super().__init__(self.describe())

    def describe(self) -> str:
        parts = []
        if self.file:
            parts.append(self.file)
        if self.trace_id is not None:
            parts.append(f"trace {self.trace_id}")
        if self.request is not None:
            parts.append(self.request)
        parts.append(self.message)
        return ": ".join(parts)

    def located(self, *, file: str | None = None, trace_id: str | None = None) -> TraceError:
        """A copy with the file / trace id filled in where this error did not know them."""
        return TraceError(
            self.message,
            file=self.file or (file or ""),
            trace_id=self.trace_id if self.trace_id is not None else trace_id,
            request=self.request,
        )
