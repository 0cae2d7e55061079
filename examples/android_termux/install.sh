#!/data/data/com.termux/files/usr/bin/bash
# Installs a fedsdk device in Termux (Android): numpy, onnxruntime, cryptography and psutil from Termux's
# packages (pip cannot install manylinux wheels there), phe and paho-mqtt (pure Python) and the kit's fedsdk
# wheel with pip --no-deps into a venv that sees those packages, the kit into ~/.fedsdk (Termux's private
# storage, 0700/0600), ~/.config/fedsdk/device.env, and a termux-services (runit) service; then starts it.
#
#   bash install.sh [--kit DIR] [--wheels DIR] [--data FILE | --demo-data] [--with-gmpy2] [--no-start]
#
# Run from a kit made by `fedsdk provision --with-wheels --platform termux` it needs no option but the
# data. --with-gmpy2 also builds gmpy2 (faster Paillier) against Termux's libgmp; it is optional and a
# failed build only prints a warning. Re-running upgrades fedsdk and keeps an edited device.env.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
kit=""
wheels=""
data=""
demo=0
gmpy2=0
start=1
die() {
    echo "install.sh: $*" >&2
    exit 1
}
while [ $# -gt 0 ]; do
    case "$1" in
        --kit) kit="${2:?--kit DIR}"; shift 2 ;;
        --wheels) wheels="${2:?--wheels DIR}"; shift 2 ;;
        --data) data="${2:?--data FILE}"; shift 2 ;;
        --demo-data) demo=1; shift ;;
        --with-gmpy2) gmpy2=1; shift ;;
        --no-start) start=0; shift ;;
        -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done
if [ -z "${PREFIX:-}" ] || [ ! -d "$PREFIX/var" ]; then die "run it inside Termux (PREFIX is not set)"; fi
if [ -z "$kit" ] && [ -f "$here/fedsdk.json" ]; then kit="$here"; fi
if [ -z "$kit" ] || [ ! -f "$kit/fedsdk.json" ]; then die "no kit: pass --kit DIR (a device kit from fedsdk provision)"; fi
if [ -z "$wheels" ]; then
    if [ -d "$kit/wheels" ]; then wheels="$kit/wheels"; else wheels="$here/wheels"; fi
fi
compgen -G "$wheels/fedsdk-*.whl" > /dev/null || die "no fedsdk wheel in $wheels (fedsdk provision --with-wheels)"
[ -z "$data" ] || [ -r "$data" ] || die "cannot read --data $data"

base="$HOME/.fedsdk"
venv="$base/venv"
conf="$HOME/.config/fedsdk/device.env"
service="$PREFIX/var/service/fedsdk-device"

echo "== Termux packages (compiled dependencies)"
# termux-api: the run conditions read the battery and the Wi-Fi through it (with the Termux:API app)
pkg install -y python python-numpy python-onnxruntime python-cryptography python-psutil termux-services \
    termux-api

echo "== venv $venv (sees Termux's packages; pip installs pure Python only)"
[ -x "$venv/bin/python" ] || python -m venv --system-site-packages "$venv"
pip_install() { "$venv/bin/pip" install -q --disable-pip-version-check "$@"; }
# --no-deps: pip must not try to build numpy or cryptography, which Termux's packages already provide
if compgen -G "$wheels/phe-*.whl" > /dev/null && compgen -G "$wheels/paho_mqtt-*.whl" > /dev/null; then
    pip_install --no-index --find-links "$wheels" --no-deps phe paho-mqtt
else
    pip_install --no-deps 'phe>=1.5' 'paho-mqtt>=2.0'
fi
if [ "$gmpy2" -eq 1 ]; then
    pkg install -y clang make libgmp libmpfr libmpc
    pip_install --no-deps gmpy2 || echo "!! gmpy2 did not build; fedsdk runs without it (slower Paillier)"
fi
pip_install --no-index --no-deps --force-reinstall "$(compgen -G "$wheels/fedsdk-*.whl" | sort | tail -n 1)"
"$venv/bin/python" -c 'import numpy, onnxruntime, cryptography, psutil, phe, paho.mqtt, fedsdk; print("imports ok: numpy", numpy.__version__, "onnxruntime", onnxruntime.__version__)'
install -d -m 0700 "$base" "$base/bin" "$base/data"
install -m 0755 "$here/fedsdk-device-run" "$base/bin/fedsdk-device-run"

echo "== kit and data in $base (0700/0600)"
rm -rf "$base/kit.new"
install -d -m 0700 "$base/kit.new"
cp -r "$kit/fedsdk.json" "$kit/ca.pem" "$kit/client.pem" "$kit/client.key" "$kit/he" "$base/kit.new/"
find "$base/kit.new" -type d -exec chmod 0700 {} +
find "$base/kit.new" -type f -exec chmod 0600 {} +
rm -rf "$base/kit"
mv "$base/kit.new" "$base/kit"
"$venv/bin/python" -c 'import sys; from fedsdk.kit import load_kit; k = load_kit(sys.argv[1]); print(f"kit ok: {k.client_id} in {k.federation} via {k.broker_url}")' "$base/kit"
data_target=""
if [ -n "$data" ]; then
    data_target="$base/data/local.${data##*.}"
    install -m 0600 "$data" "$data_target"
elif [ "$demo" -eq 1 ]; then
    data_target="$base/data/local.npz"
    "$venv/bin/python" - "$data_target" "$(basename "$kit")" << 'PY'
import sys
import zlib

import numpy as np

from fedsdk.model.data import load_digits, save_npz

digits = load_digits(shape="flat")
rng = np.random.default_rng(zlib.crc32(sys.argv[2].encode()))
idx = rng.choice(len(digits.y_train), size=len(digits.y_train) // 4, replace=False)
save_npz(sys.argv[1], digits.x_train[idx], digits.y_train[idx])
print(f"demo data: {len(idx)} handwritten digits in {sys.argv[1]}")
PY
fi

echo "== config $conf, service $service"
install -d -m 0700 "$(dirname "$conf")"
[ -f "$conf" ] || install -m 0600 "$here/fedsdk-device.env" "$conf"
sed -i "s|/data/data/com.termux/files/home|$HOME|" "$conf"
[ -z "$data_target" ] || sed -i "s|^FEDSDK_DATA=.*|FEDSDK_DATA=$data_target|" "$conf"
install -d "$service/log"
for f in run log/run; do
    sed "1s|.*|#!$PREFIX/bin/sh|" "$here/service/fedsdk-device/$f" > "$service/$f"
    chmod 0700 "$service/$f"
done

if [ "$start" -eq 0 ]; then
    touch "$service/down"
    echo "installed, not started: sv up fedsdk-device"
elif [ -z "${SVDIR:-}" ]; then
    echo "installed; termux-services starts with a new Termux session: close this one, open Termux again, then"
    echo "  sv up fedsdk-device"
else
    rm -f "$service/down"
    sv up fedsdk-device
    echo "started; log: tail -f $PREFIX/var/log/sv/fedsdk-device/current"
fi
echo "Install the Termux:API app (same source as Termux) for the run conditions to read battery and Wi-Fi."
echo "Keep Termux's notification (Acquire wakelock), exempt Termux from battery optimisation; on Android 12+"
echo "see README.md for the phantom-process limit that otherwise kills the service in the background."
