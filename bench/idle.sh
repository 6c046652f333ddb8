#!/usr/bin/env bash
# What an idle cluster costs: a monitor and three OSDs with one pool of PGS PGs (3 replicas),
# no client. After the PGs are active+clean and a settling pause, over WINDOW seconds:
# the CPU time of the three OSD processes (from /proc/PID/stat), the bytes that crossed the
# loopback interface (/proc/net/dev; TCP headers and acknowledgements included, monitor
# traffic too), and, from the OSDs' metrics when the build has them, the frames and bytes of
# raft traffic between OSDs, heartbeats sent coalesced and raft messages sent whole.
#
# Usage: bench/idle.sh [REPORT.md]
# Environment: BASE_DIR (default /var/tmp/basalt-bench-idle), PGS (default 256), WINDOW
# (seconds, default 20), BASALT (default target/release/basalt), OSD_ARGS (more arguments
# of each `basalt osd`), LABEL (names the build in the report), KEEP=1 keeps the directory.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_DIR=${BASE_DIR:-/var/tmp/basalt-bench-idle}
PGS=${PGS:-256}
WINDOW=${WINDOW:-20}
BASALT=${BASALT:-target/release/basalt}
LABEL=${LABEL:-$(git rev-parse --short HEAD)}
REPORT=${1:-}
[ -x "$BASALT" ] || cargo build --release -p basalt
. bench/cluster-lib.sh
start_cluster 256MiB
create_pool idle "$PGS"
sleep 5

ticks() {  # user + system clock ticks of the OSDs
    local total=0
    for pid in "${osd_pids[@]}"; do
        total=$((total + $(awk '{print $14 + $15}' "/proc/$pid/stat")))
    done
    echo "$total"
}
lo_bytes() { awk '$1 == "lo:" {print $2}' /proc/net/dev; }
counters() { for m in peer_frames_sent_total peer_sent_bytes_total heartbeats_sent_total raft_messages_sent_total; do metric_sum "basalt_osd_$m"; done; }

t0=$(ticks); l0=$(lo_bytes); c0=($(counters))
sleep "$WINDOW"
t1=$(ticks); l1=$(lo_bytes); c1=($(counters))
hz=$(getconf CLK_TCK)
line=$(python3 - "$WINDOW" "$hz" "$t0" "$t1" "$l0" "$l1" "${c0[@]}" "${c1[@]}" <<'PY'
import sys
w, hz, t0, t1, l0, l1 = (float(x) for x in sys.argv[1:7])
c0 = [float(x) for x in sys.argv[7:11]]; c1 = [float(x) for x in sys.argv[11:15]]
rate = [(b - a) / w for a, b in zip(c0, c1)]
cpu = (t1 - t0) / hz / w * 100
print(f"| {cpu:.1f}% | {(l1 - l0) / w / 1024:.1f} | {rate[0]:.0f} | {rate[1] / 1024:.1f} | {rate[2]:.0f} | {rate[3]:.0f} |")
PY
)
header="| build | PGs | OSD CPU (3 OSDs, % of a CPU) | loopback KiB/s | raft frames/s | raft frame KiB/s | heartbeats coalesced/s | raft messages whole/s |"
row="| $LABEL ${OSD_ARGS:-} | $PGS $line"
echo "$header"; echo "|---|---:|---:|---:|---:|---:|---:|---:|"; echo "$row"
if [ -n "$REPORT" ]; then
    [ -f "$REPORT" ] || { echo "# Idle cluster, $(date -u +%F)"; echo; echo "Command: \`bench/idle.sh\` (PGS=$PGS WINDOW=$WINDOW)"; echo; echo "$header"; echo "|---|---:|---:|---:|---:|---:|---:|---:|"; } >> "$REPORT"
    echo "$row" >> "$REPORT"
fi
