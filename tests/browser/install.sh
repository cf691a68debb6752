#!/usr/bin/env bash
# Test setup for tests/e2e/test_browser.py: Debian's headless Chromium (never a browser download by Playwright)
# and the Playwright Python driver. Idempotent; needs root (or passwordless sudo) for apt-get.
set -euo pipefail
if [ ! -x /usr/bin/chromium ]; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver
fi
PY="${1:-.venv/bin/python}"
# playwright's wheel bundles its node driver only; PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD keeps it that way.
PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 "$PY" -m pip install -q -c constraints.txt "playwright>=1.45"
/usr/bin/chromium --version
