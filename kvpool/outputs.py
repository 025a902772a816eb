"""Writing outputs safely: file names from labels, output folders, atomic writes, no clobbering.

Contract (stdlib only; shared by the CLI and the simulator's report writer):
    * ``safe_name(label)``: a file-name part from a user's label (a scenario name is a label, never a
      path): letters, digits and ``. _ + -`` kept, anything else ``_``; no leading dot, no ``..``;
      at most ``MAX_NAME_CHARS`` characters (a longer label is cut and keeps a short digest of the
      whole). A label already made of those characters and short enough is returned unchanged.
    * ``output_dir(path, flag, create=True)``: ``path`` as a folder that exists and is writable
      (created when missing), or a ``UserError`` naming ``flag``: an existing file, a folder that
      cannot be created or written. With ``create=False`` nothing is created: the check is that
      ``path`` is a writable folder or that its nearest existing ancestor is one (a command checks
      ``--out`` so before it reads its inputs, and creates it once it has something to write, so a
      run that fails leaves no folder behind). ``output_file(path, flag, create=True)`` does the same
      for a file's folder.
    * ``atomic_path(final)``: a context manager giving a temporary path in ``final``'s folder (same
      suffixes, so writers that pick a format by suffix still do); on a clean exit it is renamed onto
      ``final`` in one step, on any exception (Ctrl-C included) it is removed: an interrupted or
      failed write never leaves a partial file, and ``final`` keeps its old content. With
      ``replace=False`` the temporary file is hard-linked to ``final`` instead, which fails with
      ``FileExistsError`` (and leaves ``final`` alone) when something appeared there meanwhile.
    * ``refuse_existing(path, flag, force)``: a ``UserError`` when ``path`` exists (a symbolic link
      counts, even one whose target is missing) and ``force`` is false (a file the run did not create
      is not overwritten unless the user says so).
    * ``check_path_length(path, flag)``: ``path`` unchanged, or a ``UserError`` naming ``flag`` when
      one of its names is longer than ``NAME_MAX_BYTES`` or the whole longer than ``PATH_MAX_BYTES``
      (the limits of Linux file systems; the system would refuse such a path with ENAMETOOLONG).
      ``output_dir``, ``output_file`` and ``refuse_existing`` check it first.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvpool.errors import UserError, printable

MAX_NAME_CHARS = 100
NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4095
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")


def safe_name(label: str) -> str:
    """``label`` as a safe part of a file name (see the module docstring)."""
    name = _UNSAFE.sub("_", label)
    name = re.sub(r"\.{2,}", "_", name).lstrip(".") or "_"
    if len(name) > MAX_NAME_CHARS or name != label and len(label) > MAX_NAME_CHARS:
        digest = hashlib.sha256(label.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        name = f"{name[:MAX_NAME_CHARS - 9]}-{digest}"
    return name


def _shown(path: Path | str) -> str:
    text = printable(str(path))
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def check_path_length(path: Path | str, flag: str) -> Path:
    """``Path(path)``, or a ``UserError`` naming ``flag`` when a name in it or the whole is too long."""
    raw = os.fsencode(path)
    if len(raw) > PATH_MAX_BYTES:
        raise UserError(f"{flag} {_shown(path)}: the path is longer than {PATH_MAX_BYTES} bytes")
    long = next((part for part in raw.split(b"/") if len(part) > NAME_MAX_BYTES), None)
    if long is not None:
        raise UserError(f"{flag} {_shown(path)}: a name in the path has {len(long)} bytes; "
                        f"a file system allows at most {NAME_MAX_BYTES}")
    return Path(path)


def _refuse_dangling_link(path: Path, flag: str) -> None:
    """A ``UserError`` when ``path`` or a folder above it is a link to nothing (it cannot be created
    through, and ``mkdir`` would only say "File exists")."""
    for p in (path, *path.parents):
        if p.is_symlink() and not p.exists():
            raise UserError(f"{flag} {path}: {'it' if p == path else p} is a link to {os.readlink(p)}, which does "
                            "not exist; create the target or give another path")


def output_dir(path: Path, flag: str = "--out", create: bool = True) -> Path:
    """``path`` created if missing (``create``); a ``UserError`` naming ``flag`` if it is not, or cannot
    become, a writable folder (a link to nothing included)."""
    check_path_length(path, flag)
    _refuse_dangling_link(path, flag)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path}: exists and is not a directory; give a directory for the outputs")
    if not create:
        ancestor = path
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise UserError(f"{flag} {path}: cannot create the directory: {ancestor} is not a directory")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            what = "the directory is not writable" if ancestor == path else f"cannot create it in {ancestor}"
            raise UserError(f"{flag} {path}: {what}")
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot create the directory: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: the directory is not writable")
    return path


def output_file(path: Path, flag: str = "--out", create: bool = True) -> Path:
    """``path`` as a file to write: its folder is made writable (``output_dir``), and it is not a folder."""
    check_path_length(path, flag)
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory; give a file name")
    output_dir(path.parent if str(path.parent) else Path("."), flag, create)
    return path


def refuse_existing(path: Path, flag: str, force: bool) -> None:
    check_path_length(path, flag)
    if os.path.lexists(path) and not force:
        raise UserError(f"{flag} {path}: exists; give --force to overwrite it, or another name")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(final: Path, replace: bool = True) -> Iterator[Path]:
    """A temporary sibling of ``final``, renamed onto it on success (``replace=False``: linked to it,
    never replacing an existing file) and removed on failure."""
    final = Path(final)
    suffixes = "".join(final.suffixes[-2:]) if final.name.endswith((".jsonl.gz", ".json.gz")) else final.suffix
    # created here, exclusively, under an unpredictable name: nothing planted beforehand is followed
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{final.name[:150]}.", suffix=f".tmp{suffixes}", dir=final.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # the mode a plain open() would give, not mkstemp's 0600
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if replace:
            os.replace(tmp, final)
        else:
            os.link(tmp, final)
            tmp.unlink()
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
