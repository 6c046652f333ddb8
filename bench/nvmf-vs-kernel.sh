#!/usr/bin/env bash
# Basalt's NVMe/TCP target against the Linux kernel's (nvmet-tcp), both inside one small
# Linux guest (scripts/guest, QEMU TCG), both measured by the guest kernel's NVMe/TCP
# initiator with fio over the guest's loopback: nvmet exports a brd RAM disk, `basalt
# target` (the host's release binary, shared into the guest over 9p) a malloc bdev of the
# same size. Issue #4 aims at >= 1.0x the kernel target.
#
# Cases: 4k randread and randwrite at QD1 and QD32 (libaio, direct, one job); for each
# case the kernel target runs first and Basalt right after. Under TCG everything is many
# times slower than native: only the ratio means something.
#
# Usage: bench/nvmf-vs-kernel.sh [REPORT.md]
# Environment: SIZE_MIB (namespace size, default 256), RUNTIME (seconds per run, default
# 10), BASALT (default target/release/basalt, built if absent), DEPTHS (queue depths,
# default "1 32"), TARGET_ARGS (more arguments for `basalt target`, e.g. "-m 1
# --poll-us 1000"), TARGET_CPUS (CPUs the target runs on, `taskset -c` form), FIO_CPUS
# (CPUs fio runs on, for both targets).
set -euo pipefail

if [ "${1:-}" != "--guest" ]; then
    SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    REPO_ROOT=$(cd "$SCRIPT_DIR/.." && pwd)
    REPORT=${1:-}
    BASALT=${BASALT:-$REPO_ROOT/target/release/basalt}
    if [ ! -x "$BASALT" ]; then
        (cd "$REPO_ROOT" && cargo build --release -p basalt) >&2
    fi
    share=$(mktemp -d "${TMPDIR:-/tmp}/basalt-nvmf-kernel.XXXXXX")
    trap 'rm -rf "$share"' EXIT
    cp "$BASALT" "$share/basalt"
    console=$share/console.log
    BASALT_GUEST_MEMORY=${BASALT_GUEST_MEMORY:-2G} BASALT_GUEST_TIMEOUT=1200 \
        "$REPO_ROOT/scripts/guest/run.sh" "$0" --guest "${SIZE_MIB:-256}" "${RUNTIME:-10}" \
        "${DEPTHS:-1 32}" "${TARGET_ARGS:-}" "${TARGET_CPUS:-}" "${FIO_CPUS:-}" -- \
        -virtfs "local,path=$share,mount_tag=host,security_model=none,id=host" | tee "$console" >&2
    {
        echo "# NVMe/TCP: Basalt vs the Linux kernel target in one guest ($(date -u +%Y-%m-%d), commit $(git -C "$REPO_ROOT" rev-parse --short HEAD), ${RUNTIME:-10}s per run${TARGET_ARGS:+, target $TARGET_ARGS}${TARGET_CPUS:+ on CPUs $TARGET_CPUS}${FIO_CPUS:+, fio on CPUs $FIO_CPUS}, TCG)"
        echo
        echo "| case | kernel IOPS | kernel mean µs | Basalt IOPS | Basalt mean µs | Basalt / kernel |"
        echo "|---|---:|---:|---:|---:|---:|"
        awk -v peer=kernel -f "$SCRIPT_DIR/guest-results.awk" "$console"
    } | if [ -n "$REPORT" ]; then tee "$REPORT"; else cat; fi
    exit 0
fi

# --- inside the guest -------------------------------------------------------------------
size_mib=$2
runtime=$3
depths=${4:-1 32}
target_args=${5:-}
target_cpus=${6:-}
fio_cpus=${7:-}
pin_target=()
[ -z "$target_cpus" ] || pin_target=(taskset -c "$target_cpus")
pin_fio=()
[ -z "$fio_cpus" ] || pin_fio=(--cpus_allowed="$fio_cpus")
kernel_nqn=nqn.2014-08.io.basalt:kernel
basalt_nqn=nqn.2016-06.io.basalt:guest

mkdir -p /mnt/host
mount -t 9p -o trans=virtio,version=9p2000.L host /mnt/host

modprobe brd rd_nr=1 rd_size=$((size_mib * 1024))
modprobe nvmet-tcp
cfs=/sys/kernel/config/nvmet
mkdir "$cfs/subsystems/$kernel_nqn"
echo 1 >"$cfs/subsystems/$kernel_nqn/attr_allow_any_host"
mkdir "$cfs/subsystems/$kernel_nqn/namespaces/1"
echo /dev/ram0 >"$cfs/subsystems/$kernel_nqn/namespaces/1/device_path"
echo 1 >"$cfs/subsystems/$kernel_nqn/namespaces/1/enable"
mkdir "$cfs/ports/1"
echo tcp >"$cfs/ports/1/addr_trtype"
echo ipv4 >"$cfs/ports/1/addr_adrfam"
echo 127.0.0.1 >"$cfs/ports/1/addr_traddr"
echo 4420 >"$cfs/ports/1/addr_trsvcid"
ln -s "$cfs/subsystems/$kernel_nqn" "$cfs/ports/1/subsystems/$kernel_nqn"

# shellcheck disable=SC2086 # the target's extra arguments are words
${pin_target[@]+"${pin_target[@]}"} /mnt/host/basalt target -r /tmp/rpc.sock $target_args >/tmp/basalt.log 2>&1 &
for _ in $(seq 100); do [ -S /tmp/rpc.sock ] && break; sleep 0.1; done
rpc() { /mnt/host/basalt rpc -s /tmp/rpc.sock "$@" >/dev/null; }
rpc bdev_malloc_create "{\"name\":\"m0\",\"num_blocks\":$((size_mib * 2048)),\"block_size\":512}"
rpc nvmf_create_transport '{"trtype":"TCP"}'
rpc nvmf_create_subsystem "{\"nqn\":\"$basalt_nqn\",\"allow_any_host\":true}"
rpc nvmf_subsystem_add_ns "{\"nqn\":\"$basalt_nqn\",\"namespace\":{\"bdev_name\":\"m0\"}}"
rpc nvmf_subsystem_add_listener "{\"nqn\":\"$basalt_nqn\",\"listen_address\":{\"trtype\":\"TCP\",\"adrfam\":\"IPv4\",\"traddr\":\"127.0.0.1\",\"trsvcid\":\"4421\"}}"

modprobe nvme-tcp
nvme connect -t tcp -a 127.0.0.1 -s 4420 -n "$kernel_nqn"
nvme connect -t tcp -a 127.0.0.1 -s 4421 -n "$basalt_nqn"
device_of() {
  local dir ns
  for _ in $(seq 100); do
    for dir in /sys/class/nvme-subsystem/nvme-subsys* /sys/class/nvme/nvme*; do
      [ "$(cat "$dir/subsysnqn" 2>/dev/null)" = "$1" ] || continue
      for ns in "$dir"/nvme*n1; do
        case "${ns##*/}" in *c*n*) continue ;; esac
        [ -b "/dev/${ns##*/}" ] && { echo "/dev/${ns##*/}"; return 0; }
      done
    done
    sleep 0.1
  done
  return 1
}
kernel_device=$(device_of "$kernel_nqn")
basalt_device=$(device_of "$basalt_nqn")
nvme list
# Written once, so that reads return data (in 64 KiB writes: 1 MiB writes crash the
# 6.1 kernel target under hardened usercopy, "kernel BUG at mm/usercopy.c:101").
for device in "$kernel_device" "$basalt_device"; do
  timeout 300 fio --name=fill --filename="$device" --direct=1 --ioengine=libaio --iodepth=8 --rw=write \
    --bs=64k --size=$((size_mib))M >/dev/null
done

# Terse output (version 3): read IOPS in field 8, read mean latency (µs) in 40; write
# IOPS in 49, write mean latency in 81.
for rw in randread randwrite; do
  for qd in $depths; do
    for who in kernel basalt; do
      device=$kernel_device
      [ "$who" = basalt ] && device=$basalt_device
      line=$(timeout $((runtime * 3 + 60)) fio --name=bench ${pin_fio[@]+"${pin_fio[@]}"} --filename="$device" --direct=1 --ioengine=libaio --iodepth="$qd" \
        --rw="$rw" --bs=4k --runtime="$runtime" --time_based --ramp_time=2 --minimal)
      if [ "$rw" = randread ]; then
        echo "$line" | awk -F';' -v who="$who" -v rw="$rw" -v qd="$qd" '{ printf "RESULT %s %s %s %s %s\n", who, rw, qd, $8, $40 }'
      else
        echo "$line" | awk -F';' -v who="$who" -v rw="$rw" -v qd="$qd" '{ printf "RESULT %s %s %s %s %s\n", who, rw, qd, $49, $81 }'
      fi
    done
  done
done
nvme disconnect -n "$kernel_nqn"
nvme disconnect -n "$basalt_nqn"
