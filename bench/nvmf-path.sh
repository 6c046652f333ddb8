#!/usr/bin/env bash
# The cost of the NVMe/TCP path on this host: `basalt bench --nvmf` (our initiator, one
# TCP connection per worker, to `basalt target` exporting a malloc bdev on 127.0.0.1)
# against `basalt bench --bdev malloc:...` (the same bdev kind in the bench's own process,
# no network). Issue #4 aims at the NVMe/TCP path within 20% of in-process at QD32.
#
# Cases: 4k randwrite then randread at QD1 and QD32, one worker; for each case the
# in-process run comes first and the NVMe/TCP run right after, so noise lands on both.
# The target's malloc bdev is written once (sequential 128 KiB) before the reads, and the
# in-process one before each read run (--prefill). Each run also reports CPU time per
# request, which this shared machine's noise moves less than IOPS: the bench process's own
# (user + system over the whole process, a prefill included) and, over NVMe/TCP, the
# target's during the run (/proc/PID/stat).
#
# Usage: bench/nvmf-path.sh [REPORT.md]
#
# Environment: SIZE (bytes of the bdev, default 1GiB), RUNTIME (seconds per run,
# default 10), BASALT (default target/release/basalt, built if absent), REACTORS
# (`basalt target -m`, default the target's own).
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$SCRIPT_DIR/.." && pwd)
SIZE=${SIZE:-1GiB}
RUNTIME=${RUNTIME:-10}
REPORT=${1:-}
NQN=nqn.2016-06.io.basalt:bench

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

BASALT=${BASALT:-$REPO_ROOT/target/release/basalt}
if [ ! -x "$BASALT" ]; then
    log "building $BASALT"
    (cd "$REPO_ROOT" && cargo build --release -p basalt) >&2
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/basalt-nvmf-path.XXXXXX")
TARGET_PID=""
cleanup() {
    [ -n "$TARGET_PID" ] && kill "$TARGET_PID" 2>/dev/null && wait "$TARGET_PID" 2>/dev/null
    rm -rf "$TMP"
}
trap cleanup EXIT

SOCK=$TMP/rpc.sock
args=(target -r "$SOCK")
[ -z "${REACTORS:-}" ] || args+=(-m "$REACTORS")
"$BASALT" "${args[@]}" >"$TMP/target.log" 2>&1 &
TARGET_PID=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
[ -S "$SOCK" ] || die "basalt target did not start: $(cat "$TMP/target.log")"
rpc() { "$BASALT" rpc -s "$SOCK" "$@" >/dev/null; }

size_bytes=$(python3 -c "
import re,sys
s='$SIZE'; m=re.fullmatch(r'(\d+)([KMGT]i?B?)?', s)
n=int(m.group(1)); u=(m.group(2) or '').rstrip('B').rstrip('i')
print(n * {'':1,'K':1<<10,'M':1<<20,'G':1<<30,'T':1<<40}[u])")
rpc bdev_malloc_create "{\"name\":\"m0\",\"num_blocks\":$((size_bytes / 4096)),\"block_size\":4096}"
. "$SCRIPT_DIR/nvmf-lib.sh"
nvmf_export "$SOCK" m0 "$NQN" || die "the malloc bdev could not be exported"
log "target pid $TARGET_PID, $URI"
"$BASALT" bench --nvmf "$URI" --rw write --bs 128KiB --iodepth 8 --io-count $((size_bytes >> 17)) >/dev/null

# The target's CPU time so far, in clock ticks (user + system).
target_ticks() { awk '{print $14 + $15}' "/proc/$TARGET_PID/stat"; }

# One run; prints "IOPS MEAN_US P99_US BENCH_CPU_US_PER_IO TARGET_CPU_US_PER_IO" (the
# bench's own CPU time, and the target's over the run, per request).
measure() {
    local before after TIMEFORMAT='%U %S'
    before=$(target_ticks)
    { time "$BASALT" bench "$@" --bs 4KiB --runtime "$RUNTIME" --json >"$TMP/last.json" 2>/dev/null; } 2>"$TMP/time"
    after=$(target_ticks)
    python3 - "$TMP/last.json" "$(cat "$TMP/time")" "$((after - before))" "$(getconf CLK_TCK)" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
d = r["read"] or r["write"]
l = d["latency"]
p99 = dict(l["percentiles_us"]).get("p99", float("nan"))
bench_s = sum(float(x) for x in sys.argv[2].split())
target_s = int(sys.argv[3]) / int(sys.argv[4])
ios = max(d["ios"], 1)
print("%.0f %.1f %.1f %.2f %.2f" % (d["iops"], l["mean_us"], p99, bench_s * 1e6 / ios, target_s * 1e6 / ios))
PY
}

rows=()
for rw in randwrite randread; do
    for qd in 1 32; do
        # The in-process bench makes a fresh malloc bdev each run: for reads it is written
        # first (--prefill), as the target's was, so that both read written blocks.
        prefill=()
        [ "$rw" = randread ] && prefill=(--prefill)
        read -r iops_local mean_local p99_local cpu_local _ < <(measure --bdev "malloc:$SIZE" --rw "$rw" --iodepth "$qd" "${prefill[@]}")
        read -r iops_nvmf mean_nvmf p99_nvmf cpu_host cpu_target < <(measure --nvmf "$URI" --rw "$rw" --iodepth "$qd")
        ratio=$(python3 -c "print('%.2f' % ($iops_nvmf / $iops_local))")
        log "$rw QD$qd: in-process $iops_local IOPS, NVMe/TCP $iops_nvmf IOPS ($ratio)"
        rows+=("| 4k $rw QD$qd | $iops_local | $mean_local | $cpu_local | $iops_nvmf | $mean_nvmf | $p99_nvmf | $cpu_host | $cpu_target | $ratio |")
    done
done

{
    echo "# NVMe/TCP path vs in-process ($(date -u +%Y-%m-%d), commit $(git -C "$REPO_ROOT" rev-parse --short HEAD), ${RUNTIME}s per run)"
    echo
    echo "| case | in-process IOPS | in-process mean µs | in-process CPU µs/IO | NVMe/TCP IOPS | NVMe/TCP mean µs | NVMe/TCP p99 µs | initiator CPU µs/IO | target CPU µs/IO | NVMe/TCP / in-process |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    printf '%s\n' "${rows[@]}"
} | if [ -n "$REPORT" ]; then tee "$REPORT"; else cat; fi
