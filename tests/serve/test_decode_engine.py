"""The decode engine process, started from the cpu-tiny plan and fed by real prefill-stage senders.

Each prefill stage is a spawned process that computes the prompt's KV with ``RefModel.prefill`` and
hands its layers to the engine's rank endpoints with ``backend.handoff.PrefillStage`` over the IPC
transport (shared memory on the CPU). The streamed tokens must equal ``reference_generate``.
Everything runs on 127.0.0.1; every wait is bounded; no process outlives the test.
"""

from __future__ import annotations

import http.client
import json
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from raw_http import MALFORMED, error_answers

from kvpool.backend.serve.decode_core import HANDOFF_WAIT_CAP_S
from kvpool.backend.serve.decode_model import rank_pages
from kvpool.backend.serve.model_config import ref_config
from kvpool.backend.serve.plan import build_plan, wait_ready
from kvpool.backend.serve.reference import reference_generate
from kvpool.scenario.load import load_scenario

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 6.0          # serve.request_timeout_s of the test: the hand-off bound too
SCENARIO = load_scenario("cpu-tiny", [f"serve.request_timeout_s={TIMEOUT_S}"])
CFG = ref_config(SCENARIO)


class Stage:
    """A prefill stage process (``decode_stage_sender.py``); every read is bounded."""

    def __init__(self, stage: int, endpoints: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("decode_stage_sender.py")),
                                      str(stage), json.dumps(endpoints), str(TIMEOUT_S)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def read(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, f"stage process {self.proc.pid} did not answer within {timeout_s} s"
        line = self.proc.stdout.readline()
        assert line, f"stage process {self.proc.pid} exited ({self.proc.poll()})"
        return json.loads(line)

    def send(self, rid: str, prompt: list[int]) -> None:
        self.proc.stdin.write(json.dumps({"send": rid, "prompt": prompt}) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def post(url: str, body, timeout_s: float = 20.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream(url: str, body: dict, timeout_s: float = 30.0, opened: threading.Event | None = None) -> list[dict]:
    """The NDJSON lines of ``POST /generate``; ``opened`` is set once the stream's headers came (the
    engine has taken the request into its core)."""
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        if opened is not None:
            opened.set()
        return [json.loads(line) for line in r if line.strip()]


def expect_body(rid: str, prompt_tokens: int, max_tokens: int) -> dict:
    """An ``ExpectRequest`` of the one prefill instance of cpu-tiny."""
    return {"request_id": rid, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "prefill_instance": 0}


#: A stream's headers, and a generating sequence's first step, come within this (a loaded machine).
OPEN_WAIT_S = 20.0


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("decode-engine")
    plan = build_plan(SCENARIO, run_dir, 0)
    path = plan.write()
    (w,) = plan.by_role("decode_engine")
    log = open(plan.log_path(w.name), "w")
    proc = subprocess.Popen(w.argv(path), stdout=log, stderr=subprocess.STDOUT)
    stages: list[Stage] = []
    try:
        ready = wait_ready(plan.ready_path(w.name), 90.0, alive=lambda: proc.poll() is None)
        stages = [Stage(s, ready["rank_endpoints"]) for s in range(SCENARIO.prefill.pp)]
        for st in stages:
            assert st.read(90) == {"ready": True}
        yield {"url": ready["url"], "ready": ready, "stages": stages, "proc": proc, "plan": plan}
    finally:
        for st in stages:
            st.stop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log.close()
        print(f"--- {w.name}'s log (tail) ---\n{plan.log_path(w.name).read_text()[-4000:]}")   # shown on failure


def send_all(engine, rid: str, prompt: list[int]) -> int:
    """Both stages send the prompt's KV; returns the first token (prefill's argmax)."""
    for st in engine["stages"]:
        st.send(rid, prompt)
    firsts = []
    for st in engine["stages"]:
        answer = st.read(30)
        assert "first" in answer, answer
        firsts.append(answer["first"])
    assert firsts[0] == firsts[1]
    return firsts[0]


def prompts(k: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 17, 40, 100)[:k]]


def test_ready_file_and_health(engine):
    ready = engine["ready"]
    assert ready["url"].startswith("http://127.0.0.1:") and ready["transport"] == "ipc"
    assert len(ready["rank_endpoints"]) == SCENARIO.decode.dcp
    assert all(ep.startswith("tcp://127.0.0.1:") for ep in ready["rank_endpoints"])
    status, body = get(engine["url"] + "/health")
    h = json.loads(body)
    assert status == 200 and h["status"] == "ok" and h["role"] == "decode_engine" and h["instance"] == 0


def test_streamed_tokens_equal_reference_generate(engine):
    """Four requests decoded in one continuous batch (their generates overlap: fewer steps than
    tokens) each stream exactly the reference's tokens after the first."""
    url, max_tokens = engine["url"], 30
    ps = prompts(4)
    firsts = {}
    for i, p in enumerate(ps):
        rid = f"r{i}"
        pages = [rank_pages(len(p) + max_tokens, r, 2, 16) for r in range(2)]
        assert post(url + "/expect", expect_body(rid, len(p), max_tokens)) \
            == (200, {"request_id": rid, "pages": pages})
        firsts[rid] = send_all(engine, rid, p)
    results: dict[str, list[dict]] = {}

    def run(rid):
        results[rid] = stream(url, {"request_id": rid, "first_token": firsts[rid], "max_tokens": max_tokens,
                                    "descriptor": {"decode_instance": 0, "stages": 2}, "ignore_eos": True})

    threads = [threading.Thread(target=run, args=(f"r{i}",)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, p in enumerate(ps):
        lines = results[f"r{i}"]
        assert lines[-1]["done"] and lines[-1]["finish_reason"] == "length" and not lines[-1]["error"], lines[-1]
        assert all(not ln["done"] for ln in lines[:-1])
        tokens = [firsts[f"r{i}"]] + [t for ln in lines for t in ln["tokens"]]
        assert tokens == reference_generate(CFG, p, max_tokens, SCENARIO.decode.dcp), f"prompt {i}"
        assert lines[-1]["record"]["decode"] == 0 and lines[-1]["record"]["out_tokens"] == max_tokens
        assert lines[-1]["record"]["handoff_s"] > 0
    health = json.loads(get(url + "/health")[1])
    assert health["detail"]["running"] == 0 and health["detail"]["kv_usage"] == 0.0   # every page freed
    metrics = get(url + "/metrics")[1].decode()
    assert f"kvpool:generation_tokens_total {4.0 * (max_tokens - 1)}" in metrics
    assert "kvpool:inter_token_latency_seconds_count" in metrics
    assert "kvpool:handoff_seconds_count 4.0" in metrics
    steps = decode_steps(metrics)
    assert max_tokens - 1 <= steps < 4 * (max_tokens - 1)     # some steps ran several sequences


def test_a_handoff_lands_while_the_batch_runs(engine):
    """Request B's KV lands (scattered between the layers and steps of A's decode) while A
    generates; B then joins the batch. Both stream the reference's tokens."""
    url = engine["url"]
    a, b = prompts(4)[3], prompts(4)[2]
    shared_before = shared_steps(get(url + "/metrics")[1].decode())
    assert post(url + "/expect", expect_body("A", len(a), 600))[0] == 200
    first_a = send_all(engine, "A", a)
    out: dict = {}
    steps_before = decode_steps(get(url + "/metrics")[1].decode())
    t = threading.Thread(target=lambda: out.update(A=stream(url, {"request_id": "A", "first_token": first_a,
                                                                "max_tokens": 600, "descriptor": {}})))
    t.start()
    deadline = time.monotonic() + OPEN_WAIT_S
    while decode_steps(get(url + "/metrics")[1].decode()) == steps_before:   # A is in the batch, generating
        assert time.monotonic() < deadline, "A's decode did not start"
        time.sleep(0.01)
    assert post(url + "/expect", expect_body("B", len(b), 20))[0] == 200
    first_b = send_all(engine, "B", b)
    out["B"] = stream(url, {"request_id": "B", "first_token": first_b, "max_tokens": 20, "descriptor": {}})
    t.join(60)
    assert "A" in out and out["A"][-1]["finish_reason"] == "length", out.get("A", [{}])[-1]
    assert out["B"][-1]["finish_reason"] == "length"
    for rid, p, first, n in (("A", a, first_a, 600), ("B", b, first_b, 20)):
        assert [first] + [t for ln in out[rid] for t in ln["tokens"]] == reference_generate(CFG, p, n, 2), rid
    assert shared_steps(get(url + "/metrics")[1].decode()) - shared_before == 19   # B's steps all ran beside A's


def decode_steps(metrics: str) -> float:
    return float(re.search(r"^kvpool:decode_steps_total (\S+)$", metrics, re.M).group(1))


def shared_steps(metrics: str) -> float:
    """Decode steps of more than one sequence so far."""
    count = float(re.search(r"^kvpool:decode_batch_sequences_count (\S+)$", metrics, re.M).group(1))
    alone = float(re.search(r'^kvpool:decode_batch_sequences_bucket\{le="1.0"\} (\S+)$', metrics, re.M).group(1))
    return count - alone


def test_expect_without_room_is_a_503_with_a_json_error(engine):
    status, body = post(engine["url"] + "/expect", expect_body("big", 40000, 10))
    assert status == 503 and "no room" in body["error"]
    assert json.loads(get(engine["url"] + "/health")[1])["detail"]["kv_usage"] == 0.0


@pytest.mark.parametrize("route,body,field", [
    ("/expect", b"not json", "body"),
    ("/expect", {"request_id": "x", "prompt_tokens": 0, "max_tokens": 1}, "prompt_tokens"),
    ("/expect", {"request_id": "x", "prompt_tokens": 3, "max_tokens": 1, "extra": 1}, "unknown field"),
    ("/expect", {"request_id": "x", "prompt_tokens": 3, "max_tokens": 1}, "prefill_instance"),
    ("/expect", {**expect_body("x", 3, 1), "prefill_instance": -1}, "prefill_instance"),
    ("/expect", {**expect_body("x", 3, 1), "prefill_instance": 1}, "prefill_instance: expected an integer in [0, 0]"),
    ("/generate", {"request_id": "x", "first_token": "a", "max_tokens": 1, "descriptor": {}}, "first_token"),
    ("/generate", {"request_id": "x", "first_token": 1, "max_tokens": 1, "descriptor": {"decode_instance": 3}},
     "decode_instance"),
    ("/abort", [1, 2], "JSON object"),
])
def test_a_bad_body_is_a_400_with_a_json_error(engine, route, body, field):
    status, answer = post(engine["url"] + route, body)
    assert status == 400 and field in answer["error"]


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_malformed_http_is_a_4xx_with_a_json_error(engine, what):
    """What aiohttp refuses before any route (a request line, a header, framing) or a path the
    engine does not serve: a 4xx ``{"error": reason}``, and the engine serves on."""
    for status, err in error_answers(engine["url"], MALFORMED[what]):
        assert 400 <= status < 500 and isinstance(err, str) and err and "\n" not in err, (what, status, err)
    assert get(engine["url"] + "/health")[0] == 200


@pytest.mark.parametrize("first,max_tokens,ignore_eos,reason", [
    (256, 5, False, "stop"),       # the first token is EOS
    (65, 1, False, "length"),      # the first token was the only one asked for
])
def test_a_generation_that_ends_at_its_first_token_streams_one_done_line(engine, first, max_tokens, ignore_eos, reason):
    url = engine["url"]
    assert post(url + "/expect", expect_body("short", 9, 5))[0] == 200
    lines = stream(url, {"request_id": "short", "first_token": first, "max_tokens": max_tokens,
                         "descriptor": {}, "ignore_eos": ignore_eos})
    assert len(lines) == 1 and lines[0]["done"] and lines[0]["finish_reason"] == reason and not lines[0]["tokens"]
    assert json.loads(get(url + "/health")[1])["detail"]["kv_usage"] == 0.0


def test_generate_past_the_expected_tokens_is_a_409(engine):
    url = engine["url"]
    assert post(url + "/expect", expect_body("greedy", 9, 5))[0] == 200
    status, body = post(url + "/expect", expect_body("greedy", 9, 5))
    assert status == 409 and "already expected" in body["error"]
    status, body = post(url + "/generate", {"request_id": "greedy", "first_token": 1, "max_tokens": 6,
                                            "descriptor": {}})
    assert status == 409 and "exceeds the 5 expected" in body["error"]
    assert post(url + "/abort", {"request_id": "greedy"}) == (200, {"aborted": True})


def test_generate_of_an_unexpected_request_is_a_404(engine):
    status, body = post(engine["url"] + "/generate", {"request_id": "nobody", "first_token": 1, "max_tokens": 3,
                                                      "descriptor": {"decode_instance": 0, "stages": 2}})
    assert status == 404 and "not expected" in body["error"]


def test_a_handoff_that_never_comes_ends_the_stream_with_its_cause_in_bound(engine):
    url = engine["url"]
    assert post(url + "/expect", expect_body("lost", 30, 5))[0] == 200
    t0 = time.monotonic()
    lines = stream(url, {"request_id": "lost", "first_token": 3, "max_tokens": 5,
                         "descriptor": {"decode_instance": 0, "stages": 2}})
    took = time.monotonic() - t0
    bound = min(HANDOFF_WAIT_CAP_S, TIMEOUT_S)
    assert len(lines) == 1 and lines[0]["done"] and "hand-off not complete" in lines[0]["error"]
    assert "decode rank(s) [0, 1]" in lines[0]["error"]
    assert bound - 0.5 < took < bound + 3.0
    assert json.loads(get(url + "/health")[1])["detail"]["kv_usage"] == 0.0
    assert "kvpool:handoff_failures_total 1.0" in get(url + "/metrics")[1].decode()


def test_a_failed_handoff_ends_the_stream_with_the_ranks_reason(engine):
    """The stages send a 40-token prompt where 30 were expected: the ranks refuse the writes."""
    url = engine["url"]
    assert post(url + "/expect", expect_body("bad", 30, 5))[0] == 200
    for st in engine["stages"]:
        st.send("bad", prompts(3)[2])
    for st in engine["stages"]:
        st.read(30)      # the stage's writes complete before the rank's FAIL reaches it, or after
    t0 = time.monotonic()
    lines = stream(url, {"request_id": "bad", "first_token": 3, "max_tokens": 5, "descriptor": {}})
    assert time.monotonic() - t0 < 2.0
    assert len(lines) == 1 and "hand-off failed on decode rank" in lines[0]["error"]
    assert "not in the plan" in lines[0]["error"]
    assert json.loads(get(url + "/health")[1])["detail"]["kv_usage"] == 0.0


def finished(metrics: str, reason: str) -> float:
    m = re.search(rf'^kvpool:request_success_total{{finished_reason="{reason}"}} (\S+)$', metrics, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_client_that_disconnects_mid_stream_aborts_its_request(engine):
    url = engine["url"]
    before = get(url + "/metrics")[1].decode()
    prompt = prompts(2)[1]
    assert post(url + "/expect", expect_body("leaver", len(prompt), 1000))[0] == 200
    first = send_all(engine, "leaver", prompt)
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/generate", json.dumps({"request_id": "leaver", "first_token": first, "max_tokens": 1000,
                                                 "descriptor": {}}))
    resp = conn.getresponse()
    assert json.loads(resp.readline())["tokens"]
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 10
    while json.loads(get(url + "/health")[1])["detail"]["kv_usage"] != 0.0:
        assert time.monotonic() < deadline, "the pages of a disconnected stream were not freed"
        time.sleep(0.05)
    after = get(url + "/metrics")[1].decode()
    assert finished(after, "error") == finished(before, "error") + 1
    assert finished(after, "length") == finished(before, "length")


def test_abort_ends_an_open_stream_and_frees_its_pages(engine):
    url = engine["url"]
    assert post(url + "/expect", expect_body("gone", 30, 5))[0] == 200
    out: list = []
    opened = threading.Event()
    t = threading.Thread(target=lambda: out.append(stream(url, {"request_id": "gone", "first_token": 3, "max_tokens": 5,
                                                                "descriptor": {}}, opened=opened)))
    t.start()
    assert opened.wait(OPEN_WAIT_S)   # the stream is open, waiting for its hand-off
    assert post(url + "/abort", {"request_id": "gone"}) == (200, {"aborted": True})
    t.join(10)
    assert out and out[0][-1]["done"] and "aborted" in out[0][-1]["error"]
    assert post(url + "/abort", {"request_id": "gone"}) == (200, {"aborted": False})
    assert json.loads(get(url + "/health")[1])["detail"]["kv_usage"] == 0.0


def test_sigterm_stops_the_engine_cleanly(engine):
    """Last in the module: SIGTERM ends an open stream with an error line and the process with
    status 0 within the bound."""
    proc, url = engine["proc"], engine["url"]
    assert post(url + "/expect", expect_body("late", 30, 5))[0] == 200
    out: list = []
    opened = threading.Event()
    t = threading.Thread(target=lambda: out.append(stream(url, {"request_id": "late", "first_token": 3,
                                                                "max_tokens": 5, "descriptor": {}}, opened=opened)))
    t.start()
    assert opened.wait(OPEN_WAIT_S)   # the stream is open, waiting for its hand-off
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    t.join(5)
    assert out and out[0][-1]["done"] and out[0][-1]["error"] == "decode engine stopping"

