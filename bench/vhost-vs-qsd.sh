#!/usr/bin/env bash
# Basalt's vhost-user-blk controller against qemu-storage-daemon's vhost-user-blk export,
# both serving a file on the host (O_DIRECT, io_uring) to one guest (scripts/guest, QEMU
# TCG) that sees them as /dev/vda (Basalt) and /dev/vdb (qemu-storage-daemon); fio in
# the guest (libaio, direct, one job) measures each, case by case (Basalt first unless
# FIRST=qsd). Issue #5
# aims at >= 1.0x qemu-storage-daemon.
#
# Usage: bench/vhost-vs-qsd.sh [REPORT.md]
# Environment: SIZE_MIB (each file, default 256), RUNTIME (seconds per run, default 10),
# BASALT (default target/release/basalt, built if absent), CPUMASK (the controller's
# cpumask, e.g. 0x1: its requests and its vring thread on CPU 0; default: none), FIRST
# (basalt or qsd: which runs first in each case, default basalt), ROUNDS (runs of each
# case per server, default 1; the first runs first in odd rounds, second in even ones; the
# table shows medians and each round's ratio), QUEUES (virtqueues of each disk, default 1;
# with 2, QD32 runs as two fio jobs of depth 16, one per guest vCPU and so one per queue).
set -euo pipefail

if [ "${1:-}" != "--guest" ]; then
    SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    REPO_ROOT=$(cd "$SCRIPT_DIR/.." && pwd)
    REPORT=${1:-}
    SIZE_MIB=${SIZE_MIB:-256}
    QUEUES=${QUEUES:-1}
    RUNTIME=${RUNTIME:-10}
    BASALT=${BASALT:-$REPO_ROOT/target/release/basalt}
    [ -x "$BASALT" ] || (cd "$REPO_ROOT" && cargo build --release -p basalt) >&2
    case "${FIRST:-basalt}" in basalt | qsd) ;; *) echo "FIRST must be basalt or qsd" >&2; exit 2 ;; esac
    command -v qemu-storage-daemon >/dev/null || { echo "qemu-storage-daemon not found (apt-get install qemu-system-common)" >&2; exit 1; }
    work=$(mktemp -d "${TMPDIR:-/var/tmp}/basalt-vhost-bench.XXXXXX")
    pids=()
    trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
    for disk in basalt qsd; do
        dd if=/dev/zero of="$work/$disk.img" bs=1M count="$SIZE_MIB" status=none
    done
    "$BASALT" target -r "$work/rpc.sock" -S "$work" >"$work/target.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do [ -S "$work/rpc.sock" ] && break; sleep 0.1; done
    rpc() { "$BASALT" rpc -s "$work/rpc.sock" "$@" >/dev/null; }
    rpc bdev_uring_create "{\"filename\":\"$work/basalt.img\",\"name\":\"disk\",\"block_size\":512}"
    rpc vhost_create_blk_controller "{\"ctrlr\":\"vhost.0\",\"dev_name\":\"disk\",\"max_queues\":$QUEUES${CPUMASK:+,\"cpumask\":\"$CPUMASK\"}}"
    qemu-storage-daemon \
        --blockdev "driver=file,node-name=file0,filename=$work/qsd.img,cache.direct=on,aio=io_uring" \
        --export "type=vhost-user-blk,id=exp0,node-name=file0,addr.type=unix,addr.path=$work/qsd.sock,writable=on,num-queues=$QUEUES" \
        >"$work/qsd.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do [ -S "$work/qsd.sock" ] && [ -S "$work/vhost.0" ] && break; sleep 0.1; done
    console=$work/console.log
    # Each server's CPU time over each case: the guest prints BEGIN and END around every
    # fio run; a watcher of the console samples /proc/PID/stat at each. It also samples
    # QEMU's write() calls (/proc/PID/io): under TCG each guest notification of a vring
    # (a kick) is a write to that vring's eventfd, so their count per I/O says how often
    # the guest had to kick each server.
    target_pid=${pids[0]}; qsd_pid=${pids[1]}
    ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
    # (0 when QEMU was not found: the kicks column then reads 0.)
    writes() { [ -n "$1" ] && awk '$1 == "syscw:" {print $2}' "/proc/$1/io" 2>/dev/null || echo 0; }
    mkfifo "$work/marks"
    # (Read straight from the FIFO: a filter such as tr would hold lines in its buffer.)
    while read -r tag who rw qd _; do
        pid=$target_pid; [ "$who" = qsd ] && pid=$qsd_pid; qd=${qd%$'\r'}
        case $tag in
            BEGIN)
                qemu=$(pgrep -f "^[^ ]*qemu-system[^ ]* .*$work/vhost.0" | head -1 || true)
                start=$(ticks "$pid"); start_writes=$(writes "$qemu") ;;
            END)
                echo "CPU $who $rw $qd $(($(ticks "$pid") - start))" >>"$work/cpu"
                echo "KICKS $who $rw $qd $(($(writes "$qemu") - start_writes))" >>"$work/cpu" ;;
        esac
    done <"$work/marks" &
    watcher=$!
    BASALT_GUEST_TIMEOUT=$((1200 * ${ROUNDS:-1})) "$REPO_ROOT/scripts/guest/run.sh" "$0" --guest "$RUNTIME" "${FIRST:-basalt}" "${ROUNDS:-1}" "$QUEUES" -- \
        -chardev "socket,id=vu0,path=$work/vhost.0" -device vhost-user-blk-pci,chardev=vu0,num-queues="$QUEUES" \
        -chardev "socket,id=vu1,path=$work/qsd.sock" -device vhost-user-blk-pci,chardev=vu1,num-queues="$QUEUES" \
        | tee "$console" "$work/marks" >&2
    wait "$watcher"
    {
        echo "# vhost-user-blk: Basalt vs qemu-storage-daemon ($(date -u +%Y-%m-%d), commit $(git -C "$REPO_ROOT" rev-parse --short HEAD), ${RUNTIME}s per run${CPUMASK:+, cpumask $CPUMASK}, $QUEUES queue(s) per disk, ${FIRST:-basalt} first, ${ROUNDS:-1} round(s), TCG guest, files on the host)"
        echo
        echo "| case | qemu-storage-daemon IOPS | qsd mean µs | Basalt IOPS | Basalt mean µs | Basalt / qsd |"
        echo "|---|---:|---:|---:|---:|---:|"
        awk -v peer=qsd -f "$SCRIPT_DIR/guest-results.awk" "$console"
        echo
        echo "Server CPU time, the guest's interrupts from the disk and QEMU's write() calls (kicks) per I/O (over the case, 2 s of ramp and the run, per I/O at the rate fio counted; all rounds):"
        echo
        echo "| case | qsd CPU µs/IO | Basalt CPU µs/IO | Basalt / qsd | guest interrupts/IO, qsd | guest interrupts/IO, Basalt | QEMU writes/IO, qsd | QEMU writes/IO, Basalt |"
        echo "|---|---:|---:|---:|---:|---:|---:|---:|"
        awk -v runtime="$RUNTIME" -v hz="$(getconf CLK_TCK)" '
            /^RESULT / { ios[$2, $3 " QD" $4] += $5 * (runtime + 2) }
            /^CPU / { key = $3 " QD" $4; if (!(key in seen)) { order[++n] = key; seen[key] = 1 }; cpu[$2, key] += $5 }
            /^IRQS / { irqs[$2, $3 " QD" $4] += $5 }
            /^KICKS / { kicks[$2, $3 " QD" $4] += $5 }
            END {
                for (i = 1; i <= n; i++) {
                    k = order[i]
                    for (w = 0; w < 2; w++) {
                        who = w ? "basalt" : "qsd"
                        us[who] = ios[who, k] > 0 ? cpu[who, k] / hz * 1e6 / ios[who, k] : 0
                        per[who] = ios[who, k] > 0 ? irqs[who, k] / ios[who, k] : 0
                        kick[who] = ios[who, k] > 0 ? kicks[who, k] / ios[who, k] : 0
                    }
                    printf "| 4k %s | %.1f | %.1f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", k, us["qsd"], us["basalt"], (us["qsd"] > 0 ? us["basalt"] / us["qsd"] : 0), per["qsd"], per["basalt"], kick["qsd"], kick["basalt"]
                }
            }' <(tr -d '\r' <"$console") "$work/cpu"
        echo
        in_place=$("$BASALT" rpc -s "$work/rpc.sock" vhost_get_controllers | grep -o '"in_place_requests": *[0-9]*' | grep -o '[0-9]*$' || true)
        echo "Basalt requests served in place (guest memory to the file, from the vring thread): ${in_place:-unknown}"
    } | if [ -n "$REPORT" ]; then tee "$REPORT"; else cat; fi
    exit 0
fi

# --- inside the guest -------------------------------------------------------------------
runtime=$2
first="basalt qsd"
[ "${3:-basalt}" = qsd ] && first="qsd basalt"
rounds=${4:-1}
queues=${5:-1}
# Interrupts the guest took from a disk's request queues (/proc/interrupts, all CPUs).
irqs() {
  local virtio
  virtio=$(basename "$(readlink -f "/sys/block/${1#/dev/}/device")")
  awk -v d="$virtio-req" '$NF ~ "^" d { for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+$/) s += $i; else break } END { print s + 0 }' /proc/interrupts
}
modprobe virtio_blk
for _ in $(seq 100); do [ -b /dev/vda ] && [ -b /dev/vdb ] && break; sleep 0.1; done
# Terse output (version 3): read IOPS in field 8, read mean latency (µs) in 40; write
# IOPS in 49, write mean latency in 81.
for rw in randread randwrite; do
  for qd in 1 32; do
    for round in $(seq "$rounds"); do
      order=$first
      [ $((round % 2)) = 0 ] && order=$(echo "$first" | awk '{print $2, $1}')
      for who in $order; do
        device=/dev/vda
        [ "$who" = qsd ] && device=/dev/vdb
        echo "BEGIN $who $rw $qd"
        irqs_before=$(irqs "$device")
        # Several queues: as many jobs, one per vCPU, sharing the depth.
        jobs=(--numjobs=1)
        [ "$queues" -gt 1 ] && [ "$qd" -ge "$queues" ] &&
          jobs=(--numjobs="$queues" --group_reporting --cpus_allowed=0-$((queues - 1)) --cpus_allowed_policy=split)
        line=$(timeout $((runtime * 3 + 60)) fio --name=bench --filename="$device" --direct=1 \
          --ioengine=libaio --iodepth=$((qd / ${jobs[0]#--numjobs=})) "${jobs[@]}" \
          --rw="$rw" --bs=4k --runtime="$runtime" --time_based --ramp_time=2 --minimal)
        if [ "$rw" = randread ]; then
          echo "$line" | awk -F';' -v who="$who" -v rw="$rw" -v qd="$qd" '{ printf "RESULT %s %s %s %s %s\n", who, rw, qd, $8, $40 }'
        else
          echo "$line" | awk -F';' -v who="$who" -v rw="$rw" -v qd="$qd" '{ printf "RESULT %s %s %s %s %s\n", who, rw, qd, $49, $81 }'
        fi
        echo "IRQS $who $rw $qd $(($(irqs "$device") - irqs_before))"
        echo "END $who $rw $qd"
      done
    done
  done
done
