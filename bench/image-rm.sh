#!/usr/bin/env bash
# How long `basalt image rm` takes on a large thin image: a monitor and three OSDs (release
# builds, device files of DEVICE_SIZE), a pool of PGS PGs with 3 replicas, an image of
# SIZE with WRITES random 4 KiB writes in it (`basalt bench`), then `basalt image rm`,
# timed. Each round runs every build of BUILDS in turn on a fresh cluster, so that builds
# can be compared within one run. Reports, per build and round: the removal's seconds and
# the bytes the OSDs wrote to their devices meanwhile.
#
# Usage: bench/image-rm.sh [REPORT.md]
# Environment: BUILDS (binaries, default target/release/basalt), BASE_DIR (default
# /var/tmp/basalt-bench-image-rm), DEVICE_SIZE (default 1GiB), PGS (default 32), SIZE
# (default 100GiB), WRITES (default 20000), ROUNDS (default 2), KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-}
BUILDS=${BUILDS:-target/release/basalt}
BASE_DIR=${BASE_DIR:-/var/tmp/basalt-bench-image-rm}
DEVICE_SIZE=${DEVICE_SIZE:-1GiB}
PGS=${PGS:-32}
SIZE=${SIZE:-100GiB}
WRITES=${WRITES:-20000}
ROUNDS=${ROUNDS:-2}
[ "$BUILDS" != target/release/basalt ] || cargo build --release -q --locked -p basalt
BASALT=${BUILDS%% *}
. bench/cluster-lib.sh

rows=()
for round in $(seq "$ROUNDS"); do
    for BASALT in $BUILDS; do
        fresh_cluster "$DEVICE_SIZE"
        create_pool rm "$PGS"
        "$BASALT" image create rm/img --size "$SIZE" --mon "$MON" >/dev/null
        "$BASALT" bench --image rm/img --mon "$MON" --rw randwrite --bs 4KiB --iodepth 32 \
            --size "$SIZE" --io-count "$WRITES" >"$BASE_DIR/fill.out"
        bytes_before=$(metric_sum basalt_osd_log_device_bytes_total)
        started=$(date +%s.%N)
        "$BASALT" image rm rm/img --mon "$MON" >"$BASE_DIR/rm.out"
        ended=$(date +%s.%N)
        bytes_after=$(metric_sum basalt_osd_log_device_bytes_total)
        rows+=("$(python3 -c "
import sys
print(f'| {sys.argv[1]} | {sys.argv[2]} | {float(sys.argv[4]) - float(sys.argv[3]):.2f} | {(float(sys.argv[6]) - float(sys.argv[5])) / 2**20:,.1f} |')
" "$round" "$BASALT" "$started" "$ended" "$bytes_before" "$bytes_after")")
    done
done

{
    echo "# Removing a large thin image ($(git rev-parse --short HEAD), $(date -u +%F))"
    echo
    echo "Device $DEVICE_SIZE per OSD, $PGS PGs of 3 replicas, an image of $SIZE with $WRITES random 4 KiB writes."
    echo
    echo "| round | build | image rm, s | device MiB written by the OSDs meanwhile |"
    echo "|---:|---|---:|---:|"
    printf '%s\n' "${rows[@]}"
} | tee "${REPORT:-/dev/null}"
