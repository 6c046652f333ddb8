#!/usr/bin/env bash
# Writes as an OSD's log fills: for each fill level, a fresh monitor and three OSDs (release
# build, device files of DEVICE_SIZE), a 3-replica image sized to that fraction of what an
# OSD holds before it reports itself full (`basalt_osd_writable_bytes`), written once
# sequentially (FILL_BS at a time), then overwritten at random with `basalt bench --image`
# (BS at a time, QD16) for RUNTIME seconds. Reports per level the random writes' IOPS and latency,
# the bytes the cleaner moved per byte the clients wrote meanwhile, the bytes the OSDs wrote
# to their devices (log and checkpoints) and those of checkpoints alone per byte the clients
# wrote, and what `basalt status` said at the end (and whether an OSD stopped its
# checkpoints, one having outgrown its area).
#
# Usage: bench/near-full.sh [REPORT.md]
# Environment: BASE_DIR (default /var/tmp/basalt-bench-near-full), RUNTIME (default 20),
# DEVICE_SIZE (default 512MiB), LEVELS (default "0.5 0.8 0.9 0.97"), or SIZES (image sizes in
# MiB instead, for builds without that metric or to compare builds), PGS (default 16),
# BASALT (default target/release/basalt), OSD_ARGS, FILL_BS (default 1MiB; 4KiB makes an
# index entry per block, as data written 4 KiB at a time has), BS (default 4KiB; 512 writes
# sectors apart, eight index entries to a block once the cleaner packed them).
set -euo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-}
BASE_DIR=${BASE_DIR:-/var/tmp/basalt-bench-near-full}
RUNTIME=${RUNTIME:-20}
DEVICE_SIZE=${DEVICE_SIZE:-512MiB}
LEVELS=${LEVELS:-0.5 0.8 0.9 0.97}
PGS=${PGS:-16}
FILL_BS=${FILL_BS:-1MiB}
BS=${BS:-4KiB}
BASALT=${BASALT:-target/release/basalt}
[ -n "${BASALT_BUILT:-}" ] || [ "$BASALT" != target/release/basalt ] || cargo build --release -q --locked -p basalt
. bench/cluster-lib.sh

# What an OSD holds before it reports itself full.
writable() { curl -s "127.0.0.1:${metric_ports[0]}/metrics" | awk '$1 == "basalt_osd_writable_bytes" {print $2}'; }

# Summed over the OSDs: bytes the cleaner moved, of log written, of checkpoints written
# ("nan" for builds without that count).
counts() {
    echo "$(metric_sum basalt_osd_relocated_bytes_total) $(metric_sum basalt_osd_log_device_bytes_total) $(metric_sum basalt_osd_checkpoint_bytes_total)"
}

rows=()
for level in ${SIZES:-$LEVELS}; do
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$BASE_DIR"; mkdir -p "$BASE_DIR"; pids=()
    start_cluster "$DEVICE_SIZE"
    create_pool nf "$PGS"
    if [ -n "${SIZES:-}" ]; then
        mib=$level
        level=$(python3 -c "w = '$(writable)'; print(f'{$mib / (float(w) / 2**20):.2f}' if w else 'n/a')")
    else
        mib=$(python3 -c "print(int($(writable) * $level) >> 20)")
    fi
    "$BASALT" image create nf/img --size "${mib}MiB" --mon "$MON" >/dev/null
    "$BASALT" bench --image nf/img --mon "$MON" --rw write --bs "$FILL_BS" --iodepth 16 \
        --size "${mib}MiB" --io-count "$(python3 -c "print(($mib << 20) // $(numfmt --from=iec-i "${FILL_BS%B}"))")" \
        --json >"$BASE_DIR/fill.json"
    before=$(counts)
    set +e
    "$BASALT" bench --image nf/img --mon "$MON" --rw randwrite --bs "$BS" --iodepth 16 \
        --runtime "$RUNTIME" --json >"$BASE_DIR/rand.json" 2>"$BASE_DIR/rand.err"
    rc=$?
    set -e
    after=$(counts)
    health=$("$BASALT" status --mon "$MON" | awk '/health:/ {print $2}')
    if grep -q "checkpoints stop" "$BASE_DIR"/osd.*.log; then health+=", checkpoints stopped"; fi
    rows+=("$(python3 - "$level" "$mib" "$BASE_DIR/rand.json" "$rc" "$before" "$after" "$health" "$BASE_DIR/rand.err" <<'PY'
import json, sys
level, mib, path, rc, before, after, health, err = sys.argv[1:]
moved, log, checkpoints = (float(a) - float(b) for a, b in zip(after.split(), before.split()))
device = log + checkpoints
if rc != "0":
    first = open(err).read().strip().splitlines()
    print(f"| {level} | {mib} | failed: {first[-1] if first else 'rc ' + rc} | | | | | | | {health} |")
    sys.exit()
w = json.load(open(path))["write"]
p = dict(w["latency"]["percentiles_us"])
print(f"| {level} | {mib} | {w['iops']:,.0f} | {w['latency']['mean_us']:,.0f} | {p.get('p99', float('nan')):,.0f} "
      f"| {w['latency']['max_us'] / 1000:,.0f} | {moved / 3 / w['bytes']:.2f} "
      f"| {device / 3 / w['bytes']:.2f} | {checkpoints / 3 / w['bytes']:.2f} | {health} |")
PY
)")
done

{
    echo "# Writes as the log fills ($(git rev-parse --short HEAD), $(date -u +%F))"
    echo
    echo "Device $DEVICE_SIZE per OSD, $PGS PGs of 3 replicas, $BS random writes at QD16 for ${RUNTIME} s over an image written once ${FILL_BS} at a time; OSD_ARGS='${OSD_ARGS:-}'."
    echo
    echo "| image / writable | image MiB | IOPS | mean µs | p99 µs | max ms | moved per byte written, per replica | device bytes per byte written, per replica | of which checkpoints | health after |"
    echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    printf '%s\n' "${rows[@]}"
} | tee "${REPORT:-/dev/null}"
