#!/usr/bin/env bash
# Test setup for tests/e2e/test_postgres.py: Debian's PostgreSQL server binaries (initdb, pg_ctl, postgres), which
# the test runs itself on a free port in a temporary folder. dagster-postgres comes with `make install` (the
# `postgres` extra). Idempotent; needs root (or passwordless sudo) for apt-get.
set -euo pipefail
if ! command -v postgres >/dev/null && ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends postgresql
fi
ls /usr/lib/postgresql/*/bin/postgres 2>/dev/null || command -v postgres
