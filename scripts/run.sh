#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run kvpool's main job on the default scenario.
# With arguments, runs `kvpool ARGS...` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "$#" -gt 0 ]; then
    exec .venv/bin/kvpool "$@"
fi
exec .venv/bin/kvpool scenario show mi355x-1p1d
