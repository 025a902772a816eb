"""Benchmark: load all real traces (time and peak memory) against plain json + gzip parsing.

Prints one JSON object. The limit measured in the same run is ``plain_parse_s``: reading every
file, gunzip and ``json.loads`` (nothing kept). The goal is under 15 s and 1 GiB where the plain
parse takes about 9 s, so ``limit_load_s`` is 15/9 of this run's plain parse (the machine is
shared; an absolute number alone would measure the neighbours). Each phase runs in a fresh child process so peak
memory (``ru_maxrss``) is per phase. Usage: ``.venv/bin/python bench/load_traces.py [TRACES_DIR]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "kv-cache-tester"

PLAIN = r"""
import gzip, json, resource, sys, time
from pathlib import Path
files = sorted(Path(sys.argv[1]).glob("*.json.gz"))
t = time.perf_counter(); n = 0
for f in files:
    d = json.loads(gzip.decompress(f.read_bytes())); n += len(d["requests"]); del d
print(json.dumps({"s": time.perf_counter() - t, "files": len(files),
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

LOAD = r"""
import json, resource, sys, time
from kvpool.workload import load_workload
t = time.perf_counter()
w = load_workload(sys.argv[1])
s = time.perf_counter() - t
print(json.dumps({"s": s, "traces": len(w), "requests": w.n_requests,
                  "block_store_mib": sum(x.blocks.nbytes() for x in w) / 2**20,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _child(code: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", code, str(path)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    plain = _child(PLAIN, path)
    load = _child(LOAD, path)
    print(json.dumps({
        "traces_dir": str(path.resolve()),
        "files": plain["files"],
        "traces": load["traces"],
        "requests": load["requests"],
        "plain_parse_s": round(plain["s"], 2),
        "plain_parse_peak_mib": round(plain["peak_mib"], 1),
        "load_s": round(load["s"], 2),
        "load_peak_mib": round(load["peak_mib"], 1),
        "block_store_mib": round(load["block_store_mib"], 1),
        "load_vs_plain_parse": round(load["s"] / plain["s"], 3),
        # the goal: under 15 s where plain parsing takes ~9 s, i.e. 15/9 of the plain parse of this run
        "limit_load_s": round(15.0 * plain["s"] / 9.0, 2),
        "limit_peak_mib": 1024.0,
        "within_limits": load["s"] < 15.0 * plain["s"] / 9.0 and load["peak_mib"] < 1024.0,
        "within_absolute_15s": load["s"] < 15.0,
    }, indent=1))


if __name__ == "__main__":
    main()
