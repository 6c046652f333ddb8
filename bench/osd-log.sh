#!/usr/bin/env bash
# Group commit of the OSD log device against the disk's own durable-write latency, in one run.
#
#   disk:  fio 4k randwrite, direct=1, fsync=1 (one write + fsync per I/O) at QD1 on a
#          preallocated, written file: the durable-write floor of this disk;
#   basalt: `basalt bench --osd-log FILE` at QD1 and QD32: each write is a durable append of
#          one 4 KiB entry; at QD32, appends queued behind a write share the next batch.
#
# Usage: bench/osd-log.sh [REPORT.md]
# Environment: BASE_DIR (default /var/tmp/basalt-osd-log; must be disk-backed), RUNTIME
# (seconds per case, default 5), BASALT (default target/release/basalt, built if absent).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_DIR=${BASE_DIR:-/var/tmp/basalt-osd-log}
RUNTIME=${RUNTIME:-5}
BASALT=${BASALT:-target/release/basalt}
REPORT=${1:-}
command -v fio >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio >/dev/null; }
[ -x "$BASALT" ] || cargo build --release -p basalt
mkdir -p "$BASE_DIR"
trap 'rm -f "$BASE_DIR/fio.dat" "$BASE_DIR/osd.log"' EXIT

# The disk: lay the file out first so writes overwrite allocated blocks.
fio --name=layout --filename="$BASE_DIR/fio.dat" --size=1G --rw=write --bs=1M --direct=1 \
    --ioengine=io_uring --output=/dev/null
fio --name=durable --filename="$BASE_DIR/fio.dat" --size=1G --rw=randwrite --bs=4k --iodepth=1 \
    --direct=1 --fsync=1 --ioengine=io_uring --time_based --runtime="$RUNTIME" \
    --output-format=json --output="$BASE_DIR/fio.json"
disk=$(python3 -c "import json;j=json.load(open('$BASE_DIR/fio.json'))['jobs'][0]['write'];print(f\"{j['iops']:.0f} {1e6/j['iops']:.1f}\")")

# The log device (4 GiB: at QD32 it appends about 250 MB/s).
truncate -s 4G "$BASE_DIR/osd.log"
run() { "$BASALT" bench --osd-log "$BASE_DIR/osd.log" --rw randwrite --iodepth "$1" --runtime "$RUNTIME" --json; }
qd1=$(run 1); qd32=$(run 32)
python3 - "$disk" "$qd1" "$qd32" "$(git rev-parse --short HEAD)" "$RUNTIME" <<'PY' | tee "${REPORT:-/dev/null}"
import json, sys
disk_iops, disk_us = map(float, sys.argv[1].split())
qd1, qd32 = json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(f"# OSD log device vs the disk's durable write (commit {sys.argv[4]}, {sys.argv[5]} s per case)\n")
print("| case | IOPS | mean µs | p99 µs | appends per batch | write amplification |")
print("|---|---:|---:|---:|---:|---:|")
print(f"| disk: fio 4k randwrite QD1, direct=1, fsync=1 | {disk_iops:.0f} | {disk_us:.1f} | | | |")
for name, r in (("basalt osd log QD1", qd1), ("basalt osd log QD32", qd32)):
    w, log = r["write"], r["log"]
    p99 = dict(w["latency"]["percentiles_us"])["p99"]
    print(f"| {name} | {w['iops']:.0f} | {w['latency']['mean_us']:.1f} | {p99:.1f} | {log['appends']/max(log['batches'],1):.1f} | {log['write_amplification']:.3f} |")
print(f"\nQD32/QD1 IOPS: {qd32['write']['iops']/qd1['write']['iops']:.1f}x; "
      f"QD1 append / disk durable write latency: {qd1['write']['latency']['mean_us']/disk_us:.2f}x")
PY
