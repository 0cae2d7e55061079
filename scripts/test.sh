#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh machine and runs the whole suite.
# Used verbatim by the README and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
apt_install() {  # apt_install WHY PACKAGE...: Debian packages the tests need
    local why=$1; shift
    echo "== installing $* ($why)"
    local sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq "$@" >/dev/null
}
if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
    apt_install "the tests start their own brokers" mosquitto
fi
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    apt_install "the dashboard's browser test drives them headless" chromium chromium-driver
fi
if ! command -v shellcheck >/dev/null 2>&1; then
    apt_install "the tests check the example device scripts" shellcheck
fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"
.venv/bin/mypy
echo "== pytest"
.venv/bin/pytest -q "$@"
