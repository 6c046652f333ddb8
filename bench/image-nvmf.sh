#!/usr/bin/env bash
# A 3-replica image over NVMe/TCP: a monitor and three OSDs on loopback, one pool of PGS
# PGs, a 1 GiB image, and `basalt target` exporting it as a namespace (image bdev,
# 4 KiB blocks); `basalt bench --nvmf` (our initiator) measures 4k random writes then
# reads at QD1 and QD32 over the 256 MiB it writes. The path `basalt dev` serves, with
# the target's polling as the variable: each round starts the target once per value of
# TARGET_POLLS (`basalt target --poll-us`), in reverse order in even rounds.
#
# Usage: bench/image-nvmf.sh [REPORT.md]
# Environment: TARGET_POLLS (default "0 500"), ROUNDS (default 2), RUNTIME (seconds per
# case, default 5), PGS (default 32), DEVICE_SIZE (default 2GiB), OSD_ARGS (more
# arguments of each `basalt osd`, e.g. --poll-us 500), BASE_DIR (default
# /var/tmp/basalt-bench-image-nvmf), BASALT (default target/release/basalt), KEEP=1 keeps
# the directory.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_DIR=${BASE_DIR:-/var/tmp/basalt-bench-image-nvmf}
TARGET_POLLS=${TARGET_POLLS:-0 500}
ROUNDS=${ROUNDS:-2}
RUNTIME=${RUNTIME:-5}
PGS=${PGS:-32}
DEVICE_SIZE=${DEVICE_SIZE:-2GiB}
BASALT=${BASALT:-target/release/basalt}
REPORT=${1:-}
NQN=nqn.2016-06.io.basalt:image
[ -x "$BASALT" ] || cargo build --release -p basalt
. bench/cluster-lib.sh
. bench/nvmf-lib.sh
start_cluster "$DEVICE_SIZE"
create_pool bench "$PGS"
"$BASALT" image create bench/img --size 1GiB --mon "$MON" >/dev/null

SOCK=$BASE_DIR/rpc.sock

# start_target POLL_US: sets TARGET_PID and URI.
start_target() {
    rm -f "$SOCK"
    "$BASALT" target -r "$SOCK" --poll-us "$1" >"$BASE_DIR/target.log" 2>&1 &
    TARGET_PID=$!; pids+=("$TARGET_PID")
    for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
    [ -S "$SOCK" ] || die "basalt target did not start: $(cat "$BASE_DIR/target.log")"
    "$BASALT" rpc -s "$SOCK" bdev_basalt_create "{\"name\":\"img\",\"pool\":\"bench\",\"image\":\"img\",\"mons\":[\"$MON\"],\"block_size\":4096}" >/dev/null
    nvmf_export "$SOCK" img "$NQN" || die "the image could not be exported"
}

# stop_target: stops it and forgets its pid (so that the cleanup kills no other process).
stop_target() {
    kill "$TARGET_PID"; wait "$TARGET_PID" 2>/dev/null || true
    local kept=() pid
    for pid in "${pids[@]}"; do [ "$pid" = "$TARGET_PID" ] || kept+=("$pid"); done
    pids=("${kept[@]}")
}

# measure RW QD: prints "IOPS MEAN_US P99_US".
measure() {
    "$BASALT" bench --nvmf "$URI" --rw "$1" --iodepth "$2" --bs 4KiB --runtime "$RUNTIME" \
        --size 256MiB --json | python3 -c '
import json, sys
r = json.load(sys.stdin); d = r["read"] or r["write"]; l = d["latency"]
print("%.0f %.1f %.1f" % (d["iops"], l["mean_us"], dict(l["percentiles_us"]).get("p99", float("nan"))))'
}

rows=()
for round in $(seq "$ROUNDS"); do
    polls=$TARGET_POLLS
    [ $((round % 2)) = 0 ] && polls=$(echo "$TARGET_POLLS" | awk '{for (i = NF; i > 0; i--) printf "%s ", $i}')
    for poll in $polls; do
        start_target "$poll"
        for rw in randwrite randread; do
            for qd in 1 32; do
                out=$(measure "$rw" "$qd") || die "the bench failed ($rw QD$qd, --poll-us $poll); see $BASE_DIR/target.log (KEEP=1 keeps it)"
                read -r iops mean p99 <<<"$out"
                rows+=("| $round | $poll | 4k $rw QD$qd | $iops | $mean | $p99 |")
            done
        done
        stop_target
    done
done

{
    echo "# A 3-replica image over NVMe/TCP ($(date -u +%Y-%m-%d), commit $(git describe --always --dirty), ${RUNTIME}s per case, $PGS PGs, $DEVICE_SIZE OSD devices${OSD_ARGS:+, OSDs run with $OSD_ARGS})"
    echo
    echo "| round | target --poll-us | case | IOPS | mean µs | p99 µs |"
    echo "|---:|---:|---|---:|---:|---:|"
    printf '%s\n' "${rows[@]}"
} | if [ -n "$REPORT" ]; then tee "$REPORT"; else cat; fi
