#!/usr/bin/env bash
# The device's test subset on every Python that pyenv holds (3.10 and newer), each in a fresh environment
# with only what a device installs: `pip install .` (fedsdk's declared dependencies: numpy 2, onnxruntime,
# phe, paho-mqtt, psutil, cryptography; no gmpy2, TenSEAL, scikit-learn, aiohttp: Termux's package set)
# plus pytest, pytest-asyncio, pytest-timeout and hypothesis. Runs `tests/sdk` (or the pytest arguments
# given) with FEDSDK_DEVICE_ONLY=1: a test that needs a package a device does not install is reported as
# skipped and named, any other failure fails (tests/device_only.py). Not part of CI (minutes per Python).
#
#   bash scripts/test_pythons.sh                 # tests/sdk on each pyenv Python >= 3.10
#   PYTHONS="3.10.13 3.13.0" bash scripts/test_pythons.sh tests/sdk/test_conditions.py
#
# Environments are kept in $VENVS (default ${TMPDIR:-/tmp}/fedsdk-device-venvs) and reused; the package is
# reinstalled from this checkout at each run.
#
# Then, with a coordinator environment ($COORDINATOR_PYTHON, default .venv/bin/python as scripts/test.sh
# makes it, when it has aiohttp), tests/integration/test_device_only.py runs a protected federation whose
# devices run on that Python (FEDSDK_DEVICE_PYTHON) while the coordinator runs in the other environment.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYENV_ROOT=${PYENV_ROOT:-$HOME/.pyenv}
VENVS=${VENVS:-${TMPDIR:-/tmp}/fedsdk-device-venvs}
if [ $# -eq 0 ]; then set -- tests/sdk; fi
COORDINATOR_PYTHON=${COORDINATOR_PYTHON:-$ROOT/.venv/bin/python}
if ! "$COORDINATOR_PYTHON" -c 'import aiohttp, sklearn, onnx' 2>/dev/null; then
    echo "no coordinator environment at $COORDINATOR_PYTHON: the federation with devices on each Python is not run"
    COORDINATOR_PYTHON=""
fi
if [ -z "${PYTHONS:-}" ]; then
    PYTHONS=$(ls "$PYENV_ROOT/versions" 2>/dev/null || true)
fi
mkdir -p "$VENVS"
had_egg_info=0
[ -d "$ROOT/fedsdk.egg-info" ] && had_egg_info=1  # an editable install's: left alone
declare -a summary=()
status=0
for version in $PYTHONS; do
    python="$PYENV_ROOT/versions/$version/bin/python"
    if [ ! -x "$python" ] || ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        continue  # fedsdk needs Python 3.10 or newer
    fi
    venv="$VENVS/py$version"
    echo "== Python $version: $venv"
    if [ ! -x "$venv/bin/python" ]; then
        "$python" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
    fi
    log="$VENVS/py$version.log"
    {
        "$venv/bin/python" -m pip install -q "$ROOT" "numpy>=2" pytest pytest-asyncio pytest-timeout hypothesis
        "$venv/bin/python" -m pip install -q --force-reinstall --no-deps "$ROOT"  # this checkout's code
    } >"$log.pip" 2>&1 || { echo "   pip failed: $log.pip" >&2; exit 1; }
    rm -rf "$ROOT/build"  # what the wheel build leaves in the checkout
    [ "$had_egg_info" = 1 ] || rm -rf "$ROOT/fedsdk.egg-info"
    if (cd "$ROOT" && FEDSDK_DEVICE_ONLY=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider \
            --timeout 300 -rfs "$@" >"$log" 2>&1); then
        result="passed"
    else
        result="FAILED"
        status=1
    fi
    line=$(grep -E '^[0-9]+ (passed|failed)|[0-9]+ (passed|failed).* in [0-9.]+s' "$log" | tail -1 || true)
    if [ -n "$COORDINATOR_PYTHON" ]; then
        fed_log="$VENVS/py$version.federation.log"
        if (cd "$ROOT" && FEDSDK_DEVICE_PYTHON="$venv/bin/python" \
                PYTHONPATH="$ROOT/sdk:$ROOT/coordinator:$ROOT/benchmarks:$ROOT/tests" \
                "$COORDINATOR_PYTHON" -m pytest -q -p no:cacheprovider tests/integration/test_device_only.py \
                >"$fed_log" 2>&1); then
            line="$line; federation with devices on $version: passed"
        else
            line="$line; federation with devices on $version: FAILED ($fed_log)"
            result="FAILED"
            status=1
        fi
    fi
    summary+=("Python $version: $result ($line); log: $log")
    echo "   $result: $line"
done
if [ ${#summary[@]} -eq 0 ]; then
    echo "no Python >= 3.10 under $PYENV_ROOT/versions" >&2
    exit 2
fi
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $status
