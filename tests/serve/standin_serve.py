"""``kvpool serve`` with the stand-in engines (``standin_engines``) in place of the real ones: the
supervisor's own code (``backend.serve.supervisor.run``), only each worker's command differs.

    python standin_serve.py --run-dir DIR [--set FIELD=VALUE ...] [--stop-timeout-s S]

Port 0; the URL and the pids are in ``DIR/router.ready.json``. Exit status: the supervisor's, or 1
after a failed start (its report on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpool.backend.serve.supervisor import StartError, run
from kvpool.scenario import load_scenario

STANDIN = Path(__file__).with_name("standin_engines.py")


def standin_argv(worker, plan_path: Path) -> list[str]:
    return [sys.executable, str(STANDIN), "--plan", str(plan_path), "--name", worker.name]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--stop-timeout-s", type=float, default=5.0)
    ap.add_argument("--ready-timeout-s", type=float, default=60.0)
    a = ap.parse_args()
    scenario = load_scenario("cpu-tiny", a.set)
    try:
        status = run(scenario, port=0, run_dir=a.run_dir, argv_for=standin_argv, ready_timeout_s=a.ready_timeout_s,
                     stop_timeout_s=a.stop_timeout_s)
    except StartError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(status)
