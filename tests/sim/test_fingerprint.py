"""The simulator's results stay what they were: each configuration of ``kvpool.sim.fingerprint``
is simulated and its digest compared with ``golden/fingerprint.json``.

A digest covers every request record, the pool's, GPU caches', key space's and links' counters
and the time series, so any change of results shows here, named by configuration.

Regenerate the golden file only on purpose, when results change by design (never to make a
speed or clean-up change pass), and give the reason in the commit:

    KVPOOL_REGEN_GOLDEN=1 pytest tests/sim/test_fingerprint.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvpool.sim.fingerprint import CONFIGS, combined, fingerprint, simulate

GOLDEN = Path(__file__).resolve().parent / "golden" / "fingerprint.json"


def _run_all() -> dict[str, dict]:
    out = {}
    for name in CONFIGS:
        sim, records, _ = simulate(name)
        out[name] = {"sha256": fingerprint(sim, records), "requests": len(records)}
    return out


def test_every_configuration_matches_its_golden_digest():
    now = _run_all()
    if os.environ.get("KVPOOL_REGEN_GOLDEN") == "1":
        doc = {"configs": now, "sha256": combined({k: v["sha256"] for k, v in now.items()})}
        GOLDEN.write_text(json.dumps(doc, indent=2) + "\n")
        return
    golden = json.loads(GOLDEN.read_text())
    assert set(golden["configs"]) == set(CONFIGS), "golden file and CONFIGS name different configurations"
    changed = [
        f"{name}: sha256 {golden['configs'][name]['sha256'][:16]} -> {now[name]['sha256'][:16]}, "
        f"requests {golden['configs'][name]['requests']} -> {now[name]['requests']}"
        for name in CONFIGS
        if now[name] != golden["configs"][name]
    ]
    assert not changed, ("simulator results changed (golden -> now):\n" + "\n".join(changed)
                         + "\nif on purpose: KVPOOL_REGEN_GOLDEN=1 pytest tests/sim/test_fingerprint.py, reason in the commit")
    assert combined({k: v["sha256"] for k, v in now.items()}) == golden["sha256"]
