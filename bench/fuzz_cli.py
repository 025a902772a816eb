"""A campaign of bad and odd inputs against the kvpool CLI, scenario files, --set overrides, trace
files, output paths and the dashboard's input checks; prints one JSON summary.

    unshare -n sh -c 'ip link set lo up && .venv/bin/python bench/fuzz_cli.py [--seed 20261201] [--cases 900]'

Each case runs ``kvpool ARGS`` as its own process in a fresh directory (``ROOT/case-N/a/b/work``, so
a relative escape such as ``../../x`` still lands inside the case's folder and is seen), with
``HOME`` and ``KVPOOL_CACHE_DIR`` in a campaign folder. Every case is bounded by ``BOUND_S``; a
server command (serve, pool up, dashboard) that is still running at its bound is sent SIGINT and
must exit within ``STOP_S``. Outcomes:

* ``clean_error``: exit 2 (or 1 for a runtime failure of a server) and every stderr line an
  ``error:`` line; ``success``: exit 0 (and ``--json`` output strict JSON: no NaN/Infinity);
  ``served``: a server that ran until SIGINT and stopped within the bound; ``interrupted``: a
  long command sent SIGINT (Ctrl-C) at a random moment that stopped within ``STOP_S`` without a
  traceback (and, like every case, left no temporary or partial file behind).
* ``traceback``: a Python traceback on stdout or stderr; ``hang``: past the bound and not stopping
  within ``STOP_S`` of SIGINT; ``over_bound``: past the bound, then stopped cleanly by SIGINT (a
  valid input asking for long work, e.g. 100,000 lanes; listed with the problems); ``unclean``: any other exit status or an error that is not ``error:`` lines;
  ``bad_json``: exit 0 with ``--json`` output that is not strict JSON.
* ``stray_files``: a file created or changed in the case's folder outside the output paths the
  command was given (``--out`` & co., their defaults included); ``overwritten_sources``: an input
  file (scenario, trace, the built-in scenarios) whose bytes changed.

The dashboard's inputs go through its own check functions (``dashboard.knobs``, ``dashboard.ui``)
in one child process, each call bounded by ``BOUND_S`` (an exception other than the error types
those functions promise counts as a traceback).

Deterministic: the cases are a pure function of ``--seed``; the outcome counts depend only on the
code under test (and on a case finishing within the bound).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gzip
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KVPOOL = [str(REPO / ".venv" / "bin" / "kvpool")]
BOUND_S = 30.0
STOP_S = 15.0
SERVER_RUN_S = 12.0
OUTPUT_FLAGS = ("--out", "--run-dir", "--work-dir", "--state-file")
DEFAULT_OUT = {("sim", "run"): "out", ("sim", "compare"): "out", ("sim", "plan"): "out", ("replay",): "out",
               ("calibrate",): "out", ("serve",): "out"}
SMALL = ["--duration", "20", "--set", "workload.synthetic_sessions=3"]
ODD_PORTS: dict[str, int] = {}  # the odd servers' ports by mode (start_odd_servers)


@dataclass
class Case:
    kind: str                                   # the family of the input (for the summary)
    argv: list[str]                             # kvpool's arguments; {D} is the case directory
    files: dict[str, bytes | str] = field(default_factory=dict)   # inputs to create (relative to {D})
    fifo: list[str] = field(default_factory=list)                  # FIFOs to create
    links: dict[str, str] = field(default_factory=dict)            # symlinks name -> target
    server: bool = False                        # runs until interrupted when its input is good
    outs: list[str] = field(default_factory=list)                  # extra output paths (a scenario's own)
    interrupt_s: float | None = None            # send SIGINT this long after the start (Ctrl-C)


# -- inputs -----------------------------------------------------------------------------------------
BASE_TOML = (REPO / "scenarios" / "mi355x-1p1d.toml").read_text()
TINY_TOML = (REPO / "scenarios" / "cpu-tiny.toml").read_text()
TRACE_DIR = REPO / "tests" / "data" / "traces" / "kv-cache-tester"
MOONCAKE = REPO / "tests" / "data" / "traces" / "mooncake-fast25" / "synthetic_trace.jsonl"

ODD_VALUES = [
    "0x10", "0o17", "0b101", "1e-320", "-0", "-0.0", "1_000", "+5", "[]", "[[]]", '"\\u0000"', '"\\u202e"', "inf",
    "+inf", "nan", "-nan", "1e309", "1.7976931348623157e308", "\u0663", "\uff11", '"a"', "{}", "{x = 1}", "1979-05-27",
    "07:32:00", "1979-05-27T07:32:00Z", "true", "false", "[1, 'a']", "'''x'''", '"""a\nb"""', "x" * 5000, "1e3",
    "4294967296", "18446744073709551616", "-9223372036854775809", "0.1e1", "1.", ".5", "5.", "2.000000000000001",
    "[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63,64,65]",
    "[0]", "[-1]", "[78]", "[20, 20, 20]", "[1e3]", '"../../x"', '"/tmp"', '"."', '".."', '"con"', '"a\\tb"', "",
    " ", "=", "==", "#", "1 # c", "'", '"', "[", "]", "{", "1,2", "0.0", "1e-9", "100000", "2147483648", "65536",
    "65537", "1023", "1024", "1025", "4096", "4097", "16777216", "16777217", "604800", "604800.1", "0.999999", "1.0000001",
]
SET_SYNTAX = [
    "noequals", "=5", "a..b=1", ".x=1", "pool.=1", "pool.parts.x=1", "pool=1", "workload=[1]", "pool.ssd=1",
    "model.extra_records=1", "model.extra_records=[{name='x', bytes_per_token=1}]", "seed=1=2", " pool.parts =2",
    "POOL.PARTS=2", "pool.parts=2 # c", "pool.parts=", "seed=", "workload.traces=", "name=", "pool.ssd.x=1",
    "pool.ssd.enabled=1", "gate=false", "__class__=1", "model.__dict__=1", "pool.model_config=1", "\u00e9=1",
    "pool.parts\n=2", "seed=7\nname='x'", "x" * 5000 + "=1", "seed=" + "1" * 4000, "a.b.c.d.e.f.g.h.i.j=1",
    "serve.devices=['cuda:0']", "serve.devices=[]", "serve.devices=['cpu', 1]", "cost.calibration='/dev/zero'",
    "cost.calibration='/nonexistent.json'", "cost.calibration=''", "workload.traces='/dev/zero'",
    "workload.traces='/proc/self/status'", "workload.traces='.'", "workload.preset='nope'",
    "workload.mode='replay'", "workload.token_scale=0.001", "routing.prefill='session_affinity'",
]
NAMES = ["../../x", "/ABS/evil", "a/b", "a\\b", ".", "..", "con", "nul", "x" * 200, "name with spaces", "\u202eevil",
         "emoji \U0001f600", "-rf", "--help", "~", "$HOME", "a\u0000b", "a\nb", "*", "?", "'", "\"", "%s%n", "\u00e9\u0301",
         "CON.txt", " lead", "trail ", "a" * 201, "", "x.json", "out", "..\\..\\x"]


def _toml_set(text: str, key: str, value: str) -> str:
    """``text`` with top-level ``key = value`` replaced (or added before the first table)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.split("=")[0].strip() == key and not line.startswith("["):
            lines[i] = f"{key} = {value}"
            return "\n".join(lines) + "\n"
        if line.startswith("["):
            lines.insert(i, f"{key} = {value}")
            return "\n".join(lines) + "\n"
    return text


def _fields() -> list[str]:
    sys.path.insert(0, str(REPO))
    import typing

    from pydantic import BaseModel

    from kvpool.scenario.model import Scenario

    def leaves(model, prefix=""):
        out = []
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                out += leaves(ann, f"{prefix}{name}.")
            elif not (typing.get_origin(ann) is tuple and any(isinstance(a, type) and issubclass(a, BaseModel)
                                                              for a in typing.get_args(ann))):
                out.append(prefix + name)
        return out

    return leaves(Scenario)


def _bounds() -> dict[str, tuple[object, object]]:
    """(lowest, highest) allowed value of every bounded number field (from the model's metadata)."""
    import annotated_types as at

    from kvpool.scenario.fields import field_info

    out = {}
    for path in _fields():
        info = field_info(path)
        ann = info.annotation
        args = typing_args(ann)
        kind = int if int in args else float if float in args else None
        if kind is None:
            continue
        lo = hi = None
        for m in info.metadata:
            if isinstance(m, at.Ge):
                lo = m.ge
            elif isinstance(m, at.Gt):
                lo = m.gt + (1 if kind is int else 1e-9 * max(1.0, abs(m.gt)))
            elif isinstance(m, at.Le):
                hi = m.le
            elif isinstance(m, at.Lt):
                hi = m.lt - 1 if kind is int else m.lt
        if lo is not None and hi is not None:
            out[path] = (kind(lo), kind(hi))
    return out


def typing_args(ann) -> tuple:
    import typing

    seen, stack = [], [ann]
    while stack:
        a = stack.pop()
        if typing.get_origin(a) is typing.Annotated:
            stack.append(typing.get_args(a)[0])
        elif typing.get_args(a) and typing.get_origin(a) is not tuple:
            stack.extend(typing.get_args(a))
        else:
            seen.append(a)
    return tuple(seen)


def _weka(rng: random.Random) -> dict:
    """A small valid Weka trace."""
    n = rng.randint(1, 4)
    reqs, t, ids = [], 0.0, []
    for _ in range(n):
        add = rng.randint(1, 6)
        ids = ids + list(range(len(ids), len(ids) + add))
        reqs.append({"t": t, "type": "n", "in": 64 * len(ids), "out": rng.randint(1, 50), "hash_ids": list(ids),
                     "api_time": 0.5, "think_time": 0.0})
        t += rng.uniform(1, 20)
    return {"id": f"t{rng.randint(0, 999)}", "block_size": 64, "hash_id_scope": "local", "requests": reqs}


def _break_weka(rng: random.Random, doc: dict) -> dict | list | str | int:
    d = json.loads(json.dumps(doc))
    r = d["requests"][rng.randrange(len(d["requests"]))]
    choice = rng.randrange(34)
    if choice == 0:
        r["hash_ids"] = [str(x) for x in r["hash_ids"]]
    elif choice == 1:
        r["hash_ids"] = [float(x) for x in r["hash_ids"]]
    elif choice == 2:
        r["hash_ids"] = [2**63] * len(r["hash_ids"])
    elif choice == 3:
        r["hash_ids"] = [2**64 + 1] * len(r["hash_ids"])
    elif choice == 4:
        r["t"] = -1
    elif choice == 5:
        r["t"] = "1"
    elif choice == 6:
        d["requests"] = []
    elif choice == 7:
        d["block_size"] = 2**40
    elif choice == 8:
        d["block_size"] = 1
        r["in"] = 5_000_000
        r["hash_ids"] = list(range(5_000_000))[:10]
    elif choice == 9:
        nested: dict = {"t": 1, "type": "subagent", "requests": []}
        cur = nested
        for _ in range(rng.choice([5, 60, 400])):
            inner = {"t": 1, "type": "subagent", "requests": []}
            cur["requests"].append(inner)
            cur = inner
        d["requests"].append(nested)
    elif choice == 10:
        d["requests"].append({"t": 5, "type": "subagent", "requests": [dict(r, t=0)], "duration_ms": -5})
    elif choice == 11:
        d["requests"].append({"t": 5, "type": "subagent", "requests": [dict(r, t=0)], "duration_ms": 1e300})
    elif choice == 12:
        d["id"] = ""
    elif choice == 13:
        d["id"] = {"a": 1}
    elif choice == 14:
        d["id"] = "x" * 5000
    elif choice == 15:
        d["hash_id_scope"] = "global" if rng.random() < 0.5 else "planet"
    elif choice == 16:
        r["api_time"] = float("1e300")
    elif choice == 17:
        r["api_time"] = -1
    elif choice == 18:
        r["think_time"] = None
    elif choice == 19:
        r["in"] = -64
    elif choice == 20:
        r["in"] = True
    elif choice == 21:
        r["out"] = 2**31
    elif choice == 22:
        del r["hash_ids"]
    elif choice == 23:
        r["extra"] = {"nested": [1] * 10}
    elif choice == 24:
        d["models"] = "not-a-list"
    elif choice == 25:
        d["models"] = [1, None, {}]
    elif choice == 26:
        return [d, d]
    elif choice == 27:
        return "a string"
    elif choice == 28:
        return 5
    elif choice == 29:
        d["requests"] = {"0": r}
    elif choice == 30:
        d["requests"].reverse()
        d["requests"][0]["t"] = 1e9
    elif choice == 31:
        r["type"] = "unknown"
    elif choice == 32:
        r["hash_ids"] = r["hash_ids"][:1] + [None]
    else:
        d["block_size"] = 0
    return d


def _mooncake_rows(rng: random.Random) -> str:
    rows = [json.loads(x) for x in MOONCAKE.read_text().splitlines()[:6]]
    r = rows[rng.randrange(len(rows))]
    choice = rng.randrange(12)
    if choice == 0:
        r["timestamp"] = -5
    elif choice == 1:
        r["hash_ids"] = "x"
    elif choice == 2:
        r["input_length"] = 10**12
    elif choice == 3:
        r["output_length"] = -1
    elif choice == 4:
        del r["timestamp"]
    elif choice == 5:
        r["timestamp"] = 1e300
    elif choice == 6:
        r["hash_ids"] = [-1]
    elif choice == 7:
        r["input_length"] = 1
    elif choice == 8:
        r["timestamp"] = float("nan")
    elif choice == 9:
        rows.reverse()
    elif choice == 10:
        r["hash_ids"] = list(range(100_000))
        r["input_length"] = 512 * 100_000
    else:
        r["extra"] = True
    return "\n".join(json.dumps(x) for x in rows) + "\n"


def make_cases(seed: int, n: int) -> list[Case]:
    rng = random.Random(seed)
    fields = _fields()
    bounds = _bounds()
    cases: list[Case] = []

    def add(c: Case) -> None:
        cases.append(c)

    # fixed cases: the leftovers and bounds worth one run each
    for sets in (["workload.synthetic_sessions=1024"], ["workload.synthetic_sessions=102", "workload.context_scale=10"],
                 ["workload.synthetic_sessions=512", "workload.context_scale=2"],
                 ["workload.shared_prefix_tokens=16777216", "workload.max_context_tokens=16777216"]):
        add(Case("bound", ["sim", "run", "mi355x-1p1d", "--sessions", "2", "--duration", "20", "--json",
                           *[a for s in sets for a in ("--set", s)]]))
    for flag, value in (("--seed", "1.0"), ("--seed", "+3"), ("--workers", "2.0"), ("--out", ""), ("--out", "-")):
        add(Case("flag", ["sim", "run", "mi355x-1p1d", "--sessions", "1", *SMALL, flag, value]))
    add(Case("server", ["serve", "cpu-tiny", "--port", "0", "--run-dir", "{D}/run"], server=True))
    add(Case("server", ["pool", "up", "--services", "1", "--gib-per-service", "0.01", "--work-dir", "{D}/pw",
                        "--state-file", "{D}/state.json"], server=True))
    add(Case("server", ["dashboard", "--port", "8599"], server=True))

    makers = [
        (22, "set"), (10, "set_syntax"), (12, "set_run"), (12, "toml"), (6, "toml_file"), (10, "trace"),
        (4, "trace_convert"), (4, "mooncake"), (8, "sim_flags"), (4, "plan"), (3, "compare"), (3, "synth"),
        (4, "out_paths"), (3, "server_flags"), (3, "replay"), (2, "pool_status"), (8, "bound_run"),
        (6, "interrupt"), (4, "odd_server"),
    ]
    weights = [w for w, _ in makers]
    while len(cases) < n:
        kind = rng.choices([k for _, k in makers], weights)[0]
        if kind == "set":
            f, v = rng.choice(fields), rng.choice(ODD_VALUES)
            cmd = rng.choice([["scenario", "validate"], ["scenario", "show", "--json"], ["scenario", "show"]])
            add(Case(kind, [*cmd[:2], "mi355x-1p1d", *cmd[2:], "--set", f"{f}={v}"]))
        elif kind == "bound_run":
            path = rng.choice(sorted(bounds))
            lo, hi = bounds[path]
            v = rng.choice([lo, hi])
            text = repr(v) if isinstance(v, float) else str(v)
            add(Case(kind, ["sim", "run", rng.choice(["mi355x-1p1d", "mi350x-6p2d-shared", "h200-1p1d"]), "--sessions", "2",
                            *SMALL, "--json", "--set", f"{path}={text}"]))
        elif kind == "odd_server":
            mode = rng.choice(ODD_SERVER_MODES)
            argv = ["replay", "cpu-tiny", "--url", f"http://127.0.0.1:{{PORT:{mode}}}", "--duration", "4",
                    "--timeout", rng.choice(["3", "5"]), "--out", "r", "--json"]
            add(Case(kind, argv))
        elif kind == "interrupt":
            cmd = rng.choice([
                ["sim", "run", "mi355x-1p1d", "--sessions", "4,8", "--duration", "900", "--set", "workload.synthetic_sessions=40"],
                ["sim", "compare", "mi350x-6p2d-shared", "mi350x-6p2d-split", "--sessions", "8", "--duration", "600",
                 "--set", "workload.synthetic_sessions=20"],
                ["trace", "synth", "--preset", "agentx-062126", "--sessions", "60", "--out", rng.choice(["s.jsonl.gz", "sd"])],
                ["trace", "convert", str(TRACE_DIR), "--to", "mooncake", "--out", "m.jsonl"],
                ["sim", "plan", "mi355x-1p1d", "--target", "reuse>=0.9", "--vary", "pool.gib_per_service=1..768",
                 "--duration", "300", "--set", "workload.synthetic_sessions=10", "--workers", "1"],
            ])
            add(Case(kind, cmd, interrupt_s=round(rng.uniform(0.3, 6.0), 2)))
        elif kind == "set_syntax":
            add(Case(kind, ["scenario", "validate", rng.choice(["mi355x-1p1d", "cpu-tiny"]), "--set", rng.choice(SET_SYNTAX)]))
        elif kind == "set_run":
            f, v = rng.choice(fields), rng.choice(ODD_VALUES[:60] + ["2", "0.5", "1", "8"])
            add(Case(kind, ["sim", "run", "mi355x-1p1d", "--sessions", "2", *SMALL, "--json", "--set", f"{f}={v}"]))
        elif kind in ("toml", "toml_file"):
            text = BASE_TOML
            if kind == "toml":
                op = rng.randrange(6)
                if op == 0:
                    name = rng.choice(NAMES).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\0", "\\u0000")
                    text = _toml_set(text, "name", f'"{name}"')
                elif op == 1:
                    text = _toml_set(text, "description", f'"{rng.choice(NAMES)[:50]}"'.replace("\n", "\\n").replace("\0", ""))
                elif op == 2:
                    lines = text.splitlines()
                    i = rng.randrange(len(lines))
                    del lines[i]
                    text = "\n".join(lines)
                elif op == 3:
                    lines = text.splitlines()
                    i = rng.randrange(len(lines))
                    lines.insert(i, lines[rng.randrange(len(lines))])
                    text = "\n".join(lines)
                elif op == 4:
                    bpt = rng.choice(["1", "0", "1048577", '"8"', "true"])
                    ids = rng.choice(["[0, 0]", "[1039]", "[1040]", "[]", "[-1]", "[1.5]"])
                    text = text + f'\n[[model.extra_records]]\nname = "r{rng.randrange(3)}"\nbytes_per_token = {bpt}\nlayer_ids = {ids}\n'
                else:
                    b = bytearray(text.encode())
                    for _ in range(rng.randint(1, 4)):
                        b[rng.randrange(len(b))] = rng.randrange(256)
                    text = bytes(b)
                data = text if isinstance(text, bytes) else text.encode()
            else:
                op = rng.randrange(9)
                data = [b"", b"\xef\xbb\xbf", BASE_TOML.encode("utf-16"), BASE_TOML.replace("\n", "\r").encode(),
                        b"\x00" * 1000, b"a = 1\n" * 300_000, b"[" * 20 + b"x" + b"]" * 20, b"x = " + b"[" * 50 + b"]" * 50,
                        BASE_TOML.encode() + b"\n[pool]\nmode='shared'\n"][op]
            name = rng.choice(["s.toml", "s", "s.TOML", "dir/s.toml", ".s.toml", "s toml.toml"])
            cmd = rng.choice([["scenario", "validate"], ["scenario", "show", "--json"],
                              ["sim", "run", "--sessions", "2", *SMALL, "--json"]])
            at = 2 if cmd[0] == "scenario" else 2
            argv = cmd[:at] + [name] + cmd[at:]
            add(Case(kind, argv, files={name: data}, outs=["out"]))
        elif kind == "trace":
            docs = [_weka(rng) for _ in range(rng.randint(1, 3))]
            docs[0] = _break_weka(rng, docs[0])
            layout = rng.randrange(4)
            if layout == 0:
                files = {"t.json": json.dumps(docs[0])}
                path = "t.json"
            elif layout == 1:
                files = {"t.jsonl": "\n".join(json.dumps(d) for d in docs) + "\n"}
                path = "t.jsonl"
            elif layout == 2:
                files = {f"tr/{i}.json.gz": gzip.compress(json.dumps(d).encode()) for i, d in enumerate(docs)}
                path = "tr"
            else:
                files = {"t.jsonl.gz": gzip.compress(("\n".join(json.dumps(d) for d in docs) + "\n").encode())}
                path = "t.jsonl.gz"
            cmd = rng.choice([["trace", "stats", path, "--json"], ["trace", "stats", path],
                              ["sim", "run", "mi355x-1p1d", "--sessions", "1", "--duration", "20", "--traces", path, "--json"]])
            add(Case(kind, cmd, files=files))
        elif kind == "trace_convert":
            doc = _weka(rng)
            if rng.random() < 0.5:
                doc = _break_weka(rng, doc)
            files = {"src.jsonl": json.dumps(doc) + "\n"}
            out = rng.choice(["o.jsonl", "src.jsonl", "./src.jsonl", "o.json", "o.jsonl.gz", "d/o.jsonl", "link.jsonl"])
            links = {"link.jsonl": "src.jsonl"} if out == "link.jsonl" else {}
            argv = ["trace", "convert", "src.jsonl", "--to", rng.choice(["mooncake", "weka", "Mooncake", ""]), "--out", out]
            if rng.random() < 0.3:
                argv += ["--stagger-s", rng.choice(["1e300", "-0", "86400", "86401", "1e-300", "nan"])]
            if rng.random() < 0.3:
                argv.append("--force")
            add(Case(kind, argv, files=files, links=links))
        elif kind == "mooncake":
            files = {"m.jsonl": _mooncake_rows(rng)}
            cmd = rng.choice([["trace", "stats", "m.jsonl", "--json"],
                              ["trace", "convert", "m.jsonl", "--to", "weka", "--out", "w.jsonl"],
                              ["sim", "run", "mi355x-1p1d", "--rps", "0.5", "--duration", "20", "--set",
                               "workload.mode='replay'", "--traces", "m.jsonl", "--json"]])
            add(Case(kind, cmd, files=files))
        elif kind == "sim_flags":
            flag = rng.choice(["--sessions", "--rps", "--duration", "--seed", "--workers", "--executor", "--address",
                               "--traces"])
            vals = {"--sessions": ["1,,2", "0", "-1", "1e3", "56;72", "\uff11", " ", "1," * 300, "2,2", "0x10", "1.5",
                                   "100001", "3,100000"],
                    "--rps": ["0", "1e-300", "nan", "1,2,", "1e4", "10001", "0.5,0.5", "-1"],
                    "--duration": ["1e-9", "0.001", "604801", "1e400", "-0", "20s"],
                    "--seed": ["-0", "4294967296", "007", "1" * 40, "٣"],
                    "--workers": ["-1", "100000", "3"],
                    "--executor": ["ray", "RAY", "", "threads"],
                    "--address": ["", "x:y:z", "127.0.0.1:1", "ray://", "auto"],
                    "--traces": ["", "/dev/null", "/dev/zero", "/proc/self/status", ".", "nope", "fifo", "loop"]}[flag]
            v = rng.choice(vals)
            argv = ["sim", "run", "mi355x-1p1d", *(["--sessions", "1"] if flag not in ("--sessions", "--rps") else []),
                    *SMALL, flag, v, "--json"]
            if flag == "--address":
                argv += ["--executor", "ray"]
            add(Case(kind, argv, fifo=["fifo"] if v == "fifo" else [], links={"loop": "loop"} if v == "loop" else {}))
        elif kind == "plan":
            target = rng.choice(["reuse>=0.95", "reuse>=1e", "x>=1", "reuse=>1", "reuse>=nan", "ttft_p90_s<=inf",
                                 "reuse>=0.5 reuse<=0.4", "", ">=1", "reuse>=" + "9" * 400])
            vary = rng.choice(["pool.gib_per_service=64..768", "pool.gib_per_service=768..64", "cluster.servers=1..1",
                               "decode.max_seqs=1..256", "seed=0..10", "name=a..b", "pool.mode=1..2", "workload.sessions=1..3",
                               "pool.gib_per_service=nan..1", "pool.gib_per_service=0..1e308", "pool.parts=1..99999999999"])
            argv = ["sim", "plan", "mi355x-1p1d", "--target", target, "--vary", vary, "--duration", "20",
                    "--set", "workload.synthetic_sessions=3", "--max-runs", rng.choice(["2", "0", "-1", "1000"]), "--json"]
            if rng.random() < 0.3:
                argv += ["--load", rng.choice(["0", "nan", "1", "1e9"])]
            add(Case(kind, argv))
        elif kind == "compare":
            arms = rng.choice([["mi355x-1p1d"], ["mi355x-1p1d", "mi355x-1p1d"], ["mi355x-1p1d", "cpu-tiny"],
                               ["mi355x-1p1d", "nope"], ["mi355x-1p1d", "s.toml"]])
            add(Case(kind, ["sim", "compare", *arms, "--sessions", "1", *SMALL, "--json"],
                     files={"s.toml": _toml_set(BASE_TOML, "name", '"../../cmp"')}))
        elif kind == "synth":
            argv = ["trace", "synth", "--preset", rng.choice(["agentx-062126", "kv-cache-tester", "x", ""]),
                    "--sessions", rng.choice(["1", "0", "1025", "2", "1e1"]), "--seed", rng.choice(["0", "-1", "4294967296"]),
                    "--out", rng.choice(["s.jsonl", "s.jsonl.gz", "d", "s.json", "existing.jsonl", "f/x.jsonl"]),
                    "--context-scale", rng.choice(["1", "0", "10", "10.5", "nan"])]
            add(Case(kind, argv, files={"existing.jsonl": "keep me\n", "f": "a file"}))
        elif kind == "out_paths":
            out = rng.choice(["file", "file/sub", "x.jsonl", "{D}/abs", ".", "..", "a\nb", "d" * 300, "link_out",
                              "/proc/self/nope", "/dev/null", "ok"])
            cmd = rng.choice([["sim", "run", "mi355x-1p1d", "--sessions", "1", *SMALL],
                              ["sim", "compare", "mi355x-1p1d", "h200-1p1d", "--sessions", "1", *SMALL],
                              ["replay", "cpu-tiny", "--url", "http://127.0.0.1:9"]])
            add(Case(kind, [*cmd, "--out", out], files={"file": "a file", "x.jsonl/keep": "x"},
                     links={"link_out": "outside_target"}))
        elif kind == "server_flags":
            cmd = rng.choice([
                ["serve", "cpu-tiny", "--port", rng.choice(["-1", "65536", "99999", "abc", "1e3"])],
                ["serve", "cpu-tiny", "--devices", rng.choice(["cuda:99", "", "cpu,,cpu", "tpu", "cpu" * 100]),
                 "--run-dir", "r"],
                ["serve", "cpu-tiny", "--pool", rng.choice(["bogus", "", "MOONCAKE"]), "--run-dir", "r"],
                ["serve", "cpu-tiny", "--pool-address", rng.choice(["::1:", "h:p:x", "127.0.0.1:0", "", "[::1]:99999"]),
                 "--run-dir", "r"],
                ["serve", "cpu-tiny", "--on-worker-exit", rng.choice(["restart", "x", ""]), "--run-dir", "r"],
                ["serve", "mi355x-1p1d", "--run-dir", "r"],
                ["pool", "up", "--services", rng.choice(["0", "100000", "-1"]), "--work-dir", "pw"],
                ["pool", "up", "--gib-per-service", rng.choice(["1e-30", "0", "inf", "65537"]), "--work-dir", "pw"],
                ["pool", "up", "--lease-ttl-ms", rng.choice(["-5", "99999999999999"]), "--work-dir", "pw"],
                ["dashboard", "--port", rng.choice(["-1", "70000", "x"])],
            ])
            add(Case(kind, cmd))
        elif kind == "replay":
            argv = ["replay", "cpu-tiny", "--url", rng.choice(["http://127.0.0.1:9", "ftp://x", "http://[::1", "",
                                                               "http://10.255.255.1:80", "127.0.0.1:9"]),
                    "--duration", "5", "--out", "r"]
            if rng.random() < 0.5:
                argv += [rng.choice(["--timeout", "--token-scale", "--rps", "--sessions"]),
                         rng.choice(["0", "-1", "nan", "1e9", "auto", "x"])]
            add(Case(kind, argv))
        elif kind == "pool_status":
            add(Case(kind, ["pool", "status", "--state-file", rng.choice(["nope.json", "bad.json", "fifo", "/dev/zero"]),
                            "--timeout-s", rng.choice(["1", "0", "601", "nan"])],
                     files={"bad.json": '{"master": 5}'}, fifo=["fifo"]))
    return cases[:n]


# -- a server that answers oddly (kvpool replay's input) ---------------------------------------------
ODD_SERVER_MODES = ("silent", "garbage", "text_not_string", "notjson", "nan_usage", "negative_usage", "too_many_tokens",
                    "err500_html", "huge_line", "no_done", "slow_drip", "bad_record", "redirect")


def _odd_answer(mode: str) -> bytes:
    sse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
    tok = b'data: {"choices": [{"text": "a", "token_ids": [1], "finish_reason": null}]}\n\n'
    if mode == "garbage":
        return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\n{nope"
    if mode == "text_not_string":
        return sse + b'data: {"choices": [{"text": 5}]}\n\ndata: [DONE]\n\n'
    if mode == "notjson":
        return b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc"
    if mode == "nan_usage":
        return sse + tok + b'data: {"choices": [], "usage": {"completion_tokens": NaN}}\n\ndata: [DONE]\n\n'
    if mode == "negative_usage":
        return sse + tok + b'data: {"choices": [], "usage": {"completion_tokens": -5}}\n\ndata: [DONE]\n\n'
    if mode == "too_many_tokens":
        return sse + tok + b'data: {"choices": [], "usage": {"completion_tokens": 99999999}}\n\ndata: [DONE]\n\n'
    if mode == "err500_html":
        return b"HTTP/1.1 500 Oops\r\nContent-Type: text/html\r\nContent-Length: 14\r\n\r\n<html>x</html>"
    if mode == "no_done":
        return sse + tok
    if mode == "bad_record":
        return sse + tok + (b'data: {"choices": [], "kvpool": {"record": {"gpu_tokens": -9, "restore_stage_s": [1e400], '
                            b'"handoff_s": -1, "prefill": "x", "rejected": 5}}}\n\ndata: [DONE]\n\n')
    if mode == "redirect":
        return b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:9/\r\nContent-Length: 0\r\n\r\n"
    return b""


def start_odd_servers() -> dict[str, int]:
    """One thread per mode answering /v1/models well and /v1/completions oddly; mode -> port."""
    import socket
    import threading

    models = b'{"object": "list", "data": [{"id": "refmodel-tiny", "object": "model"}]}'

    def handle(c: socket.socket, mode: str) -> None:
        try:
            c.settimeout(60)
            req = c.recv(65536)
            if b"/v1/models" in req.split(b"\r\n", 1)[0]:
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                          b"Connection: close\r\n\r\n" % len(models) + models)
            elif mode == "silent":
                time.sleep(40)
            elif mode == "huge_line":
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: ")
                for _ in range(2000):
                    c.sendall(b"x" * 65536)
            elif mode == "slow_drip":
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
                for _ in range(40):
                    c.sendall(b": keep-alive\n\n")
                    time.sleep(1)
            else:
                c.sendall(_odd_answer(mode))
        except OSError:
            pass
        finally:
            c.close()

    def serve(s: socket.socket, mode: str) -> None:
        while True:
            c, _ = s.accept()
            threading.Thread(target=handle, args=(c, mode), daemon=True).start()

    ports = {}
    for mode in ODD_SERVER_MODES:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        ports[mode] = s.getsockname()[1]
        threading.Thread(target=serve, args=(s, mode), daemon=True).start()
    return ports


# -- running ----------------------------------------------------------------------------------------
def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            try:
                st = p.lstat()
            except OSError:
                continue
            key = str(p.relative_to(root))
            if p.is_symlink():
                out[key] = "link:" + os.readlink(p)
            elif p.is_file():
                h = hashlib.sha256()
                with p.open("rb") as f:
                    h.update(f.read(1 << 20))
                out[key] = f"{st.st_size}:{h.hexdigest()[:16]}"
            else:
                out[key] = "special"
    return out


def _under(rel: str, outs: list[Path], root: Path) -> bool:
    p = (root / rel).resolve() if not os.path.islink(root / rel) else (root / rel).parent.resolve() / Path(rel).name
    for o in outs:
        try:
            p.relative_to(o)
            return True
        except ValueError:
            continue
    return False


def _strict_json(text: str) -> bool:
    def refuse(_name):
        raise ValueError("not JSON")

    try:
        json.loads(text, parse_constant=refuse)
        return True
    except ValueError:
        return False


def run_case(i: int, c: Case, root: Path, env: dict[str, str]) -> dict:
    case_root = root / f"case-{i:04d}"
    d = case_root / "a" / "b" / "work"
    d.mkdir(parents=True)
    (case_root / "outside_target").mkdir()
    for name, data in c.files.items():
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    for name in c.fifo:
        os.mkfifo(d / name)
    for name, target in c.links.items():
        os.symlink(target, d / name)
    argv = [a.replace("{D}", str(d)) for a in c.argv]
    for mode, port in ODD_PORTS.items():
        argv = [a.replace(f"{{PORT:{mode}}}", str(port)) for a in argv]
    before = _snapshot(case_root)
    sources = {k: v for k, v in before.items() if k.startswith("a/b/work/")}
    t0 = time.monotonic()
    p = subprocess.Popen(KVPOOL + argv, cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    outcome, interrupted = None, False
    try:
        out, err = p.communicate(timeout=c.interrupt_s or (SERVER_RUN_S if c.server else BOUND_S))
    except subprocess.TimeoutExpired:
        interrupted = True
        os.killpg(p.pid, signal.SIGINT)
        try:
            out, err = p.communicate(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            outcome = "hang"
    took = time.monotonic() - t0
    text_out, text_err = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    rc = p.returncode
    if outcome is None:
        if "Traceback (most recent call last)" in text_out + text_err:
            outcome = "traceback"
        elif interrupted and c.interrupt_s is not None:
            # Ctrl-C: "aborted" and status 130 (or the command's own clean stop), nothing half-written
            outcome = "interrupted" if rc in (0, 130, 2, -signal.SIGINT) and "Traceback" not in text_err else "unclean"
        elif interrupted and not c.server:
            # past the bound: a valid input that asks for long work (Ctrl-C stopped it cleanly), or a hang
            outcome = "over_bound" if rc in (130, -signal.SIGINT) and "Traceback" not in text_err else "hang"
        elif interrupted:
            outcome = "served" if rc in (0, 130) else "unclean"
        elif rc == 0:
            outcome = "bad_json" if "--json" in argv and not _strict_json(text_out) else "success"
        elif rc in (1, 2):
            lines = [line for line in text_err.splitlines() if line.strip()]
            errs = [line for line in lines if line.startswith("error:")]
            # a server's own log lines may precede its error; a CLI error is error: lines only
            ok = errs and (len(errs) == len(lines) or c.server or argv[0] in ("serve", "pool", "replay", "calibrate"))
            if rc == 1 and argv[:2] == ["sim", "plan"] and "no value" in text_err + text_out:
                ok = True  # a plan that found no value meeting the targets: its documented exit 1
            outcome = "clean_error" if ok else "unclean"
        else:
            outcome = "unclean"
    # outputs the command was given (and its default), relative to its directory
    outs = []
    for flag in OUTPUT_FLAGS:
        for k, a in enumerate(argv[:-1]):
            if a == flag:
                outs.append((d / argv[k + 1]).resolve() if argv[k + 1] else d)
    for prefix, default in DEFAULT_OUT.items():
        if tuple(argv[: len(prefix)]) == prefix and "--out" not in argv:
            outs.append(d / default)
    if argv[:2] == ["trace", "convert"] or argv[:2] == ["trace", "synth"]:
        pass  # their --out is in OUTPUT_FLAGS
    outs += [d / o for o in c.outs]
    after = _snapshot(case_root)
    stray = sorted(k for k, v in after.items() if before.get(k) != v and k not in sources and not _under(k, outs, case_root))
    # a temporary file left behind (an atomic write that was cut short and not cleaned up)
    stray += sorted(k for k in after if k not in before and (".tmp" in Path(k).name or Path(k).name.startswith(".")))
    overwritten = sorted(k for k, v in sources.items() if after.get(k) != v and not _under(k, outs, case_root))
    shutil.rmtree(case_root, ignore_errors=True)
    return {"i": i, "kind": c.kind, "argv": [a[:120] for a in argv], "rc": rc, "outcome": outcome, "s": round(took, 2),
            "stray": stray[:5], "overwritten": overwritten[:5],
            "tail": (text_err.strip().splitlines() or [""])[-1][:300] if outcome not in ("success", "served") else ""}


# -- the dashboard's inputs ---------------------------------------------------------------------------
DASHBOARD_CHILD = r'''
import json, random, signal, sys, tomllib
sys.path.insert(0, sys.argv[1])
from dashboard import knobs, ui
from kvpool.errors import UserError
from kvpool.scenario import ScenarioError
seed, n, bound = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
rng = random.Random(seed)
odd = json.loads(sys.argv[5])
base_raw, base_label = knobs.parse_upload(open(sys.argv[1] + "/scenarios/mi355x-1p1d.toml", "rb").read(), "mi355x-1p1d.toml")
counts = {"clean_error": 0, "success": 0, "traceback": 0, "hang": 0}
examples = []
def alarm(*_):
    raise TimeoutError("bound")
signal.signal(signal.SIGALRM, alarm)
values = [float("nan"), float("inf"), -1, 0, 10**9, 2**70, 1e308, True, "3", None, [], 1.5, -0.0, 5, 100_001, 1025]
for i in range(n):
    op = rng.randrange(5)
    signal.alarm(int(bound))
    try:
        if op == 0:
            data = rng.choice([b"", b"\xff\xfe", b"a=1", b"[x]\n[x]", b"name='x'", ("x = " + "[" * 30 + "]" * 30).encode(),
                               open(sys.argv[1] + "/scenarios/cpu-tiny.toml", "rb").read()[: rng.randrange(2000)]])
            knobs.parse_upload(data, rng.choice(["u.toml", "../x.toml", "a\nb"]))
        elif op == 1:
            knob = rng.choice(knobs.KNOBS)
            shown = rng.choice(values + odd[:40])
            value = knobs.model_value(knob, shown)
            ov = knobs.knob_overrides(knobs.edited(base_raw, [], base_label), {knob.path: value}) if not isinstance(value, float) or value == value else [f"{knob.path}=nan"]
            knobs.edited(base_raw, ov, base_label)
        elif op == 2:
            lines = knobs.parse_override_lines("\n".join(rng.choice(odd + ["seed=1", "# c", "pool.parts=2"]) for _ in range(3)))
            knobs.edited(base_raw, lines, base_label)
        elif op == 3:
            triples = [(rng.choice(["workload.duration_s", "workload.synthetic_sessions", "workload.rps", "workload.sessions",
                                    "seed"]), rng.choice(values), "input")]
            errs = ui.field_errors(triples)
            if errs:
                raise UserError(errs[0])
        else:
            s = ui.RunSettings(loads=[rng.choice([1.0, 0.0, -1.0, float("nan"), 1e9, 2.5])],
                               duration_s=rng.choice([None, 1e-9, 60.0, float("nan"), 1e12]),
                               synthetic_sessions=rng.choice([None, 3, 0, 1025, 10**9]), workers=1,
                               key=rng.choice(["sessions", "rps"]))
            text = open(sys.argv[1] + "/scenarios/mi355x-1p1d.toml").read()
            if rng.random() < 0.5:
                text = text.replace('[workload]', '[workload]\ntraces = "' + rng.choice(["/dev/zero", "/nonexistent", ".", "/proc/self/status"]) + '"', 1)
            got, errs = ui.scenario_for_run(text, "edited", s)
            if errs:
                raise UserError(errs[0])
        counts["success"] += 1
    except (ScenarioError, UserError, ValueError) as e:
        # ValueError: the one other error type the knob helpers document for a mistyped value
        if type(e) is ValueError:
            counts["traceback"] += 1
            examples.append(f"op {op}: ValueError: {str(e)[:200]}")
        else:
            counts["clean_error"] += 1
    except TimeoutError:
        counts["hang"] += 1
        examples.append(f"op {op}: past the bound")
    except Exception as e:
        counts["traceback"] += 1
        examples.append(f"op {op}: {type(e).__name__}: {str(e)[:200]}")
    finally:
        signal.alarm(0)
print(json.dumps({"counts": counts, "examples": examples[:10]}))
'''


def run_dashboard(seed: int, n: int, env: dict[str, str]) -> dict:
    try:
        p = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", DASHBOARD_CHILD, str(REPO), str(seed), str(n), str(BOUND_S),
                            json.dumps(ODD_VALUES + SET_SYNTAX)], capture_output=True, text=True,
                           timeout=BOUND_S * n + 60, env=env, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return {"counts": {"hang": n}, "examples": ["the child passed its bound"]}
    if p.returncode != 0:
        return {"counts": {"traceback": n}, "examples": [p.stderr[-500:]]}
    return json.loads(p.stdout.strip().splitlines()[-1])


# -- main ---------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--cases", type=int, default=900)
    ap.add_argument("--dashboard-cases", type=int, default=300)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated case kinds to run (default: all)")
    ap.add_argument("--details", default="", help="write every case's outcome here (JSON lines)")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="kvpool-fuzz-"))
    home = root / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL", "PYTHONHASH"))}
    env.update({"HOME": str(home), "KVPOOL_CACHE_DIR": str(home / "cache"), "MPLCONFIGDIR": str(home / "mpl"),
                "PYTHONPATH": str(REPO), "NO_COLOR": "1", "COLUMNS": "120", "TERM": "dumb"})
    builtins_before = _snapshot(REPO / "scenarios")
    ODD_PORTS.update(start_odd_servers())
    cases = make_cases(args.seed, args.cases)
    if args.only:
        keep = set(args.only.split(","))
        cases = [c for c in cases if c.kind in keep]
    t0 = time.monotonic()
    results = []
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_case, i, c, root, env) for i, c in enumerate(cases)]
        for f in cf.as_completed(futures):
            results.append(f.result())
    results.sort(key=lambda r: r["i"])
    dash = run_dashboard(args.seed, args.dashboard_cases, env) if args.dashboard_cases else {"counts": {}, "examples": []}
    builtins_after = _snapshot(REPO / "scenarios")
    counts: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        by_kind.setdefault(r["kind"], {}).setdefault(r["outcome"], 0)
        by_kind[r["kind"]][r["outcome"]] += 1
    stray = [r for r in results if r["stray"]]
    over = [r for r in results if r["overwritten"]]
    bad = [r for r in results if r["outcome"] in ("traceback", "hang", "over_bound", "unclean", "bad_json")]
    summary = {
        "seed": args.seed, "cases": len(results), "bound_s": BOUND_S, "wall_s": round(time.monotonic() - t0, 1),
        "outcomes": dict(sorted(counts.items())),
        "clean_errors": counts.get("clean_error", 0), "successful_runs": counts.get("success", 0) + counts.get("served", 0),
        "clean_interrupts": counts.get("interrupted", 0),
        "tracebacks": counts.get("traceback", 0) + dash["counts"].get("traceback", 0),
        "hangs": counts.get("hang", 0) + dash["counts"].get("hang", 0),
        "over_bound": counts.get("over_bound", 0),
        "unclean": counts.get("unclean", 0), "bad_json": counts.get("bad_json", 0),
        "files_outside_out": len(stray), "overwritten_sources": len(over) + (builtins_before != builtins_after),
        "slowest_s": max((r["s"] for r in results), default=0),
        "by_kind": dict(sorted(by_kind.items())),
        "dashboard": dash,
        "problems": [{k: r[k] for k in ("i", "kind", "argv", "rc", "outcome", "s", "stray", "overwritten", "tail")}
                     for r in (bad + stray + over)][:60],
    }
    if args.details:
        Path(args.details).write_text("\n".join(json.dumps(r) for r in results) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
