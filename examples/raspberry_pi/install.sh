#!/usr/bin/env bash
# Installs a fedsdk device on Raspberry Pi OS 64-bit (Debian bookworm) or another systemd Debian:
# a system user, a venv with fedsdk installed offline from wheels, the device kit (readable by that user
# only), /etc/fedsdk/device.env, the fedsdk-device systemd unit; then enables and starts it.
#
#   sudo bash install.sh [--kit DIR] [--wheels DIR] [--data FILE | --demo-data] [--no-start]
#
# Run from a kit made by `fedsdk provision --with-wheels` (it carries this script and wheels/), it needs
# no option but the data. Options:
#   --kit DIR      the device kit (default: this script's directory when it holds fedsdk.json)
#   --wheels DIR   the wheels to install from, no index used (default: <kit>/wheels, else ./wheels)
#   --data FILE    the local samples (.npz or .csv), copied to /var/lib/fedsdk/data/
#   --demo-data    write a share of fedsdk's bundled handwritten digits instead, to try it out
#   --no-start     install and enable, do not start (also automatic where systemd is not running)
#   --root DIR     install into DIR as a root file system: no user, no ownership change, no systemctl
#                  (image building and tests; the venv works only at DIR/opt/fedsdk/venv)
# FEDSDK_PYTHON names the interpreter the venv is made from (default python3).
# Re-running upgrades fedsdk from the given wheels and keeps an edited /etc/fedsdk/device.env.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
user=fedsdk
kit=""
wheels=""
data=""
demo=0
start=1
root=""

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
        --no-start) start=0; shift ;;
        --root) root="${2:?--root DIR}"; shift 2 ;;
        -h | --help) sed -n '2,19p' "$0"; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

if [ -z "$kit" ] && [ -f "$here/fedsdk.json" ]; then kit="$here"; fi
[ -n "$kit" ] || die "no kit: pass --kit DIR (a device kit from fedsdk provision)"
[ -f "$kit/fedsdk.json" ] || die "$kit is not a kit (no fedsdk.json)"
if [ -z "$wheels" ]; then
    if [ -d "$kit/wheels" ]; then wheels="$kit/wheels"; else wheels="$here/wheels"; fi
fi
compgen -G "$wheels/fedsdk-*.whl" > /dev/null || die "no fedsdk wheel in $wheels (fedsdk provision --with-wheels)"
[ -z "$data" ] || [ -r "$data" ] || die "cannot read --data $data"
if [ -z "$root" ] && [ "$(id -u)" -ne 0 ]; then die "run it as root (sudo bash $0 ...)"; fi
if [ -n "$root" ]; then
    mkdir -p "$root"
    root="$(cd "$root" && pwd)"
fi

python="${FEDSDK_PYTHON:-python3}"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "fedsdk needs Python >= 3.10"
"$python" -c 'import ensurepip, venv' 2> /dev/null || die "$python cannot make a venv: apt-get install -y python3-venv"

prefix="$root/opt/fedsdk"
venv="$prefix/venv"
state="$root/var/lib/fedsdk"
conf="$root/etc/fedsdk/device.env"
unit="$root/etc/systemd/system/fedsdk-device.service"

echo "== service user $user"
if [ -z "$root" ] && ! getent passwd "$user" > /dev/null; then
    useradd --system --user-group --home-dir /var/lib/fedsdk --no-create-home \
        --shell /usr/sbin/nologin --comment "fedsdk device" "$user"
fi

echo "== venv $venv (fedsdk from $wheels, no index)"
# root owns the venv: the service runs its code and cannot change it
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
extra=""
if compgen -G "$wheels/gmpy2-*.whl" > /dev/null; then extra="[fast]"; fi
"$venv/bin/pip" install -q --disable-pip-version-check --no-index --find-links "$wheels" "fedsdk$extra"
# the kit's own fedsdk wheel, also when a fedsdk of the same version is installed already
"$venv/bin/pip" install -q --disable-pip-version-check --no-index --no-deps --force-reinstall \
    "$(compgen -G "$wheels/fedsdk-*.whl" | sort | tail -n 1)"
install -d -m 0755 "$prefix/bin"
install -m 0755 "$here/fedsdk-device-run" "$prefix/bin/fedsdk-device-run"

echo "== kit and data in $state (mode 0700, owner $user)"
install -d -m 0700 "$state" "$state/kit" "$state/data"
rm -rf "$state/kit.new" "$state/consecutive-failures"  # a new install starts without backoff
install -d -m 0700 "$state/kit.new"
cp -r "$kit/fedsdk.json" "$kit/ca.pem" "$kit/client.pem" "$kit/client.key" "$kit/he" "$state/kit.new/"
find "$state/kit.new" -type d -exec chmod 0700 {} +
find "$state/kit.new" -type f -exec chmod 0600 {} +
rm -rf "$state/kit"
mv "$state/kit.new" "$state/kit"
data_target=""
if [ -n "$data" ]; then
    data_target="$state/data/local.${data##*.}"
    install -m 0600 "$data" "$data_target"
elif [ "$demo" -eq 1 ]; then
    data_target="$state/data/local.npz"
    client_id="$("$venv/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["client_id"])' "$kit/fedsdk.json")"
    "$venv/bin/python" - "$data_target" "$client_id" << 'PY'
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
    chmod 0600 "$data_target"
fi
if [ -z "$root" ]; then chown -R "$user:$user" "$state"; fi

echo "== config $conf, unit $unit"
install -d -m 0755 "$(dirname "$conf")" "$(dirname "$unit")"
if [ ! -f "$conf" ]; then install -m 0644 "$here/fedsdk-device.env" "$conf"; fi
if [ -n "$data_target" ]; then
    sed -i "s|^FEDSDK_DATA=.*|FEDSDK_DATA=${data_target#"$root"}|" "$conf"
fi
install -m 0644 "$here/fedsdk-device.service" "$unit"

echo "== checking the kit as the service would load it"
check='import sys; from fedsdk.kit import load_kit; k = load_kit(sys.argv[1]); print(f"kit ok: {k.client_id} in {k.federation} via {k.broker_url}")'
if [ -z "$root" ]; then
    runuser -u "$user" -- "$venv/bin/python" -c "$check" "$state/kit"
else
    "$venv/bin/python" -c "$check" "$state/kit"
fi

data_file="$(sed -n 's/^FEDSDK_DATA=//p' "$conf")"
if [ -n "$root" ] || [ ! -d /run/systemd/system ]; then
    echo "installed; systemd is not running here, so start it by hand (as $user):"
    echo "  runuser -u $user -- /opt/fedsdk/bin/fedsdk-device-run"
    exit 0
fi
systemctl daemon-reload
systemctl enable fedsdk-device.service
if [ "$start" -eq 0 ]; then
    echo "installed and enabled; start it with: systemctl start fedsdk-device"
elif [ ! -r "$root$data_file" ]; then
    echo "installed and enabled, not started: no data at $data_file (install.sh --data FILE, or edit $conf)"
else
    systemctl restart fedsdk-device.service
    echo "started; follow it with: journalctl -u fedsdk-device -f"
fi
