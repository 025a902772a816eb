"""Faults of production mode with real processes, mid-replay: ``kvpool serve cpu-tiny`` while ``kvpool
replay`` of the kv-cache-tester traces runs against it.

* A killed decode engine (embedded pool): a request generating on it at that moment ends within
  ``DEAD_WORKER_BOUND_S``, its stream with an error naming the engine; the supervisor reports the
  engine by name and exits with status 1 (``--on-worker-exit shutdown``); the replay counts the
  failed requests as errors and finishes within its bound.
* On a Mooncake pool: the store service is killed while a prompt's KV is only in the pool; that
  prompt's next request finds its keys (they still exist for the master's ``--client_ttl``), fails to
  read them and computes them (``restore_failed``). A replay then runs; the master is killed; serving
  goes on (the supervisor reports each pool process once), the requests after the kill compute their
  prompts without an answered lookup, and no request gets KV from the pool. Once a stage's pool
  client has found the master lost, it answers at once without asking Mooncake: requests after the
  first one cost what a request without a pool costs (``NO_MASTER_REQUEST_BOUND_S``), and the
  router's ``/health`` and ``kvpool:pool_up`` say the pool is down. Then a prefill
  stage is killed while a request waits in its engine: it ends within its bound with a 503 naming
  the stage, and the supervisor exits 1 naming it, the replay counting the errors as above.
* Bad requests against the real server (a prompt over ``gate.max_input_tokens``, unknown fields,
  non-integer token ids, ``max_tokens`` 0 or over ``gate.max_output_tokens``) get a 4xx JSON
  error; the server keeps serving.
* ``--on-worker-exit restart`` is refused with one ``error:`` line before anything starts.

After every deployment no process of its ``router.ready.json`` is left. The Mooncake deployment
needs a private network namespace (the test fails outside one):
``unshare -n sh -c 'ip link set lo up && .venv/bin/python -m pytest tests/serve/test_serve_faults.py'``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from serve_process import get_text, post, require_private_netns, start_replay, start_serve

from kvpool.backend.serve.prefill_scheduler import LIVENESS_EVERY_S
from kvpool.cli import main as kvpool_main

SERVE_SETS = ["serve.prefill_kv_tokens=4096"]
REPLAY_SESSIONS = 3
REPLAY_DURATION_S = 12.0
REPLAY_SETS = ("workload.max_output_tokens=16", "workload.idle_cap_s=0.5", "workload.grace_s=10")
#: A replay's bound: warm-up, the window, its last requests (failing at once once the server is gone).
REPLAY_BOUND_S = 90.0
#: A request using a worker that dies: the prefill engine sees a dead stage within LIVENESS_EVERY_S;
#: the router sees a closed connection at once; the answer takes at most a few seconds more.
DEAD_WORKER_BOUND_S = LIVENESS_EVERY_S + 5.0
#: The supervisor's exit after a worker died: its watch, the drain of the requests still running
#: (their engines answer or fail at once), every child's SIGTERM.
SHUTDOWN_BOUND_S = 30.0
#: The Mooncake calls in flight when the master dies: -900 at once, or after Mooncake's reconnects
#: (~4.3 s). The first one marks its stage's pool client down; from then on it answers every call
#: at once until a probe of the master's port connects again.
MASTER_LOSS_FOUND_S = 5.0
#: A short prompt's request while its prefill engine works on the replay's (compute, hand-off,
#: decode of two tokens on two shared cores).
REQUEST_BOUND_S = 3.0
#: A request once the calls in flight at the master's death have ended, behind the replay's lanes:
#: no lookup, load or save waits on the master, so each request ahead of it costs REQUEST_BOUND_S.
NO_MASTER_REQUEST_BOUND_S = REQUEST_BOUND_S * (REPLAY_SESSIONS + 1)
#: A request while the master is dead, the first after the kill included: a call in flight at its
#: death (a save queued behind one waits for it), then a request as above.
DEAD_MASTER_BOUND_S = MASTER_LOSS_FOUND_S + NO_MASTER_REQUEST_BOUND_S
#: The request sent right after the master died, behind the replay's lanes.
QUEUED_NO_MASTER_BOUND_S = DEAD_MASTER_BOUND_S
#: Requests sent one after the other once the master is dead (the first at once, the others from
#: MASTER_LOSS_FOUND_S after the kill).
NO_MASTER_REQUESTS = 3
#: A request in the prefill engine when a stage dies while the master is dead: the lookup answers at
#: once (the pool is down), then the liveness check and the answer.
DEAD_STAGE_NO_MASTER_BOUND_S = DEAD_WORKER_BOUND_S
#: The Mooncake replay's window outlasts its three faults (~20 s after the warm-up).
MOONCAKE_REPLAY_DURATION_S = 24.0
#: A short prompt's first token while the replay runs (its prefill waits for the replay's).
FIRST_TOKEN_BOUND_S = 30.0
#: Finished requests the replay has before a fault is injected (past the warm-up's cold prompts).
OK_BEFORE_FAULT = 4
#: A prompt only the pool holds (16 chunks), and one that evicts it from the 4,096-token prefill KV
#: (250 of its 256 pages), leaving at most EVICTING_SLACK_TOKENS of the first prompt's pages cached.
POOL_ONLY_TOKENS = 1024
EVICTING_TOKENS = 4000
EVICTING_SLACK_TOKENS = 4096 - EVICTING_TOKENS


def ok_requests(url: str) -> int:
    """Requests the router finished with outcome ok (``kvpool:requests_total``)."""
    status, text = get_text(f"{url}/metrics")
    assert status == 200
    m = re.search(r'^kvpool:requests_total\{outcome="ok"\} ([0-9.e+]+)$', text, re.M)
    return int(float(m.group(1))) if m else 0


def wait_ok(url: str, n: int, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while ok_requests(url) < n:
        assert time.monotonic() < end, f"fewer than {n} requests finished within {timeout_s:g} s"
        time.sleep(0.2)


class InFlight:
    """One completion sent from a thread: ``answer()`` is its status and body, and how long it took."""

    def __init__(self, url: str, body: dict) -> None:
        self.result: list = []
        self.t0 = time.monotonic()

        def send() -> None:
            self.result.append((*post(url, body), time.monotonic() - self.t0))

        self.thread = threading.Thread(target=send, daemon=True)
        self.thread.start()

    def answer(self, bound_s: float) -> tuple[int, dict, float]:
        self.thread.join(bound_s + 5.0)
        assert self.result, f"no answer within {bound_s:g} s"
        status, body, took_s = self.result[0]
        assert took_s < bound_s, (took_s, body)
        return status, body, took_s


class Streaming:
    """One streamed completion read from a thread: ``first`` is set at its first token's event;
    ``events()`` is every ``data:`` payload (``[DONE]`` as the string), and how long it took."""

    def __init__(self, url: str, body: dict) -> None:
        self.first = threading.Event()
        self.payloads: list = []
        self.took_s: float | None = None
        self.t0 = time.monotonic()
        data = json.dumps({"model": "refmodel-tiny", "stream": True, **body}).encode()
        self.req = urllib.request.Request(f"{url}/v1/completions", data=data,
                                          headers={"Content-Type": "application/json"})
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with urllib.request.urlopen(self.req, timeout=120) as r:
                for line in r:
                    if line.startswith(b"data: "):
                        text = line[6:].strip().decode()
                        self.payloads.append(text if text == "[DONE]" else json.loads(text))
                        self.first.set()
        finally:
            self.took_s = time.monotonic() - self.t0
            self.first.set()

    def events(self, bound_s: float) -> tuple[list, float]:
        self.thread.join(bound_s + 5.0)
        assert self.took_s is not None, f"the stream did not end within {bound_s:g} s"
        return self.payloads, self.took_s


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 256 for i in range(n)]


def assert_worker_exit_report(served, name: str) -> None:
    pid = served.workers[name]
    status = served.wait_exit(SHUTDOWN_BOUND_S)
    out = served.output()
    assert status == 1, out[-4000:]
    assert f"error: {name} (pid {pid}) exited with signal SIGKILL while serving; last lines of " in out, out[-4000:]


def assert_replay_counted_errors(replay, worker_causes: tuple[str, ...]) -> list[dict]:
    doc, records, took_s = replay.finish(REPLAY_BOUND_S)
    failed = [r for r in records if r["error"] and not r["error"].startswith("cancelled")]
    assert doc["run"]["errors"] == doc["results"][0]["errors"] == len(failed) > 0
    assert len(records) == doc["run"]["dispatched"] and doc["run"]["interrupted"] is False
    # each failure names its cause: the dead worker, the stopping server, or the server gone
    causes = (*worker_causes, "the server is shutting down", "the server stopped", "connection error: ")
    assert all(any(c in r["error"] for c in causes) for r in failed), [r["error"] for r in failed]
    return records


# -- bad requests and the restart policy (no Mooncake) -------------------------------------------


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    served = start_serve(tmp_path_factory.mktemp("faults-embedded") / "run", SERVE_SETS)
    try:
        yield served
    finally:
        served.stop()  # asserts every process of router.ready.json is gone


@pytest.mark.parametrize("body, status, param, says", [
    ({"prompt": [1] * 16385, "max_tokens": 4}, 400, "prompt", "reject_input_too_long: the prompt has 16385 tokens"),
    ({"prompt": "hi", "max_tokens": 4, "temperature": 0.5}, 400, "temperature", "unknown field(s): temperature"),
    ({"prompt": [1, 2.5, 3], "max_tokens": 4}, 400, "prompt", "prompt[1]: expected an integer token id"),
    ({"prompt": [1, "2"], "max_tokens": 4}, 400, "prompt", "prompt[1]: expected an integer token id"),
    ({"prompt": [1, 512], "max_tokens": 4}, 400, "prompt", "prompt[1]: expected an integer token id in [0, 511]"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens: required: an integer >= 1, got 0"),
    ({"prompt": "hi", "max_tokens": 10 ** 9}, 400, "max_tokens", "reject_output_too_long: max_tokens is 1000000000"),
    ({"prompt": "hi", "max_tokens": True}, 400, "max_tokens", "max_tokens: required"),
    ({"prompt": "hi", "max_tokens": 4, "model": "other"}, 404, "model", "'other' is not served here"),
])
def test_bad_requests_get_a_4xx_json_error_and_the_server_keeps_serving(embedded, body, status, param, says):
    got, answer = post(embedded.url, body)
    assert got == status and answer["error"]["param"] == param and says in answer["error"]["message"], answer
    assert answer["error"]["code"] == status
    ok, answer = post(embedded.url, {"prompt": "after a bad request", "max_tokens": 2, "ignore_eos": True})
    assert ok == 200 and len(answer["choices"][0]["token_ids"]) == 2
    assert get_text(f"{embedded.url}/health")[0] == 200


def test_a_body_that_is_not_json_is_a_400(embedded):
    req = urllib.request.Request(f"{embedded.url}/v1/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and "error" in json.loads(e.value.read())
    assert get_text(f"{embedded.url}/health")[0] == 200


def test_restart_on_worker_exit_is_refused_with_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        kvpool_main(["serve", "cpu-tiny", "--port", "0", "--run-dir", str(tmp_path / "run"),
                     "--on-worker-exit", "restart"])
    _, err = capsys.readouterr()
    assert e.value.code == 2 and err.strip().splitlines() == [
        "error: --on-worker-exit restart: not supported yet (a restarted engine's peers would have to reconnect "
        "to it); use shutdown"]
    assert not (tmp_path / "run").exists()                            # nothing started


def test_a_killed_decode_engine_fails_its_requests_and_the_supervisor_exits_1(embedded, tmp_path):
    n = ok_requests(embedded.url)
    replay = start_replay(embedded.url, tmp_path, sessions=REPLAY_SESSIONS, duration_s=REPLAY_DURATION_S,
                          sets=REPLAY_SETS)
    wait_ok(embedded.url, n + OK_BEFORE_FAULT)
    probe = Streaming(embedded.url, {"prompt": prompt_of(40, 2), "max_tokens": 1024, "ignore_eos": True})
    assert probe.first.wait(FIRST_TOKEN_BOUND_S) and probe.took_s is None  # prefilled, generating
    t0 = time.monotonic()
    os.kill(embedded.workers["decode0"], signal.SIGKILL)
    events, _ = probe.events(DEAD_WORKER_BOUND_S)
    assert time.monotonic() - t0 < DEAD_WORKER_BOUND_S
    last = events[-1]                                                 # the stream ends with an error, not [DONE]
    assert "[DONE]" not in events and last["error"]["type"] == "engine_error", events[-3:]
    assert last["error"]["message"].startswith("decode0: POST /generate"), last
    assert_worker_exit_report(embedded, "decode0")
    assert_replay_counted_errors(replay, ("decode0", "hand-off to decode instance 0"))


# -- a Mooncake pool: the store service, the master, then the decode engine ----------------------


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    env = require_private_netns()
    served = start_serve(tmp_path_factory.mktemp("faults-mooncake") / "run", SERVE_SETS, pool="mooncake", env=env)
    try:
        yield served
    finally:
        served.stop()  # asserts every process of router.ready.json (the pool's too) is gone


def only_in_the_pool(url: str) -> list[int]:
    """A prompt whose KV the pool holds and the GPU prefix cache does not: it is computed and saved,
    then a prompt of nearly the whole prefill KV evicts its pages (a prefix loses its tail first, so
    at most the leading pages that prompt leaves over can still hit)."""
    prompt = prompt_of(POOL_ONLY_TOKENS, 11)
    for tokens in (prompt, prompt_of(EVICTING_TOKENS, 12)):
        status, body = post(url, {"prompt": tokens, "max_tokens": 2})
        assert status == 200 and body["kvpool"]["record"]["save_bytes"] > 0, body
    return prompt


def test_pool_faults_recompute_and_a_killed_prefill_stage_ends_the_serve(mooncake, tmp_path):
    master_pid, service_pid = mooncake.ready["pool"]
    pooled = only_in_the_pool(mooncake.url)
    os.kill(service_pid, signal.SIGKILL)                              # its keys still "exist" (--client_ttl)
    status, body = post(mooncake.url, {"prompt": pooled, "max_tokens": 2}, timeout_s=DEAD_MASTER_BOUND_S)
    assert status == 200, body                                        # the failed read is computed
    rec = body["kvpool"]["record"]
    assert rec["lookup_answered"] and rec["restore_failed"], rec
    assert rec["pool_tokens"] == 0 and rec["gpu_tokens"] < POOL_ONLY_TOKENS - EVICTING_SLACK_TOKENS, rec
    assert rec["gpu_tokens"] + rec["computed_tokens"] == POOL_ONLY_TOKENS, rec

    replay = start_replay(mooncake.url, tmp_path, sessions=REPLAY_SESSIONS, duration_s=MOONCAKE_REPLAY_DURATION_S,
                          sets=REPLAY_SETS)
    wait_ok(mooncake.url, ok_requests(mooncake.url) + OK_BEFORE_FAULT, DEAD_MASTER_BOUND_S * 3)  # requests go on
    assert re.search(r"^kvpool:pool_up 1\.0$", get_text(f"{mooncake.url}/metrics")[1], re.M)  # the master answers
    os.kill(master_pid, signal.SIGKILL)
    killed = time.monotonic()
    took = []                                                         # requests after the master died compute
    for k in range(NO_MASTER_REQUESTS):
        if k == 1:                                                    # the calls in flight at the kill have ended
            time.sleep(max(0.0, killed + MASTER_LOSS_FOUND_S - time.monotonic()))
        t0 = time.monotonic()
        status, body = post(mooncake.url, {"prompt": prompt_of(300, 3 + k), "max_tokens": 2},
                            timeout_s=QUEUED_NO_MASTER_BOUND_S)
        took.append(time.monotonic() - t0)
        assert status == 200, body
        rec = body["kvpool"]["record"]
        assert not rec["lookup_answered"] and (rec["pool_tokens"], rec["computed_tokens"]) == (0, 300), rec
        assert rec["save_bytes"] == 0, rec
    assert took[0] < QUEUED_NO_MASTER_BOUND_S, took                   # it may find the master lost
    assert max(took[1:]) < NO_MASTER_REQUEST_BOUND_S, took            # none waits on the lost master
    status, health = get_text(f"{mooncake.url}/health")
    assert status == 200, health                                      # a lost pool is not a broken engine
    assert '"pool": "down (prefill0: the pool client lost its master; prefill recomputes)"' in health, health
    assert re.search(r"^kvpool:pool_up 0\.0$", get_text(f"{mooncake.url}/metrics")[1], re.M)

    probe = InFlight(mooncake.url, {"prompt": prompt_of(3000, 1), "max_tokens": 2})
    time.sleep(1.0)                                                   # in the prefill engine's queue or lookup
    os.kill(mooncake.workers["prefill0-stage0"], signal.SIGKILL)
    status, body, _ = probe.answer(DEAD_STAGE_NO_MASTER_BOUND_S)
    assert status == 503 and body["error"]["type"] == "engine_error", body
    assert "prefill0-stage0" in body["error"]["message"], body
    assert_worker_exit_report(mooncake, "prefill0-stage0")
    out = mooncake.output()
    assert out.count("kvpool serve: pool process ") == 2, out[-4000:]  # each pool process reported once
    assert "pool process service0 exited" in out and "pool process master exited" in out

    records = assert_replay_counted_errors(replay, ("prefill0-stage0",))
    for r in records:                                                 # no replayed request got KV from the pool
        if not r["error"]:
            assert r["gpu_tokens"] + r["pool_tokens"] + r["computed_tokens"] == r["in_tokens"], r
            assert r["pool_tokens"] == 0, r
