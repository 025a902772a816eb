"""``kvpool serve`` and ``kvpool replay`` as real processes on loopback, for the acceptance tests.

``start_serve(run_dir, sets, pool=...)`` starts ``kvpool serve cpu-tiny --port 0`` through
``backend.serve.launch.start_serve`` (its own process group, ``run_dir/router.ready.json`` awaited
within ``START_BOUND_S``); ``RealServe.stop()`` sends SIGTERM, waits for the exit status and asserts
that every process the ready file names (the supervisor, every worker, every pool process) is gone. ``start_replay`` runs ``kvpool replay ... --json`` as a
process; ``Replay.finish()`` waits for it (bounded) and returns its summary document and records.
``multi_turn_session(url, sets, seed, user)`` sends a three-turn session (turn 2 from the GPU prefix
cache, turn 3 from the pool after prompts that evict it) and asserts every answer equals the
no-cache recompute.
A Mooncake deployment needs a private network namespace (``require_private_netns``: the test fails,
never skips, outside one) and ``mooncake_master`` beside this Python or on ``PATH``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool.backend.serve import launch
from kvpool.backend.serve.launch import ServeProcess

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "tests" / "data" / "traces" / "kv-cache-tester"
CLI = "import sys; from kvpool.cli import main; main(sys.argv[1:])"
MODEL = "refmodel-tiny"
#: Longest a deployment may take to write router.ready.json (a start takes ~10 s on 2 shared cores).
START_BOUND_S = 120.0
#: Longest the supervisor may take to exit after SIGTERM (drain of an idle router, children's SIGTERM).
STOP_BOUND_S = 30.0
#: Longest the processes the ready file names may linger after the supervisor's exit (reaping).
GONE_BOUND_S = 5.0
#: Mooncake client RPC timeout of every process (a dead master fails calls after it).
RPC_TIMEOUT_MS = 1_000
#: A multi-turn session: its first prompt, each turn's answer and new tokens, and the prompts that
#: evict turn 2 from a 4,096-token prefill KV (3 x 107 pages > 256 pages, free pages aside).
FIRST_TURN_TOKENS = 600
TURN_TOKENS = 8
NEW_TURN_TOKENS = 100
EVICTING_PROMPTS = 3
EVICTING_TOKENS = 1700


def require_private_netns() -> dict:
    """The environment a Mooncake deployment runs with; the test fails outside a private network namespace."""
    from kvpool.backend.pool.netns import netns_problem

    problem = netns_problem()
    if problem:
        pytest.fail(f"refusing to start Mooncake processes: {problem}", pytrace=False)
    return {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_RPC_TIMEOUT_MS": str(RPC_TIMEOUT_MS)}


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def post(url: str, body: dict, timeout_s: float = 60.0, model: bool = True) -> tuple[int, dict]:
    """``POST url/v1/completions`` (the model's name added unless ``model`` is false): status and JSON body."""
    data = json.dumps({"model": MODEL, **body} if model else body).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get_text(url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def multi_turn_session(url: str, sets: list[str], seed: int, user: str) -> tuple[list[dict], list[list[int]]]:
    """Three turns of one session against ``kvpool serve cpu-tiny`` with ``sets``: each sends the
    previous prompt, its answer and ``NEW_TURN_TOKENS`` new ids; before turn 3, ``EVICTING_PROMPTS``
    fresh prompts evict turn 2's pages from the GPU prefix cache (its saved chunks stay in the pool).
    Every answer must equal ``reference_generate``'s and end by its length. The records and prompts."""
    from kvpool.backend.serve.model_config import ref_config
    from kvpool.backend.serve.reference import reference_generate
    from kvpool.scenario.load import load_scenario

    scenario = load_scenario("cpu-tiny", sets)
    config, vocab = ref_config(scenario), scenario.serve.vocab
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(FIRST_TURN_TOKENS)]
    records, prompts = [], []
    for turn in (1, 2, 3):
        if turn == 3:
            for _ in range(EVICTING_PROMPTS):
                status, body = post(url, {"prompt": [rng.randrange(vocab) for _ in range(EVICTING_TOKENS)],
                                          "max_tokens": 1})
                assert status == 200, body
        status, body = post(url, {"prompt": prompt, "max_tokens": TURN_TOKENS, "ignore_eos": True, "user": user})
        assert status == 200, body
        answer = body["choices"][0]["token_ids"]
        assert answer == reference_generate(config, prompt, TURN_TOKENS, scenario.decode.dcp), f"turn {turn}"
        assert body["choices"][0]["finish_reason"] == "length"
        records.append(body["kvpool"]["record"])
        prompts.append(prompt)
        prompt = prompt + answer + [rng.randrange(vocab) for _ in range(NEW_TURN_TOKENS)]
    return records, prompts


class RealServe:
    """One ``kvpool serve`` (``backend.serve.launch.ServeProcess``, its attributes and methods) whose
    ``stop`` asserts a clean end."""

    def __init__(self, served: ServeProcess) -> None:
        self.served = served

    def __getattr__(self, name: str):
        return getattr(self.served, name)

    def stop(self) -> int:
        """SIGTERM (unless it already exited), its exit status; asserts it exited within ``STOP_BOUND_S``
        and that no process of the ready file is left."""
        left: dict[str, int] = {}
        try:
            status = self.served.stop(STOP_BOUND_S)
        finally:
            end = time.monotonic() + GONE_BOUND_S
            left = {name: pid for name, pid in self.served.pids().items() if alive(pid)}
            while left and time.monotonic() < end:
                time.sleep(0.1)
                left = {name: pid for name, pid in left.items() if alive(pid)}
            for pid in left.values():
                os.kill(pid, signal.SIGKILL)
        assert not left, f"processes left running after kvpool serve exited: {left}"
        assert status != -signal.SIGKILL, f"kvpool serve did not exit within {STOP_BOUND_S:g} s of SIGTERM"
        return status


def start_serve(run_dir: Path, sets: list[str], *, pool: str | None = None, env: dict | None = None) -> RealServe:
    """``kvpool serve cpu-tiny --port 0 --run-dir run_dir --set ...`` (``--pool``), ready."""
    try:
        return RealServe(launch.start_serve("cpu-tiny", sets, run_dir, pool=pool, env=env, ready_timeout_s=START_BOUND_S))
    except launch.ServeStartError as e:
        out = run_dir.with_name(run_dir.name + ".out")
        raise AssertionError(f"{e}:\n{out.read_text(errors='replace')[-4000:] if out.exists() else ''}") from None


@dataclass
class Replay:
    """One ``kvpool replay`` process."""

    proc: subprocess.Popen
    out_dir: Path
    t0: float

    def finish(self, timeout_s: float) -> tuple[dict, list[dict], float]:
        """Its summary document, its records (the JSONL) and its wall time; it must end within ``timeout_s``."""
        try:
            stdout, stderr = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise AssertionError(f"kvpool replay did not finish within {timeout_s:g} s") from None
        took_s = time.monotonic() - self.t0
        assert self.proc.returncode == 0, stderr[-4000:]
        jsonl = list(self.out_dir.glob("replay-*.jsonl"))
        assert len(jsonl) == 1, list(self.out_dir.iterdir())
        records = [json.loads(line) for line in jsonl[0].read_text().splitlines()]
        return json.loads(stdout), records, took_s


def start_replay(url: str, out_dir: Path, *, sessions: int, duration_s: float, token_scale: str = "1/64",
                 sets: tuple[str, ...] = ()) -> Replay:
    """``kvpool replay cpu-tiny`` of the repository's kv-cache-tester traces against ``url``, ``--json``."""
    argv = [sys.executable, "-c", CLI, "replay", "cpu-tiny", "--url", url, "--traces", str(TRACES),
            "--sessions", str(sessions), "--duration", str(duration_s), "--token-scale", token_scale,
            "--out", str(out_dir), "--json"]
    for s in sets:
        argv += ["--set", s]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return Replay(proc, out_dir, time.monotonic())
