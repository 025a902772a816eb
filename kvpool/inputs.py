"""Reading a file a user names (a scenario, a calibration file, a state file): a regular file, read
to a bound, or one ``InputFileError`` saying why not.

Contract: ``read_regular(path, max_bytes, what)`` returns the file's bytes when ``path`` is a
regular file (after links) of at most ``max_bytes``; otherwise ``InputFileError`` with one line
naming the path: no such file, not a regular file (a FIFO, a device such as ``/dev/zero``, a
socket or a directory: reading one could block or never end), larger than the bound, or the
system's reason it cannot be read. The size is checked before the read and the read itself stops
one byte past the bound, so a file that grows meanwhile is refused too. Callers turn the error
into their own type (``ScenarioError``, ``CalibrationError``, ``UserError``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvpool.errors import printable


class InputFileError(Exception):
    """A file a user named that cannot be read as one (see the module docstring)."""


def _size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def read_regular(path: str | Path, max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` (``what``: e.g. ``a calibration file``)."""
    shown = printable(str(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputFileError(f"{shown}: no such file") from None
    except (OSError, ValueError) as e:
        raise InputFileError(f"{shown}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError(f"{shown}: not a regular file ({what} is one; a FIFO, a device, a socket or a "
                             "directory is not)")
    if st.st_size > max_bytes:
        raise InputFileError(f"{shown}: larger than {_size(max_bytes)}; {what} is at most that")
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise InputFileError(f"{shown}: cannot read: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise InputFileError(f"{shown}: larger than {_size(max_bytes)}; {what} is at most that")
    return data
