#!/usr/bin/env bash
# Verifies the Raspberry Pi kit on an emulated Pi: a Debian bookworm arm64 userland (what Raspberry Pi OS
# 64-bit is built on, Python 3.11) run under qemu user mode in a chroot, with a Raspberry-Pi-4-style
# /proc/cpuinfo bound in (onnxruntime's cpuinfo warns and crashes on the host's x86 one).
#
#   sudo bash examples/raspberry_pi/verify_arm64.sh   (Debian/Ubuntu x86_64 host; 5-10 min the first time,
#                                                      about 1 min once the userland is kept)
#
# 1. installs qemu-user-static, debootstrap, binfmt-support, mosquitto if missing; enables qemu-aarch64
# 2. debootstraps bookworm arm64 into $FEDSDK_VERIFY_DIR/rootfs (kept and reused by later runs)
# 3. provisions a fleet on the host with `fedsdk provision --with-wheels --platform arm64`: devices pi-01
#    (emulated) and host-01 (a host process, to make the quorum of two)
# 4. copies kit pi-01 into the chroot and runs its install.sh there, offline (no index, the kit's wheels)
# 5. starts mosquitto with the fleet's mutual-TLS broker config, the coordinator (strategy fedsdk, packed
#    Paillier 2048 bits, 2 rounds, quorum 2) and host-01 on the host
# 6. runs in the chroot, as the service user, the command line fedsdk-device.service runs
#    (systemd does not run in a chroot), and checks that pi-01 finished both rounds
# Everything it started is stopped and every mount undone on exit. PYTHON names the host's Python with
# fedsdk[coordinator] (default: the repository's .venv, else python3). Exit 0 when the Pi joined and
# finished; the last lines say what each process reported.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
work="${FEDSDK_VERIFY_DIR:-/var/tmp/fedsdk-verify-arm64}"
rootfs="$work/rootfs"
rounds="${ROUNDS:-2}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then PYTHON="$repo/.venv/bin/python"; else PYTHON=python3; fi
fi
[ "$(id -u)" -eq 0 ] || { echo "verify_arm64.sh: run it as root (chroot, mounts, apt-get)" >&2; exit 1; }
"$PYTHON" -c 'import fedsdk_coordinator, aiohttp' || {
    echo "verify_arm64.sh: $PYTHON lacks fedsdk[coordinator] (set PYTHON)" >&2
    exit 1
}

log() { echo "[$(date +%T)] $*"; }

pids=()
mounts=()
# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
    local status=$?
    for pid in "${pids[@]}"; do
        kill "$pid" 2> /dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2> /dev/null || true
    done
    # whatever still runs inside the chroot
    local proc
    for proc in /proc/[0-9]*; do
        if [ "$(readlink "$proc/root" 2> /dev/null)" = "$rootfs" ]; then kill "${proc#/proc/}" 2> /dev/null || true; fi
    done
    sleep 1
    local i
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
        umount "${mounts[i]}" 2> /dev/null || umount -l "${mounts[i]}" 2> /dev/null || true
    done
    log "cleaned up (exit $status)"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log "1. host tools"
need=()
command -v qemu-aarch64-static > /dev/null || need+=(qemu-user-static)
command -v debootstrap > /dev/null || need+=(debootstrap)
command -v update-binfmts > /dev/null || need+=(binfmt-support)
command -v mosquitto > /dev/null || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" > /dev/null
fi
mosquitto_bin="$(command -v mosquitto || echo /usr/sbin/mosquitto)"
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
update-binfmts --enable qemu-aarch64 2> /dev/null || true
grep -q enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 || { echo "qemu-aarch64 binfmt is not enabled" >&2; exit 1; }

log "2. bookworm arm64 userland in $rootfs"
mkdir -p "$work"
if [ ! -f "$work/rootfs.done" ]; then
    if grep -q " $rootfs/" /proc/mounts; then
        echo "something is still mounted under $rootfs (an earlier run killed hard?): unmount it first" >&2
        exit 1
    fi
    rm -rf "$rootfs"
    # the Debian mirror apt uses here, else deb.debian.org
    mirror="$(sed -n 's/^URIs: *\(http[^ ]*\/debian\)\/*$/\1/p; s/^deb \[*[^]]*\]* *\(http[^ ]*\/debian\)\/* bookworm .*/\1/p' \
        /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2> /dev/null | head -n 1 || true)"
    mirror="${mirror:-http://deb.debian.org/debian}"
    debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates,procps \
        bookworm "$rootfs" "$mirror" > "$work/debootstrap.log" 2>&1 || {
        tail -n 20 "$work/debootstrap.log"
        exit 1
    }
    touch "$work/rootfs.done"
fi
"$PYTHON" - "$work/cpuinfo" << 'PY'
import os
import sys

# /proc/cpuinfo of a Raspberry Pi 4 (Cortex-A72, 64-bit kernel), one entry per host CPU so that it agrees
# with /sys/devices/system/cpu, which the chroot shares with the host
cpu = (
    "processor\t: {}\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU implementer\t: 0x41\n"
    "CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd08\nCPU revision\t: 3\n\n"
)
tail = "Revision\t: c03111\nSerial\t\t: 10000000c0ffee00\nModel\t\t: Raspberry Pi 4 Model B Rev 1.1\n"
with open(sys.argv[1], "w") as f:
    f.write("".join(cpu.format(i) for i in range(os.cpu_count() or 1)) + tail)
PY
mounts+=("$rootfs/proc")
mount -t proc proc "$rootfs/proc"
mounts+=("$rootfs/proc/cpuinfo")
mount --bind "$work/cpuinfo" "$rootfs/proc/cpuinfo"
mounts+=("$rootfs/sys")
mount --bind /sys "$rootfs/sys"
mounts+=("$rootfs/dev")
mount --bind /dev "$rootfs/dev"
mounts+=("$rootfs/tmp")
mount -t tmpfs tmpfs "$rootfs/tmp"
cp /etc/resolv.conf "$rootfs/etc/resolv.conf" 2> /dev/null || true
in_pi() { chroot "$rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"; }
log "   $(in_pi uname -m), Debian $(cat "$rootfs/etc/debian_version"), $(in_pi python3 -V)"

log "3. fleet with kit wheels for arm64"
run="$work/run"
rm -rf "$run"
mkdir -p "$run/data" "$run/logs"
chmod 0755 "$work" "$run"
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port="$(free_port)"
http_port="$(free_port)"
cat > "$run/fleet.json" << EOF
{
  "federation": "pi-verify",
  "devices": ["pi-01", "host-01"],
  "coordinator": {"host": "127.0.0.1", "http_port": $http_port},
  "broker": {"hosts": ["127.0.0.1"], "port": $port, "bind": "127.0.0.1",
             "config_dir": "$run/broker", "persistence_dir": "$run/mosquitto-data/"},
  "key_mode": "shared",
  "he": {"backend": "packed", "options": {"key_bits": 2048}}
}
EOF
"$PYTHON" -m fedsdk provision --fleet "$run/fleet.json" --out "$run/fleet" --with-wheels --platform arm64 \
    > "$run/logs/provision.txt" 2>&1 || { cat "$run/logs/provision.txt"; exit 1; }
grep -E "^  (device|provisioned)" "$run/logs/provision.txt" || true
cat "$run/fleet/devices/pi-01/bundle.json"
"$PYTHON" - "$run/data" << 'PY'
import sys

import numpy as np

from fedsdk.model.data import load_digits, save_npz

digits = load_digits(shape="flat")
order = np.random.default_rng(7).permutation(len(digits.y_train))
for name, idx in (("pi-01", order[::2]), ("host-01", order[1::2])):
    save_npz(f"{sys.argv[1]}/{name}.npz", digits.x_train[idx], digits.y_train[idx])
PY

log "4. install.sh in the chroot, offline, from the kit's wheels"
# a fresh configuration every run (install.sh keeps an existing one)
rm -rf "$rootfs/root/pi-01" "$rootfs/root/pi-01.npz" "$rootfs/etc/fedsdk/device.env"
cp -r "$run/fleet/devices/pi-01" "$rootfs/root/pi-01"
cp "$run/data/pi-01.npz" "$rootfs/root/pi-01.npz"
start=$(date +%s)
in_pi bash /root/pi-01/install.sh --data /root/pi-01.npz 2>&1 | tee "$run/logs/install.txt"
log "   install.sh took $(($(date +%s) - start)) s"
in_pi runuser -u fedsdk -- /opt/fedsdk/venv/bin/python -c \
    'import platform, numpy, onnxruntime, gmpy2, fedsdk; print("   ", platform.machine(), platform.python_version(), "numpy", numpy.__version__, "onnxruntime", onnxruntime.__version__, "gmpy2", gmpy2.version())'
ls -ld "$rootfs/var/lib/fedsdk" "$rootfs/var/lib/fedsdk/kit" "$rootfs/var/lib/fedsdk/kit/client.key"
# every run condition on, as a phone would have them (a Pi has no battery, so the battery ones hold; here
# the chroot reads the host's /sys); an older fedsdk join without the flags refuses them, so they go
if in_pi /opt/fedsdk/venv/bin/fedsdk join --help | grep -q -- --max-temp; then
    sed -i 's/^FEDSDK_ONLY_CHARGING=.*/FEDSDK_ONLY_CHARGING=1/; s/^FEDSDK_MIN_BATTERY=.*/FEDSDK_MIN_BATTERY=20/
        s/^FEDSDK_ONLY_UNMETERED=.*/FEDSDK_ONLY_UNMETERED=1/' "$rootfs/etc/fedsdk/device.env"
else
    log "   this fedsdk join has no run-condition flags: clearing them in /etc/fedsdk/device.env"
    sed -i 's/^FEDSDK_MAX_TEMP=.*/FEDSDK_MAX_TEMP=/; s/^FEDSDK_MIN_BATTERY=.*/FEDSDK_MIN_BATTERY=/' \
        "$rootfs/etc/fedsdk/device.env"
fi
sed -i 's/^FEDSDK_IDLE_TIMEOUT=.*/FEDSDK_IDLE_TIMEOUT=1800/' "$rootfs/etc/fedsdk/device.env"
grep -v '^#' "$rootfs/etc/fedsdk/device.env" | grep -v '^$'

log "5. mosquitto (mutual TLS) on 127.0.0.1:$port, coordinator, host-01"
# the broker's files where mosquitto.system.conf names them (broker.config_dir), as certs/README.md installs them
b="$run/broker"
install -d -m 0755 "$b"
install -m 0644 "$run/fleet/broker/"{ca.pem,server.pem,crl.pem,acl} "$b/"
install -m 0644 "$run/fleet/broker/mosquitto.system.conf" "$b/mosquitto.conf"
install -m 0600 -o mosquitto "$run/fleet/broker/server.key" "$b/"
install -d -o mosquitto -m 0700 "$run/mosquitto-data"
"$mosquitto_bin" -c "$b/mosquitto.conf" > "$run/logs/mosquitto.txt" 2>&1 &
pids+=($!)
for _ in $(seq 50); do
    if (: < "/dev/tcp/127.0.0.1/$port") 2> /dev/null; then break; fi
    sleep 0.2
done
(: < "/dev/tcp/127.0.0.1/$port") 2> /dev/null || { cat "$run/logs/mosquitto.txt"; exit 1; }
"$PYTHON" -m fedsdk coordinator --kit "$run/fleet/coordinator" --strategy fedsdk --rounds "$rounds" \
    --min-clients 2 --start-clients 2 --deadline 900 --exit-when-done --state-dir "$run/state" \
    --json "$run/coordinator.json" > "$run/logs/coordinator.txt" 2>&1 &
coordinator=$!
pids+=("$coordinator")
"$PYTHON" -m fedsdk join --kit "$run/fleet/devices/host-01" --data "$run/data/host-01.npz" \
    --idle-timeout 1800 > "$run/logs/host-01.txt" 2>&1 &
host_device=$!
pids+=("$host_device")

log "6. pi-01 in the chroot: the command line of fedsdk-device.service, as user fedsdk"
start=$(date +%s)
in_pi PYTHONUNBUFFERED=1 HOME=/var/lib/fedsdk bash -c \
    'set -a; . /etc/fedsdk/device.env; set +a; exec runuser -u fedsdk -- /opt/fedsdk/bin/fedsdk-device-run' \
    > "$run/logs/pi-01.txt" 2>&1 &
pi=$!
pids+=("$pi")
tail -n +1 -f "$run/logs/pi-01.txt" &
pids+=($!)
pi_status=0
wait "$pi" || pi_status=$?
sleep 1
log "   pi-01 exited $pi_status after $(($(date +%s) - start)) s"
coord_status=0
wait "$coordinator" || coord_status=$?
host_status=0
wait "$host_device" || host_status=$?
log "coordinator exited $coord_status, host-01 exited $host_status"
tail -n 4 "$run/logs/coordinator.txt"
tail -n 2 "$run/logs/host-01.txt"
if [ "$pi_status" -eq 0 ] && [ "$coord_status" -eq 0 ]; then
    log "VERIFIED: the emulated Raspberry Pi (arm64, bookworm, Python 3.11) installed its kit offline and"
    log "finished $rounds rounds over mutual TLS"
    exit 0
fi
log "FAILED (logs in $run/logs)"
exit 1
