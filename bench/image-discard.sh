#!/usr/bin/env bash
# How fast a host's discard of an image runs: a monitor and three OSDs (release builds),
# a pool of PGS PGs with 3 replicas, a target exporting two never-written images over NBD,
# one of 64 KiB objects and one of 4 MiB objects; qemu-io discards COUNT (LARGE_COUNT for
# the image of 4 MiB objects) ranges of 2 GiB
# (the most qemu's NBD client sends in one request) of each, one request at a time, timed
# by qemu-io itself (the sum of its per-request times, without its start and handshake).
# A discard is a replicated write per object, written or not, so this is the rate the
# `unmap_blocks_max` of image bdevs is set from. Each round runs every build of BUILDS in
# turn on a fresh cluster, so that builds can be compared within one run.
#
# Usage: bench/image-discard.sh [REPORT.md]
# Environment: BUILDS (binaries, default target/release/basalt), BASE_DIR (default
# /var/tmp/basalt-bench-image-discard), PGS (default 32), COUNT (default 4), LARGE_COUNT
# (default 64), ROUNDS (default 2), KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-}
BUILDS=${BUILDS:-target/release/basalt}
BASE_DIR=${BASE_DIR:-/var/tmp/basalt-bench-image-discard}
PGS=${PGS:-32}
COUNT=${COUNT:-4}
LARGE_COUNT=${LARGE_COUNT:-64}
ROUNDS=${ROUNDS:-2}
command -v qemu-io >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-utils >/dev/null; }
[ "$BUILDS" != target/release/basalt ] || cargo build --release -q --locked -p basalt
BASALT=${BUILDS%% *}
. bench/cluster-lib.sh

CHUNK=2147483136 # 2 GiB less 512 bytes: qemu's NBD client refuses more
rows=()
for round in $(seq "$ROUNDS"); do
    for BASALT in $BUILDS; do
        fresh_cluster 1GiB
        create_pool d "$PGS"
        "$BASALT" image create d/small --size 64GiB --object-size 64KiB --mon "$MON" >/dev/null
        "$BASALT" image create d/large --size 2TiB --object-size 4MiB --mon "$MON" >/dev/null
        "$BASALT" target -r "$BASE_DIR/rpc.sock" >"$BASE_DIR/target.log" 2>&1 & pids+=($!)
        for _ in $(seq 100); do [ -S "$BASE_DIR/rpc.sock" ] && break; sleep 0.1; done
        rpc() { "$BASALT" rpc -s "$BASE_DIR/rpc.sock" "$@" >/dev/null; }
        port=$(free_port)
        rpc nbd_server_start "{\"listen_address\":\"127.0.0.1\",\"port\":$port}"
        for image in small large; do
            rpc bdev_basalt_create "{\"name\":\"$image\",\"pool\":\"d\",\"image\":\"$image\",\"mons\":[\"$MON\"]}"
            rpc nbd_server_add_export "{\"bdev_name\":\"$image\",\"name\":\"$image\"}"
        done
        for image in small large; do
            object=$((64 << 10)) count=$COUNT
            [ "$image" = large ] && object=$((4 << 20)) count=$LARGE_COUNT
            commands=()
            for n in $(seq 0 $((count - 1))); do commands+=(-c "discard $((n * CHUNK)) $CHUNK"); done
            out=$(qemu-io -f raw "nbd://127.0.0.1:$port/$image" "${commands[@]}" 2>&1)
            rows+=("$(python3 -c "
import re, sys
out = sys.argv[3]
# qemu-io prints each request's time as 'N ops; SS.ss sec' or 'H:MM:SS.ss'.
times = re.findall(r'ops; ([0-9:.]+) sec', out)
if 'failed' in out or len(times) != int(sys.argv[4]):
    sys.exit('qemu-io: ' + out)
seconds = sum(sum(float(p) * 60 ** i for i, p in enumerate(reversed(t.split(':')))) for t in times)
objects = int(sys.argv[4]) * int(sys.argv[5]) / int(sys.argv[6])
print(f'| {sys.argv[1]} | {sys.argv[2]} | {int(sys.argv[6]) >> 10} KiB | {objects:,.0f} | {seconds:.2f} | {objects / seconds:,.0f} |')
" "$round" "$BASALT" "$out" "$count" "$CHUNK" "$object")")
        done
    done
done

{
    echo "# Discarding never-written images over NBD ($(git rev-parse --short HEAD), $(date -u +%F))"
    echo
    echo "$PGS PGs of 3 replicas; qemu-io discards ranges of 2 GiB of each image ($COUNT of the 64 KiB-object image, $LARGE_COUNT of the 4 MiB-object one), one request at a time; seconds are qemu-io's own, summed."
    echo
    echo "| round | build | object size | objects | seconds | objects per second |"
    echo "|---:|---|---:|---:|---:|---:|"
    printf '%s\n' "${rows[@]}"
} | tee "${REPORT:-/dev/null}"
