#!/usr/bin/env bash
# Set up kvpool on a fresh machine: Debian libraries the Mooncake binaries need, a virtual
# environment in .venv with torch (CPU build) and kvpool installed editable with every extra.
# Idempotent: a second run only checks. Fails loudly on anything it cannot install.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# 1. Debian packages: the libraries Mooncake's binaries link against (even without RDMA hardware)
#    and iproute2, which the test command uses to bring up loopback in its network namespace;
#    chromium (+ driver) for the dashboard's end-to-end browser test (Playwright drives it).
DEB_PKGS=(libibverbs1 librdmacm1 libnuma1 iproute2 chromium chromium-driver)
missing=()
for p in "${DEB_PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
    command -v apt-get >/dev/null || die "need Debian packages ${missing[*]} and there is no apt-get"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    say "installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
fi

# 2. The virtual environment.
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "kvpool needs Python >= 3.11 ($PY is $("$PY" -V 2>&1))"
if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    "$PY" -m venv .venv || die "python -m venv failed"
fi
VPIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

# 3. torch: the CPU build (2.13.0 lies on this machine's disk); an unpinned torch would pull a
#    multi-GB CUDA build. Skipped when some torch is already present.
if ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
    say "installing torch (CPU build)"
    "${VPIP[@]}" install "torch==${KVPOOL_TORCH_VERSION:-2.13.0}" \
        || "${VPIP[@]}" install --index-url https://download.pytorch.org/whl/cpu torch \
        || die "could not install torch"
fi

# 4. kvpool itself with every extra (editable), again whenever pyproject.toml or setup.py changed.
stamp=.venv/.kvpool-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ]; then
    say "installing kvpool[all] (editable)"
    "${VPIP[@]}" install -e '.[all]' || die "pip install -e .[all] failed"
    touch "$stamp"
fi
.venv/bin/kvpool --help >/dev/null || die "kvpool did not install a working CLI"
say "ready: .venv/bin/kvpool"
