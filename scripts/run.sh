#!/usr/bin/env bash
# Set up the simulator (scripts/setup.sh with no arguments: kvpool and its core dependencies in
# .venv, no torch, no extras, no Debian packages) and run kvpool's main job: a simulator run of the
# default scenario (mi355x-1p1d, the seed's Figure 6 deployment) on its embedded synthetic workload.
# With arguments, runs `kvpool ARGS...` instead. The full set-up (backend, dashboard, tests) is
# `scripts/setup.sh --all`, or extras by name (`scripts/setup.sh dashboard`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "$#" -gt 0 ]; then
    exec .venv/bin/kvpool "$@"
fi
exec .venv/bin/kvpool sim run
