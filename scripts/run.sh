#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run kvpool's main job: a simulator run of the default scenario
# (mi355x-1p1d, the seed's Figure 6 deployment) on its embedded synthetic workload.
# With arguments, runs `kvpool ARGS...` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "$#" -gt 0 ]; then
    exec .venv/bin/kvpool "$@"
fi
exec .venv/bin/kvpool sim run
