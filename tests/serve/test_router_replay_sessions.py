"""``kvpool replay`` against ``kvpool serve`` (the supervisor and its router as a process, stand-in
engines as processes, HTTP on 127.0.0.1 between them): the replay's sessions reach the router, so
``session_affinity`` keeps every session on one prefill instance and spreads the sessions over both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from router_testing import TWO_PREFILLS
from supervisor_testing import start

from kvpool.cli import main

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "tests" / "data" / "traces" / "kv-cache-tester"
#: a gate that admits the traces' recorded output lengths (the replay scales only the prompts)
ROOMY_GATE = ["gate.tokens_per_decode=1000000", "gate.max_output_tokens=65536"]
#: a prefill that takes this long keeps its prompt tokens outstanding, so concurrent sessions spread
PREFILL_DELAY_S = 0.2


def test_a_replays_sessions_each_stay_on_one_prefill_and_use_both(tmp_path, capsys):
    served = start(tmp_path / "serve", [*TWO_PREFILLS, "routing.prefill=session_affinity", *ROOMY_GATE],
                   behaviour={"prefill0": {"prefill_delay_s": PREFILL_DELAY_S},
                              "prefill1": {"prefill_delay_s": PREFILL_DELAY_S}})
    try:
        served.wait_ready()
        with pytest.raises(SystemExit) as e:
            main(["replay", "cpu-tiny", "--url", served.url, "--traces", str(TRACES), "--sessions", "6",
                  "--duration", "3", "--set", "workload.idle_cap_s=0.01", "--token-scale", "1/64",
                  "--out", str(tmp_path / "out")])
        _, err = capsys.readouterr()
        assert e.value.code == 0, err
    finally:
        served.stop()
    (jsonl,) = (tmp_path / "out").glob("replay-*.jsonl")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert records and all(not r["error"] for r in records), [r["error"] for r in records if r["error"]]
    homes: dict[str, set[int]] = {}
    for r in records:
        homes.setdefault(r["session"], set()).add(r["prefill"])
    assert len(homes) >= 6 and len(records) > len(homes), homes  # sessions of more than one request
    assert all(len(h) == 1 for h in homes.values()), homes
    assert set().union(*homes.values()) == {0, 1}
