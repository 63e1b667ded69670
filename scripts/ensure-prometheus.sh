#!/usr/bin/env bash
# Make sure `promtool` and `prometheus` are on PATH (the dashboards tests and the live
# Prometheus check need them). Idempotent: does nothing when both are already there;
# otherwise installs Debian's `prometheus` package (which ships both binaries).
#
# Usage: scripts/ensure-prometheus.sh        (root, or sudo available without a password)
# Exit status: 0 when both binaries are usable afterwards, non-zero with a message otherwise.
set -euo pipefail

log() { printf 'ensure-prometheus: %s\n' "$*"; }
die() { printf 'ensure-prometheus: ERROR: %s\n' "$*" >&2; exit 1; }

have_both() { command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; }

if have_both; then
    log "already installed: $(command -v promtool) ($(promtool --version 2>&1 | head -n1))"
    exit 0
fi

missing=()
command -v promtool >/dev/null 2>&1 || missing+=(promtool)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
log "missing: ${missing[*]}; installing Debian package 'prometheus'"

command -v apt-get >/dev/null 2>&1 \
    || die "apt-get not found; install Prometheus (promtool + prometheus) by other means and put both on PATH"

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        die "not root and no passwordless sudo; run as root: apt-get install -y --no-install-recommends prometheus"
    fi
fi

export DEBIAN_FRONTEND=noninteractive
start=$(date +%s)
"${SUDO[@]}" apt-get update -qq \
    || die "'apt-get update' failed (is the Debian mirror reachable?)"
# Debian's postinst would start the service where systemd runs; policy-rc.d is not touched
# here because containers and CI have no init system and the install simply skips that step.
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
    || die "'apt-get install prometheus' failed; see apt's output above"
elapsed=$(( $(date +%s) - start ))

have_both || die "package 'prometheus' installed but promtool/prometheus still not on PATH ($PATH)"
log "installed in ${elapsed}s: $(command -v promtool) ($(promtool --version 2>&1 | head -n1))"
