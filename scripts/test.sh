#!/usr/bin/env bash
# Set up everything the tests need (scripts/setup.sh --all: every extra, torch's CPU build, the
# Debian libraries) and run the whole test suite. Extra arguments go to pytest.
#
# The suite runs inside a private network namespace with only loopback up: Mooncake's transfer
# engine binds the wildcard address and no flag changes that, so tests that start real Mooncake
# processes are confined to 127.0.0.1 this way (as root: unshare -n; otherwise: unshare -rn).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${KVPOOL_IN_NETNS:-0}" = 1 ] || scripts/setup.sh --all

if [ "${KVPOOL_IN_NETNS:-0}" = 1 ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
flags=-n
[ "$(id -u)" -eq 0 ] || flags=-rn
if ! unshare "$flags" true 2>/dev/null; then
    echo "[test] ERROR: cannot create a private network namespace (unshare $flags); the Mooncake" >&2
    echo "[test] tests need one so that nothing listens beyond loopback. Run as root or enable user namespaces." >&2
    exit 1
fi
exec unshare "$flags" env KVPOOL_IN_NETNS=1 sh -c 'ip link set lo up && exec "$0" "$@"' scripts/test.sh "$@"
