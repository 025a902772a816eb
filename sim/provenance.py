"""What produced a simulator result: the inputs that decide its numbers, recorded beside them.

Contract:
    * ``scenario_sha256(s)`` is the SHA-256 of the scenario's canonical JSON dump (every field,
      after overrides; keys sorted, no whitespace): equal for equal scenarios, whatever file or
      ``--set`` produced them.
    * ``traces_sha256(path)`` is the SHA-256 of a trace file, or of a directory's files (each file's
      path relative to the directory and its SHA-256, in sorted order).
    * ``provenance(s, ...)`` is the ``provenance`` block of a result (docs/metrics.md): scenario name
      and hash, the overrides as given, the seed, the workload (synthetic preset, or trace path and
      hash), the measured window, the loads and kvpool's version. Only inputs go in: two runs of the
      same inputs give the same block, on any machine and with any executor.
    * ``short_id(block)`` is the first 8 hex digits of the SHA-256 of a block's canonical JSON: the
      suffix of the output file names, so that different inputs never share a file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from kvpool.scenario.model import Scenario


def canonical_json(doc: object) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def scenario_sha256(s: Scenario) -> str:
    return hashlib.sha256(canonical_json(s.model_dump(mode="json")).encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def traces_sha256(path: str | os.PathLike) -> tuple[str, int]:
    """(SHA-256, number of files) of a trace file or directory."""
    p = Path(path)
    if p.is_file():
        return _file_sha256(p), 1
    files = sorted(f for f in p.rglob("*") if f.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(p).as_posix()}\0{_file_sha256(f)}\n".encode())
    return h.hexdigest(), len(files)


def workload_block(s: Scenario, traces: str | None) -> dict:
    """The workload a run replays: its trace set (path as given, hash) or its synthetic preset."""
    path = traces or s.workload.traces
    if path:
        digest, files = traces_sha256(path)
        return {"kind": "traces", "path": str(path), "files": files, "sha256": digest}
    return {"kind": "synthetic", "preset": s.workload.preset, "sessions": s.workload.synthetic_sessions,
            "context_scale": s.workload.context_scale}


def workload_label(block: dict) -> str:
    """A few words for titles: ``synthetic agentx-062126 (40 sessions)`` or ``traces trace_0002.json.gz``."""
    if block["kind"] == "traces":
        return f"traces {Path(block['path']).name}"
    scale = "" if block["context_scale"] == 1 else f", context x{block['context_scale']:g}"
    return f"synthetic {block['preset']} ({block['sessions']} sessions{scale})"


def kvpool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpool")
    except PackageNotFoundError:  # a source tree without an install
        return "0.0.0+unknown"


def provenance(s: Scenario, *, source: str, overrides: Sequence[str], traces: str | None,
               set_overrides: Sequence[str] = (), load_key: str | None = None, loads: Sequence[float] = ()) -> dict:
    """The ``provenance`` block of one scenario's result: ``source`` is the name or file as given,
    ``set_overrides`` the user's ``--set`` values, ``overrides`` every override the scenario was
    loaded with (``--set`` and those that ``--duration``, ``--seed``, ``--sessions``/``--rps`` stand for)."""
    out = {
        "scenario": {"name": s.name, "source": source, "sha256": scenario_sha256(s)},
        "set": list(set_overrides),
        "overrides": list(overrides),
        "seed": s.seed,
        "workload": workload_block(s, traces),
        "mode": s.workload.mode,
        "duration_s": s.workload.duration_s,
    }
    if load_key is not None:
        out["loads"] = {load_key: [int(x) if load_key == "sessions" else float(x) for x in loads]}
    out["kvpool_version"] = kvpool_version()
    return out


def short_id(block: object) -> str:
    return hashlib.sha256(canonical_json(block).encode()).hexdigest()[:8]
