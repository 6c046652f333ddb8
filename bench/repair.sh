#!/usr/bin/env bash
# How fast `basalt pg repair` rebuilds replicas, and what it costs the clients meanwhile.
#
#   A monitor and three OSDs (release build, device files on the same disk), a pool of PGs
#   with 3 replicas and an image of IMAGE_MIB MiB written whole (1 MiB writes). Then:
#   1. idle: `basalt pg repair` of every PG with `--osd` the first OSD; the time it takes
#      and the object data that OSD received (its snapshot bytes metric), in MiB/s;
#   2. 4k random writes at QD1 (`basalt bench --image`) for RUNTIME seconds alone, then
#      again while the second OSD's replica of every PG is rebuilt (the repair starts with
#      the writes and goes on until done or the writes end); the mean and p99 latency of
#      each, and how long the repair under load took.
#
# Usage: bench/repair.sh [REPORT.md]
# Environment: BASE_DIR (default /var/tmp/basalt-bench-repair; disk-backed), RUNTIME
# (seconds of each write run, default 20), PGS (default 32), IMAGE_MIB (default 1024),
# DEVICE_SIZE (default 4GiB), BASALT (default target/release/basalt), KEEP=1 keeps the
# cluster's directory.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_DIR=${BASE_DIR:-/var/tmp/basalt-bench-repair}
RUNTIME=${RUNTIME:-20}
PGS=${PGS:-32}
IMAGE_MIB=${IMAGE_MIB:-1024}
DEVICE_SIZE=${DEVICE_SIZE:-4GiB}
BASALT=${BASALT:-target/release/basalt}
REPORT=${1:-}
[ -x "$BASALT" ] || cargo build --release -p basalt
. bench/cluster-lib.sh

start_cluster "$DEVICE_SIZE"
create_pool bench "$PGS"
"$BASALT" image create bench/img --size "${IMAGE_MIB}MiB" --mon "$MON" >/dev/null
"$BASALT" bench --image bench/img --mon "$MON" --rw write --bs 1MiB --iodepth 8 \
    --io-count "$IMAGE_MIB" --json >"$BASE_DIR/fill.json"

# The id OSD process N booted as (ids are given in boot order, not start order).
osd_id() { grep -o 'basalt osd: osd\.[0-9]*' "$BASE_DIR/osd.$1.log" | head -1 | sed 's/.*osd\.//'; }
pgs=$("$BASALT" pg ls --json --mon "$MON" | python3 -c "import json,sys; print(' '.join(p['pg'] for p in json.load(sys.stdin)))")
received() { curl -s "127.0.0.1:${metric_ports[$1]}/metrics" | awk '$1 == "basalt_osd_snapshot_received_bytes_total" {print $2}'; }
metric_sum basalt_osd_snapshot_received_bytes_total >/dev/null # installs curl if missing
repair() { # OSD_INDEX: repairs every PG's replica on that OSD; prints the seconds taken
    local start end
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    "$BASALT" pg repair $pgs --osd "$(osd_id "$1")" --json --mon "$MON" >"$BASE_DIR/repair.$1.json" \
        || die "pg repair failed: $(cat "$BASE_DIR/repair.$1.json")"
    end=$(date +%s.%N)
    python3 -c "print($end - $start)"
}

# 1. Idle.
before=$(received 0)
idle_seconds=$(repair 0)
after=$(received 0)
idle_mib=$(python3 -c "print(($after - $before) / 2**20)")

# 2. Client writes alone, then with a repair under way.
bench() { "$BASALT" bench --image bench/img --mon "$MON" --rw randwrite --iodepth 1 --runtime "$RUNTIME" --json; }
bench >"$BASE_DIR/alone.json"
(repair 1 >"$BASE_DIR/loaded.seconds") &
repair_pid=$!
bench >"$BASE_DIR/loaded.json"
wait "$repair_pid" || die "the repair under load failed"
loaded_seconds=$(cat "$BASE_DIR/loaded.seconds")

python3 - "$BASE_DIR" "$idle_seconds" "$idle_mib" "$loaded_seconds" "$PGS" "$IMAGE_MIB" "$RUNTIME" "$(git rev-parse --short HEAD)" <<'PY' | tee "${REPORT:-/dev/null}"
import json, sys
base, idle_s, idle_mib, loaded_s, pgs, image_mib, runtime, commit = sys.argv[1:]
idle_s, idle_mib, loaded_s = float(idle_s), float(idle_mib), float(loaded_s)
alone, loaded = (json.load(open(f"{base}/{name}.json"))["write"] for name in ("alone", "loaded"))
def cell(r):
    p99 = dict(r["latency"]["percentiles_us"])["p99"]
    return f"{r['iops']:,.0f} IOPS, mean {r['latency']['mean_us']:.0f} µs, p99 {p99:.0f} µs"
print(f"# `basalt pg repair` (commit {commit}, {pgs} PGs, a {image_mib} MiB image written whole, {runtime} s write runs)\n")
print("| case | figure |")
print("|---|---|")
print(f"| idle: one OSD's replica of every PG rebuilt | {idle_s:.1f} s, {idle_mib:.0f} MiB received, {idle_mib / idle_s:.0f} MiB/s |")
print(f"| 4k randwrite QD1 alone | {cell(alone)} |")
print(f"| 4k randwrite QD1 while another OSD's replicas are rebuilt | {cell(loaded)} |")
print(f"| ... that repair took | {loaded_s:.1f} s |")
print(f"\nQD1 write mean while repairing / alone: {loaded['latency']['mean_us'] / alone['latency']['mean_us']:.2f}x")
PY
