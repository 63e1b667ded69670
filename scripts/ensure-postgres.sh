#!/usr/bin/env bash
# Make sure PostgreSQL's server binaries (initdb, pg_ctl, postgres) are installed: the store tests
# (tests/pg.py) start a throwaway server of their own on loopback. Idempotent: does nothing when
# they are already there; otherwise installs Debian's `postgresql` package.
#
# Debian puts the binaries under /usr/lib/postgresql/<version>/bin, off PATH; tests/pg.py looks
# there. The package's post-install script creates a default cluster ("main") and, where services
# may start, starts it on port 5432; the tests do not use it, so this script stops it again.
#
# Usage: scripts/ensure-postgres.sh        (root, or sudo available without a password)
# Exit status: 0 when initdb and pg_ctl are usable afterwards, non-zero with a message otherwise.
set -euo pipefail

log() { printf 'ensure-postgres: %s\n' "$*"; }
die() { printf 'ensure-postgres: ERROR: %s\n' "$*" >&2; exit 1; }

# Print the newest directory holding both initdb and pg_ctl; fail when there is none.
find_bindir() {
    local dir
    for dir in $(printf '%s\n' /usr/lib/postgresql/*/bin | sort -V -r); do
        if [ -x "$dir/initdb" ] && [ -x "$dir/pg_ctl" ]; then
            printf '%s\n' "$dir"
            return 0
        fi
    done
    if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
        dirname "$(readlink -f "$(command -v initdb)")"
        return 0
    fi
    return 1
}

version_of() { "$1/pg_ctl" --version 2>/dev/null | head -n1; }

if bindir=$(find_bindir); then
    log "already installed: $bindir ($(version_of "$bindir"))"
    exit 0
fi

log "initdb/pg_ctl not found under /usr/lib/postgresql/*/bin nor on PATH; installing Debian package 'postgresql'"
command -v apt-get >/dev/null 2>&1 \
    || die "apt-get not found; install the PostgreSQL server (initdb, pg_ctl) by other means"

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        die "not root and no passwordless sudo; run as root: apt-get install -y --no-install-recommends postgresql"
    fi
fi

export DEBIAN_FRONTEND=noninteractive
start=$(date +%s%N)
"${SUDO[@]}" apt-get update -qq \
    || die "'apt-get update' failed (is the Debian mirror reachable?)"
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends postgresql >/dev/null \
    || die "'apt-get install postgresql' failed; see apt's output above"
elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))

bindir=$(find_bindir) \
    || die "package 'postgresql' installed but initdb/pg_ctl are still missing under /usr/lib/postgresql/*/bin"
id postgres >/dev/null 2>&1 \
    || die "package 'postgresql' installed but the 'postgres' system user is missing"

# Stop the default cluster the package may have started: nothing here uses it.
if command -v pg_lsclusters >/dev/null 2>&1; then
    pg_lsclusters --no-header 2>/dev/null | while read -r version cluster _port status _rest; do
        if [ "$status" = "online" ]; then
            log "stopping the package's default cluster $version/$cluster (the tests start their own)"
            "${SUDO[@]}" pg_ctlcluster "$version" "$cluster" stop || true
        fi
    done
fi

log "installed in $((elapsed_ms / 1000)).$(printf '%03d' $((elapsed_ms % 1000)))s: $bindir ($(version_of "$bindir"))"
