"""Agent-session workloads: loaders, the normalized model, replay schedules, stats, synthesis.

Not the simulator's own: it imports the standard library and numpy only (the preset fitting,
``fit``, scipy as well) and nothing of ``kvpool.sim``, so the simulator and a real replay client
drive the same schedules. Public API:

* model: :class:`Workload`, :class:`Session`, :class:`Thread`, :class:`Request`, :class:`Dep`
* loading: :func:`load_workload` (Weka file/.json.gz/dir/traces.jsonl, Mooncake JSONL),
  :class:`TraceError`
* stats: :func:`workload_stats`
* replay: see :mod:`kvpool.workload.replay`
* synthesis: see :mod:`kvpool.workload.synth`; presets (package data): :mod:`kvpool.workload.presets`
* per-request records and the metrics computed from them (both worlds): see
  :mod:`kvpool.workload.records`
"""

from kvpool.workload.errors import TraceError
from kvpool.workload.load import load_workload, trace_files, write_jsonl_rows, write_weka_jsonl
from kvpool.workload.model import Dep, Request, Session, SkippedTrace, Thread, Workload
from kvpool.workload.stats import workload_stats

__all__ = [
    "Dep",
    "Request",
    "Session",
    "SkippedTrace",
    "Thread",
    "TraceError",
    "Workload",
    "load_workload",
    "trace_files",
    "workload_stats",
    "write_jsonl_rows",
    "write_weka_jsonl",
]
