#!/usr/bin/env bash
# A fast writer fills the cluster: how the full flag stops it. A monitor and three OSDs
# (release build, device files of DEVICE_SIZE), a 3-replica image twice what an OSD holds
# before it reports itself full (`basalt_osd_writable_bytes`), written sequentially with
# `basalt bench --image` (BS at a time, QD16) until a write is refused. Every OSD holds
# every PG, so all three fill together, and each leader must stop before its followers'
# reserves run out. Reports, per round: how far the writer got and at what speed, the least
# free log space any OSD was left with (sampled every 50 ms), whether an OSD's appends had to wait for room in its log (a
# replica past its reserve, which cannot persist until space frees), whether the PGs were
# all active+clean 30 s later, and whether a write goes once the image is removed.
#
# Usage: bench/fast-fill.sh [REPORT.md]
# Environment: BASE_DIR (default /var/tmp/basalt-bench-fast-fill), DEVICE_SIZE (default
# 256MiB), BS (default 1MiB), PGS (default 8), ROUNDS (default 2), BASALT (default
# target/release/basalt), OSD_ARGS, KEEP=1.
set -euo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-}
BASE_DIR=${BASE_DIR:-/var/tmp/basalt-bench-fast-fill}
DEVICE_SIZE=${DEVICE_SIZE:-256MiB}
BS=${BS:-1MiB}
PGS=${PGS:-8}
ROUNDS=${ROUNDS:-2}
BASALT=${BASALT:-target/release/basalt}
[ "$BASALT" != target/release/basalt ] || cargo build --release -q --locked -p basalt
. bench/cluster-lib.sh

metric() { curl -s "127.0.0.1:${metric_ports[$1]}/metrics" | awk -v m="$2" '$1 == m {print $2}'; }

# Samples every OSD's free log space every 50 ms into $BASE_DIR/free.txt until killed.
sample_free() {
    while :; do
        for n in 0 1 2; do echo "$n $(metric "$n" basalt_osd_log_free_bytes)"; done
        sleep 0.05
    done >"$BASE_DIR/free.txt"
}

rows=()
for round in $(seq "$ROUNDS"); do
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$BASE_DIR"; mkdir -p "$BASE_DIR"; pids=()
    start_cluster "$DEVICE_SIZE"
    create_pool ff "$PGS"
    writable=$(metric 0 basalt_osd_writable_bytes)
    mib=$(python3 -c "print(2 * int($writable) >> 20)")
    "$BASALT" image create ff/img --size "${mib}MiB" --mon "$MON" >/dev/null
    sample_free & sampler=$!
    started=$(date +%s.%N)
    set +e
    "$BASALT" bench --image ff/img --mon "$MON" --rw write --bs "$BS" --iodepth 16 \
        --size "${mib}MiB" --io-count "$(python3 -c "print(($mib << 20) // $(numfmt --from=iec-i "${BS%B}"))")" \
        >"$BASE_DIR/fill.out" 2>"$BASE_DIR/fill.err"
    rc=$?
    set -e
    ended=$(date +%s.%N)
    sleep 1
    kill "$sampler"; wait "$sampler" 2>/dev/null || true
    written=$(metric_sum basalt_osd_write_bytes_total)
    clean=no
    for _ in $(seq 150); do
        if "$BASALT" status --mon "$MON" | grep -q "$PGS active+clean"; then clean=yes; break; fi
        sleep 0.2
    done
    waited=$(cat "$BASE_DIR"/osd.*.log | grep -c "appends wait for room in the log" || true)
    "$BASALT" image rm ff/img --mon "$MON" >/dev/null
    "$BASALT" image create ff/again --size 64MiB --mon "$MON" >/dev/null
    again=no
    for _ in $(seq 60); do
        if "$BASALT" bench --image ff/again --mon "$MON" --rw write --bs 1MiB --io-count 4 \
            --size 4MiB >/dev/null 2>&1; then again=yes; break; fi
        sleep 1
    done
    rows+=("$(python3 - "$round" "$rc" "$BASE_DIR/fill.out" "$started" "$ended" "$written" "$writable" "$BASE_DIR/free.txt" "$waited" "$clean" "$again" <<'PY'
import sys
round_, rc, out, started, ended, written, writable, free, waited, clean, again = sys.argv[1:]
errors = [l for l in open(out) if l.startswith("errors:")]
ending = "wrote it all" if rc == "0" else (errors[0].split("first: ", 1)[-1].strip(" )\n") if errors else f"rc {rc}")
seconds = float(ended) - float(started)
# The writes acknowledged, as their leaders count them.
mib = float(written) / 2**20
least = min((float(v) for _, v in (l.split() for l in open(free) if len(l.split()) == 2) if v not in ("", "nan")), default=float("nan"))
print(f"| {round_} | {mib:,.0f} of {int(writable) >> 20} | {mib / seconds:,.0f} | {ending} "
      f"| {least / 2**20:,.1f} | {waited} | {clean} | {again} |")
PY
)")
done

{
    echo "# A fast writer fills the cluster ($(git rev-parse --short HEAD), $(date -u +%F))"
    echo
    echo "Build: $BASALT. Device $DEVICE_SIZE per OSD, $PGS PGs of 3 replicas, one writer of $BS sequential writes at QD16; OSD_ARGS='${OSD_ARGS:-}'."
    echo
    echo "| round | MiB written of what an OSD holds | MiB/s | how the writer ended | least free log MiB, any OSD | appends that waited for room | active+clean 30 s later | a write after the image's removal |"
    echo "|---:|---:|---:|---|---:|---:|---|---|"
    printf '%s\n' "${rows[@]}"
} | tee "${REPORT:-/dev/null}"
