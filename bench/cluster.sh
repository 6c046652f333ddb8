#!/usr/bin/env bash
# A 3-replica image against the disk's own durable-write latency, in one run.
#
#   disk:   fio 4k randwrite, direct=1, fsync=1 at QD1 on a preallocated, written file;
#   basalt: a monitor and three OSDs (release build, device files on the same disk), one
#           pool of PGs with 3 replicas and one image; `basalt bench --image` (the native
#           client) at 4k randwrite QD1 and QD32, then 4k randread QD1 and QD32 over what
#           was written. Write amplification: bytes the three OSDs wrote to their devices
#           per byte clients wrote (3.0 is one device write per replica).
#
# Usage: bench/cluster.sh [REPORT.md]
# Environment: BASE_DIR (default /var/tmp/basalt-bench-cluster; disk-backed), RUNTIME
# (seconds per case, default 10), PGS (default 32), BASALT (default target/release/basalt),
# DEVICE_SIZE (each OSD's device, default 6GiB; 512MiB makes the cleaner work during the
# QD32 writes, over the 256 MiB they cover), OSD_ARGS (more arguments of each `basalt osd`,
# e.g. "--poll-us 300"), KEEP=1 keeps the cluster's directory.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_DIR=${BASE_DIR:-/var/tmp/basalt-bench-cluster}
RUNTIME=${RUNTIME:-10}
DEVICE_SIZE=${DEVICE_SIZE:-6GiB}
PGS=${PGS:-32}
BASALT=${BASALT:-target/release/basalt}
REPORT=${1:-}
command -v fio >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio >/dev/null; }
[ -x "$BASALT" ] || cargo build --release -p basalt
. bench/cluster-lib.sh

fio --name=layout --filename="$BASE_DIR/fio.dat" --size=1G --rw=write --bs=1M --direct=1 \
    --ioengine=io_uring --output=/dev/null
fio --name=durable --filename="$BASE_DIR/fio.dat" --size=1G --rw=randwrite --bs=4k --iodepth=1 \
    --direct=1 --fsync=1 --ioengine=io_uring --time_based --runtime="$RUNTIME" \
    --output-format=json --output="$BASE_DIR/fio.json"
rm -f "$BASE_DIR/fio.dat"

start_cluster "$DEVICE_SIZE"
create_pool bench "$PGS"
"$BASALT" image create bench/img --size 1GiB --mon "$MON" >/dev/null

bench() { "$BASALT" bench --image bench/img --mon "$MON" --rw "$1" --iodepth "$2" --runtime "$RUNTIME" --size 256MiB --json; }
device0=$(metric_sum basalt_osd_log_device_bytes_total)
w1=$(bench randwrite 1); w32=$(bench randwrite 32)
device1=$(metric_sum basalt_osd_log_device_bytes_total)
relocated=$(metric_sum basalt_osd_relocated_bytes_total)
checkpoints=$(metric_sum basalt_osd_checkpoints_total)
r1=$(bench randread 1); r32=$(bench randread 32)
python3 - "$BASE_DIR/fio.json" "$w1" "$w32" "$r1" "$r32" "$device0" "$device1" "$(git rev-parse --short HEAD)" "$RUNTIME" "$PGS" "$DEVICE_SIZE" "$relocated" "$checkpoints" "${OSD_ARGS:-}" <<'PY' | tee "${REPORT:-/dev/null}"
import json, sys
disk = json.load(open(sys.argv[1]))["jobs"][0]["write"]
disk_iops = disk["iops"]
disk_us = 1e6 / disk_iops  # one write + fsync per I/O at QD1: the time per I/O
w1, w32, r1, r32 = (json.loads(a) for a in sys.argv[2:6])
device = float(sys.argv[7]) - float(sys.argv[6])
client = w1["write"]["bytes"] + w32["write"]["bytes"]
print(f"# A 3-replica image vs the disk's durable write (commit {sys.argv[8]}, {sys.argv[9]} s per case, {sys.argv[10]} PGs, {sys.argv[11]} OSD devices{', OSDs run with ' + sys.argv[14] if sys.argv[14] else ''})\n")
print("| case | IOPS | mean µs | p99 µs |")
print("|---|---:|---:|---:|")
print(f"| disk: fio 4k randwrite QD1, direct=1, fsync=1 | {disk_iops:.0f} | {disk_us:.1f} | |")
for name, r, side in (("basalt image 4k randwrite QD1", w1, "write"), ("basalt image 4k randwrite QD32", w32, "write"),
                      ("basalt image 4k randread QD1", r1, "read"), ("basalt image 4k randread QD32", r32, "read")):
    x = r[side]
    p99 = dict(x["latency"]["percentiles_us"])["p99"]
    print(f"| {name} | {x['iops']:.0f} | {x['latency']['mean_us']:.1f} | {p99:.1f} |")
qd1 = w1["write"]["latency"]["mean_us"]
print(f"\nQD1 write latency: {qd1:.0f} µs = {qd1/disk_us:.2f}x the disk's durable write ({disk_us:.0f} µs); aim ≤ 2x + 100 µs = {2*disk_us+100:.0f} µs")
print(f"QD32/QD1 write IOPS: {w32['write']['iops']/w1['write']['iops']:.1f}x (aim ≥ 5x)")
print(f"Write amplification: {device/client:.2f} device bytes per client byte over 3 replicas ({device/client/3:.2f} per replica)")
print(f"Log reuse: {float(sys.argv[12])/2**20:.0f} MiB relocated by the cleaners, {float(sys.argv[13]):.0f} checkpoints (three OSDs, whole run)")
print("\nSummary lines (block_bench format):")
for name, r in (("randwrite QD1", w1), ("randwrite QD32", w32), ("randread QD1", r1), ("randread QD32", r32)):
    side = 'write' if 'write' in name else 'read'
    print(f"- {name}: `{r[side]['block_bench']}`")
PY
