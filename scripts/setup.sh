#!/usr/bin/env bash
# Set up kvpool on a fresh machine: a virtual environment in .venv with kvpool installed editable.
#
#   scripts/setup.sh                 the simulator only: kvpool's core dependencies (SimPy, NumPy,
#                                    SciPy, pydantic, Typer, Rich, tomli-w, Matplotlib); no torch,
#                                    no extras, no Debian packages. What scripts/run.sh uses.
#   scripts/setup.sh EXTRA...        the core plus the named extras of pyproject.toml
#                                    (backend, dashboard, dev, ray), with what each one needs:
#                                    backend: torch (CPU build) and the Debian libraries Mooncake's
#                                    binaries link against; dev: iproute2 for the test command;
#                                    dashboard: Chromium for its browser test; aiperf: AIPerf in an
#                                    environment of its own (.aiperf-venv: its pins are older than
#                                    kvpool's) for the test that replays a trace with it.
#   scripts/setup.sh --all           everything (every extra): what scripts/test.sh uses.
#
# Idempotent: a second run with the same arguments only checks. Says what it installs and why, and
# fails loudly on anything it cannot install.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

KNOWN_EXTRAS=(backend dashboard dev ray aiperf)
extras=()
for arg in "$@"; do
    case "$arg" in
        --all|all) extras=("${KNOWN_EXTRAS[@]}") ;;
        -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        backend|dashboard|dev|ray|aiperf) extras+=("$arg") ;;
        *) die "unknown argument '$arg'; give --all or extras by name: ${KNOWN_EXTRAS[*]}" ;;
    esac
done
# unique, in the order of KNOWN_EXTRAS
wanted=()
for e in "${KNOWN_EXTRAS[@]}"; do
    for x in "${extras[@]+"${extras[@]}"}"; do [ "$x" = "$e" ] && { wanted+=("$e"); break; }; done
done
has() { local x; for x in "${wanted[@]+"${wanted[@]}"}"; do [ "$x" = "$1" ] && return 0; done; return 1; }

# 1. Debian packages, only for the extras that need them: the libraries Mooncake's binaries link
#    against, even without RDMA hardware (backend); iproute2, which the test command uses to bring
#    up loopback in its network namespace (dev); Chromium (+ driver) for the dashboard's end-to-end
#    browser test, which Playwright drives (dashboard).
DEB_PKGS=()
has backend && DEB_PKGS+=(libibverbs1 librdmacm1 libnuma1)
has dev && DEB_PKGS+=(iproute2)
has dashboard && DEB_PKGS+=(chromium chromium-driver)
missing=()
for p in "${DEB_PKGS[@]+"${DEB_PKGS[@]}"}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
    command -v apt-get >/dev/null || die "need Debian packages ${missing[*]} and there is no apt-get"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    say "installing Debian packages ${missing[*]} (Mooncake's shared libraries, loopback for the tests, the dashboard's test browser)"
    $SUDO apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
fi

# 2. The virtual environment.
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "kvpool needs Python >= 3.11 ($PY is $("$PY" -V 2>&1))"
if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $("$PY" -V 2>&1)"
    "$PY" -m venv .venv || die "python -m venv failed"
fi
VPIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

# 3. torch for the backend extra: the CPU build (2.13.0 lies on this machine's disk); an unpinned
#    torch would pull a multi-GB CUDA build. Skipped when some torch is already present.
if has backend && ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
    say "installing torch (CPU build) for the backend extra: real KV paths and kernels' references"
    "${VPIP[@]}" install "torch==${KVPOOL_TORCH_VERSION:-2.13.0}" \
        || "${VPIP[@]}" install --index-url https://download.pytorch.org/whl/cpu torch \
        || die "could not install torch"
fi

# 4. kvpool itself (editable) with the wanted extras, again whenever pyproject.toml or setup.py
#    changed or more extras are wanted than the last install had.
spec="."
label="kvpool"
in_venv=()  # the extras that go into .venv (aiperf has its own environment, step 5)
for e in "${wanted[@]+"${wanted[@]}"}"; do [ "$e" = aiperf ] || in_venv+=("$e"); done
if [ "${#in_venv[@]}" -gt 0 ]; then
    joined=$(IFS=,; echo "${in_venv[*]}")
    spec=".[${joined}]"
    label="kvpool[${joined}]"
fi
stamp=.venv/.kvpool-installed
have=""; [ -f "$stamp" ] && have=$(cat "$stamp")
covered=1
for e in "${in_venv[@]+"${in_venv[@]}"}"; do case ",$have," in *",$e,"*) ;; *) covered=0 ;; esac; done
if [ ! -f "$stamp" ] || [ "$covered" = 0 ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ]; then
    if [ "${#in_venv[@]}" -eq 0 ]; then
        say "installing $label (editable) with its core dependencies, what the simulator needs:"
        say "  simpy numpy scipy pydantic typer rich tomli-w matplotlib (no torch, no extras)"
    else
        say "installing $label (editable): the core dependencies plus the extras ${in_venv[*]}"
    fi
    "${VPIP[@]}" install --progress-bar off -e "$spec" || die "pip install -e $spec failed"
    # remember the union of the extras installed so far
    all_have=$(printf '%s\n' ${have//,/ } "${in_venv[@]+"${in_venv[@]}"}" | awk NF | sort -u | paste -sd, -)
    printf '%s\n' "$all_have" > "$stamp"
fi
# 5. AIPerf (the aiperf extra) in .aiperf-venv: a client nobody here wrote, for tests/serve/test_aiperf.py.
if has aiperf && ! .aiperf-venv/bin/python -c 'import aiperf' >/dev/null 2>&1; then
    say "installing aiperf 0.13.0 into .aiperf-venv (its own environment: its pins are older than kvpool's)"
    "$PY" -m venv .aiperf-venv || die "python -m venv .aiperf-venv failed"
    .aiperf-venv/bin/python -m pip --disable-pip-version-check -q install --progress-bar off "aiperf==0.13.0" \
        || die "pip install aiperf==0.13.0 into .aiperf-venv failed"
fi
.venv/bin/kvpool --help >/dev/null || die "kvpool did not install a working CLI"
installed=$(cat "$stamp")
say "ready: .venv/bin/kvpool (extras installed: ${installed:-none})"
