"""Load a workload from trace files, whatever their layout.

Contract:
    ``load_workload(path, skip_bad=False, progress=None) -> Workload`` accepts
        * one Weka trace per ``.json`` / ``.json.gz`` file (a JSON list of traces is accepted too);
        * a directory of such files (and of ``.jsonl`` files), read in name order;
        * a ``.jsonl`` / ``.jsonl.gz`` file: one Weka trace per line (the Hugging Face
          ``traces.jsonl`` layout) or one Mooncake row per line (detected from the first line).
    Every problem raises :class:`TraceError` naming the file, the trace id and the request. With
    ``skip_bad=True`` a bad trace (or Mooncake row, or unreadable file) is left out and recorded
    in ``Workload.skipped`` instead. ``progress(done, total)`` is called after each file.

    Memory: each file is parsed, converted to the compact model and dropped before the next one,
    so peak memory is the compact workload plus one parsed file.

    Limits: only regular files are read (a FIFO, a device or a socket is an error, never a read
    that blocks or never ends), each at most ``MAX_FILE_BYTES`` on disk. A gzip file is inflated in
    pieces and stops at ``inflated_bound_bytes(size on disk)``: at most ``MAX_GZIP_RATIO`` times its
    size on disk (real traces inflate 2-75x, a gzip bomb about 1000x), never less than
    ``MIN_INFLATED_BOUND_BYTES`` and never more than ``MAX_FILE_BYTES``; a truncated or corrupt one is
    an error. JSON nested too deeply, a key given twice in one object and text that is not UTF-8 are
    errors; a UTF-8 byte-order mark and CRLF line ends are read as the text they frame. Weka trace
    ids are distinct across the whole workload.
"""

from __future__ import annotations

import gzip
import io
import json
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.workload.errors import TraceError
from kvpool.workload.model import Session, SkippedTrace, Workload
from kvpool.workload.mooncake import session_from_mooncake_row
from kvpool.workload.weka import session_from_weka, session_to_weka

SUFFIXES = (".json", ".json.gz", ".jsonl", ".jsonl.gz")
MAX_FILE_BYTES = 4 << 30  # 4 GiB per trace file, compressed or not
MAX_GZIP_RATIO = 200  # inflated size over size on disk
MIN_INFLATED_BOUND_BYTES = 64 << 20  # a small gzip file may always inflate this far
_INFLATE_STEP_BYTES = 16 << 20
Progress = Callable[[int, int], None]


def trace_files(path: str | Path) -> list[Path]:
    """The trace files ``path`` names: itself, or the trace files of a directory in name order."""
    p = Path(path)
    try:
        if not p.exists():
            raise TraceError("no such file or directory", file=str(p))
        if p.is_dir():
            files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(SUFFIXES))
            if not files:
                raise TraceError(f"no trace files ({', '.join(SUFFIXES)}) in the directory", file=str(p))
            return files
    except OSError as e:
        raise TraceError(f"cannot read: {e.strerror or e}", file=str(p)) from None
    if not p.is_file():
        raise TraceError("not a regular file (a FIFO, device or socket is not a trace)", file=str(p))
    return [p]


def inflated_bound_bytes(compressed_bytes: int) -> int:
    """The most bytes a gzip trace file of ``compressed_bytes`` on disk may inflate to."""
    return min(MAX_FILE_BYTES, max(MIN_INFLATED_BOUND_BYTES, MAX_GZIP_RATIO * compressed_bytes))


def _size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} bytes"


def _read_bytes(f: Path) -> bytes:
    try:
        if not f.is_file():
            raise TraceError("not a regular file (a FIFO, device or socket is not a trace)", file=str(f))
        if f.stat().st_size > MAX_FILE_BYTES:
            raise TraceError(f"larger than {MAX_FILE_BYTES >> 30} GiB", file=str(f))
        raw = f.read_bytes()
    except OSError as e:
        raise TraceError(f"cannot read: {e.strerror or e}", file=str(f)) from None
    return _gunzip(raw, str(f)) if raw[:2] == b"\x1f\x8b" else raw


def _gunzip(raw: bytes, file: str) -> bytes:
    """The inflated content of a gzip file, read in pieces up to ``inflated_bound_bytes``."""
    bound = inflated_bound_bytes(len(raw))
    pieces: list[bytes] = []
    total = 0
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as g:
            while piece := g.read(min(_INFLATE_STEP_BYTES, bound + 1 - total)):
                pieces.append(piece)
                total += len(piece)
                if total > bound:
                    raise TraceError(
                        f"inflates past {_size(bound)} after gzip; allowed: {MAX_GZIP_RATIO} times its "
                        f"{_size(len(raw))} on disk, at least {_size(MIN_INFLATED_BOUND_BYTES)}, at most "
                        f"{_size(MAX_FILE_BYTES)} (a gzip bomb is not a trace)", file=file)
    except (EOFError, OSError, zlib.error) as e:
        raise TraceError(f"truncated or corrupt gzip file ({e or type(e).__name__})", file=file) from None
    return b"".join(pieces)


class _DuplicateKey(ValueError):
    """A JSON object that names one key twice (``json`` would keep the last silently)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return obj


def _loads(text: bytes) -> Any:
    """``json.loads`` refusing a key given twice in one object."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def _json(text: bytes, file: str, line: int | None = None) -> Any:
    where = None if line is None else f"line {line}"
    try:
        return _loads(text)
    except RecursionError:
        raise TraceError("JSON nested too deeply", file=file, request=where) from None
    except _DuplicateKey as e:
        raise TraceError(f"key {_shown_key(e.key)} given twice in one JSON object; each key at most once",
                         file=file, request=where) from None
    except UnicodeDecodeError as e:
        raise TraceError(f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                         "a trace is JSON in UTF-8", file=file, request=where) from None
    except ValueError as e:
        if isinstance(e, json.JSONDecodeError):
            raise _invalid(e, file, line) from None
        # Python refuses to convert an integer of thousands of digits: no field allows one
        raise TraceError("invalid JSON (a number of more than 4300 digits)", file=file, request=where) from None


def _shown_key(key: str) -> str:
    text = repr(key)
    return text if len(text) <= 60 else text[:50] + f"... ({len(key)} characters)"


def _invalid(e: ValueError, file: str, line: int | None) -> TraceError:
    """The TraceError of JSON that does not parse, naming where."""
    where = f"line {line}" if line is not None else None
    detail = f"line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) and line is None else ""
    msg = f"invalid JSON ({e.msg if isinstance(e, json.JSONDecodeError) else e}{', ' + detail if detail else ''})"
    return TraceError(msg, file=file, request=where)


_I64_MAX = 2**63 - 1


def _split_hash_ids(data: bytes) -> tuple[bytes, list[np.ndarray]] | None:
    """Fast path: cut every ``hash_ids`` list out of the JSON text and parse them with numpy.

    Returns the text with each list replaced by ``{"@": k}`` and the k-th list as an int64
    array, or None when anything looks unusual (the caller then parses the plain JSON, which
    gives exact error messages). The JSON module spends most of its time building the
    millions of small ints of these lists; numpy parses them an order of magnitude faster.
    """
    spans: list[bytes] = []
    parts: list[bytes] = []
    pos = 0
    key = b'"hash_ids"'
    while True:
        k = data.find(key, pos)
        if k < 0:
            break
        lb = data.find(b"[", k)
        rb = data.find(b"]", lb)
        if lb < 0 or rb < 0 or data[k + len(key) : lb].strip() != b":" or data.find(b"[", lb + 1, rb) >= 0:
            return None
        parts.append(data[pos:k])
        parts.append(b'"hash_ids":{"@":%d}' % len(spans))
        spans.append(data[lb + 1 : rb])
        pos = rb + 1
    parts.append(data[pos:])
    text = b"".join(parts)
    del parts
    table: list[np.ndarray] = []
    prev_span, prev_ids = b"", np.zeros(0, dtype=np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for sp in spans:
            # consecutive requests resend the previous ids: reuse the common text, parse the rest
            keep, head_len = _common_items(prev_span, sp, len(prev_ids))
            if keep:
                rest = sp[head_len:]
                head = prev_ids[:keep]
            else:
                rest, head = sp, prev_ids[:0]
            try:
                tail = np.fromstring(rest, dtype=np.int64, sep=",") if rest.strip() else np.zeros(0, dtype=np.int64)
            except (ValueError, DeprecationWarning):
                return None
            n_expect = (rest.count(b",") + 1) if rest.strip() else 0
            if len(tail) != n_expect or (len(tail) and (int(tail.min()) < 0 or int(tail.max()) >= _I64_MAX)):
                return None
            ids = np.concatenate((head, tail)) if keep else tail
            table.append(ids)
            prev_span, prev_ids = sp, ids
    return text, table


def _common_items(a: bytes, b: bytes, a_items: int) -> tuple[int, int]:
    """(count, byte length) of the leading comma-separated items of ``b`` byte-identical to ``a``'s.

    The byte length includes the comma after the last kept item. ``a_items`` is ``a``'s count.
    """
    if not a:
        return 0, 0
    if b.startswith(a) and b[len(a) : len(a) + 1] == b",":
        return a_items, len(a) + 1
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        lo = hi
    else:
        while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
            mid = (lo + hi) // 2
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid
    # keep whole items only: the last comma inside the common part (then both have it)
    k = a.rfind(b",", 0, lo)
    if k < 0:
        return 0, 0
    return a.count(b",", 0, k) + 1, k + 1


def _weka_doc(data: bytes, file: str, line: int | None = None) -> tuple[Any, list[np.ndarray] | None]:
    fast = _split_hash_ids(data)
    if fast is not None:
        try:
            return _loads(fast[0]), fast[1]
        except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, too many digits
            pass
    return _json(data, file, line), None


def _distinct(s: Session, name: str, seen: dict[str, str]) -> Session | TraceError:
    """``s``, or a TraceError when a Weka trace of the same id came earlier (``seen``: id -> file)."""
    if s.id in seen:
        return TraceError(f"duplicate trace id (also in {seen[s.id]})", file=name, trace_id=s.id)
    seen[s.id] = name
    return s


def _sessions_of_file(f: Path, seen: dict[str, str] | None = None) -> Iterator[Session | TraceError]:
    """Sessions of one file; a bad trace is yielded as its TraceError (the caller decides).
    ``seen``: ids of the Weka traces read so far (a repeated one is an error)."""
    seen = {} if seen is None else seen
    name = str(f)
    data = _read_bytes(f)
    is_jsonl = f.name.endswith((".jsonl", ".jsonl.gz"))
    if not is_jsonl:
        doc, table = _weka_doc(data, name)
        del data
        docs = doc if isinstance(doc, list) else [doc]
        for k, d in enumerate(docs):
            try:
                yield _distinct(session_from_weka(d, source=name if len(docs) == 1 else f"{name}[{k}]", id_table=table),
                                name, seen)
            except TraceError as e:
                yield e.located(file=name)
        return
    lines = data.splitlines()
    del data
    kind = None
    prev_ms = None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if kind is None:
            kind = "weka" if b'"requests"' in line else "mooncake"
        try:
            if kind == "mooncake":
                doc = _json(line, name, n)
                s = session_from_mooncake_row(doc, n, prev_ms=prev_ms)
                prev_ms = doc["timestamp"]
                yield s
            else:
                doc, table = _weka_doc(line, name, n)
                yield _distinct(session_from_weka(doc, source=f"{name}:{n}", id_table=table), name, seen)
        except TraceError as e:
            yield e.located(file=name)
        lines[n - 1] = b""


def load_workload(path: str | Path, *, skip_bad: bool = False, progress: Progress | None = None) -> Workload:
    """Load every trace under ``path`` (see module contract)."""
    files = trace_files(path)
    sessions: list[Session] = []
    skipped: list[SkippedTrace] = []
    seen: dict[str, str] = {}
    for k, f in enumerate(files):
        try:
            for item in _sessions_of_file(f, seen):
                if isinstance(item, TraceError):
                    if not skip_bad:
                        raise item
                    skipped.append(SkippedTrace(item.file or str(f), item.trace_id, item.request, item.message))
                else:
                    sessions.append(item)
        except TraceError as e:
            if not skip_bad:
                raise
            skipped.append(SkippedTrace(e.file or str(f), e.trace_id, e.request, e.message))
        if progress is not None:
            progress(k + 1, len(files))
    if not sessions:
        msg = "no usable traces"
        if skipped:
            msg += f" ({len(skipped)} skipped; first: {skipped[0].message})"
        raise TraceError(msg, file=str(path))
    return Workload(tuple(sessions), tuple(skipped))


def write_weka_jsonl(sessions, out: str | Path) -> int:
    """Write sessions (or Weka documents) as traces, one per line (``.gz``: gzip). Returns the count."""
    return write_jsonl_rows((s if isinstance(s, dict) else session_to_weka(s) for s in sessions), out)


def write_jsonl_rows(rows, out: str | Path) -> int:
    """Write plain JSON rows one per line (Mooncake). Returns the count."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    # gzip level 1: a seventh of level 9's time for files a tenth larger (hash_ids lists compress well)
    with (gzip.open(out, "wt", compresslevel=1) if out.name.endswith(".gz") else open(out, "w")) as fh:
        for r in rows:
            fh.write(json.dumps(r, separators=(",", ":")))
            fh.write("\n")
            n += 1
    return n
