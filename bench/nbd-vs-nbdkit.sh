#!/usr/bin/env bash
# Compare Basalt's NBD frontend with nbdkit's memory plugin, using fio's nbd
# engine (libnbd, userspace, no kernel nbd device) as the client for both.
#
# Cases: 4k randread and randwrite at QD1 and QD32 (numjobs=1 each). For every
# case Basalt runs first and nbdkit right after, so machine noise lands on both
# alike. Both volumes are written once (sequential 1M) before the first case so
# reads return real data rather than unallocated/zero regions.
#
# Usage: bench/nbd-vs-nbdkit.sh [REPORT.md]
#
# Environment:
#   SIZE       volume size for both servers: bytes or N[KMGT] (binary), multiple
#              of 1M (default 1G)
#   RUNTIME    seconds of measurement per fio run (default 10); ramp 2 s extra
#   RAMP       ramp_time seconds per fio run (default 2)
#   BASALT     basalt binary (default target/release/basalt, built with
#              `cargo build --release -p basalt` if absent)
#   REACTORS   optional: passed to `basalt target -m`
#   PLACEMENT  optional: passed to `basalt target --reactor-placement`
#              (incoming-cpu or round-robin)
#   KEEP       1 to keep the temp dir (fio JSON, server logs) instead of
#              removing it on exit
#
# Both servers listen on 127.0.0.1 only, on free ports in 10900-10999.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(git -C "$SCRIPT_DIR" rev-parse --show-toplevel 2>/dev/null || (cd "$SCRIPT_DIR/.." && pwd))

SIZE=${SIZE:-1G}
RUNTIME=${RUNTIME:-10}
RAMP=${RAMP:-2}
KEEP=${KEEP:-0}
REPORT=${1:-}
PORT_LO=10900
PORT_HI=10999
EXPORT=m0
BLOCK_SIZE=4096

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# ---------------------------------------------------------------- cleanup
TMP=""
BASALT_PID=""
NBDKIT_PID=""
FIO_PID=""

stop_pid() { # pid name
    local pid=$1 name=$2 i
    [ -n "$pid" ] || return 0
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name (pid $pid) ignored SIGTERM, sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

cleanup() {
    local rc=$?
    set +e
    trap - EXIT INT TERM
    stop_pid "$FIO_PID" fio
    stop_pid "$BASALT_PID" "basalt target"
    stop_pid "$NBDKIT_PID" "nbdkit"
    if [ -n "$TMP" ] && [ -d "$TMP" ]; then
        if [ "$rc" -ne 0 ]; then
            for f in "$TMP"/basalt.log "$TMP"/nbdkit.log; do
                [ -s "$f" ] && { log "last lines of $f:"; tail -n 20 "$f" >&2; }
            done
        fi
        if [ "$KEEP" = 1 ]; then
            log "kept results in $TMP"
        else
            rm -rf "$TMP"
        fi
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------- inputs
size_bytes() {
    local s=$1 n u
    [[ $s =~ ^([0-9]+)([KkMmGgTt]?)$ ]] || die "SIZE must be bytes or N[KMGT], got '$s'"
    n=${BASH_REMATCH[1]}
    u=${BASH_REMATCH[2]}
    case $u in
        "") echo "$n" ;;
        K|k) echo $((n << 10)) ;;
        M|m) echo $((n << 20)) ;;
        G|g) echo $((n << 30)) ;;
        T|t) echo $((n << 40)) ;;
    esac
}
SIZE_BYTES=$(size_bytes "$SIZE")
[ "$SIZE_BYTES" -gt 0 ] && [ $((SIZE_BYTES % (1 << 20))) -eq 0 ] ||
    die "SIZE must be a positive multiple of 1M, got '$SIZE' ($SIZE_BYTES bytes)"
NUM_BLOCKS=$((SIZE_BYTES / BLOCK_SIZE))
[[ $RUNTIME =~ ^[0-9]+$ ]] && [ "$RUNTIME" -gt 0 ] || die "RUNTIME must be a positive integer, got '$RUNTIME'"
[[ $RAMP =~ ^[0-9]+$ ]] || die "RAMP must be a non-negative integer, got '$RAMP'"

# ---------------------------------------------------------------- tools
apt_install() {
    log "installing missing Debian packages: $*"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y "$@" >&2 ||
        { $sudo apt-get update >&2 && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y "$@" >&2; }
}
missing=()
command -v fio >/dev/null 2>&1 || missing+=(fio)
command -v nbdkit >/dev/null 2>&1 || missing+=(nbdkit)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
[ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"
fio --enghelp=nbd >/dev/null 2>&1 || die "this fio has no nbd ioengine (needs fio built with libnbd)"
nbdkit memory --dump-plugin >/dev/null 2>&1 || die "nbdkit memory plugin not found"

if [ -z "${BASALT:-}" ]; then
    BASALT=$REPO_ROOT/target/release/basalt
    if [ ! -x "$BASALT" ]; then
        log "building $BASALT"
        (cd "$REPO_ROOT" && cargo build --release -p basalt) >&2
    fi
fi
[ -x "$BASALT" ] || die "basalt binary not found or not executable: $BASALT"

TMP=$(mktemp -d "${TMPDIR:-/tmp}/nbd-vs-nbdkit.XXXXXX")
SOCK=$TMP/basalt.sock

# ---------------------------------------------------------------- ports
# Candidate ports in random order that nothing on 127.0.0.1 is bound to right
# now; the servers may still lose a race for one, so callers retry.
free_ports() {
    python3 - "$PORT_LO" "$PORT_HI" <<'EOF'
import random, socket, sys
lo, hi = int(sys.argv[1]), int(sys.argv[2])
ports = list(range(lo, hi + 1))
random.shuffle(ports)
for p in ports:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        continue
    finally:
        s.close()
    print(p)
EOF
}

# ---------------------------------------------------------------- basalt
brpc() { "$BASALT" rpc -s "$SOCK" "$@"; }

start_basalt() {
    local args=(target -r "$SOCK") i port
    [ -z "${REACTORS:-}" ] || args+=(-m "$REACTORS")
    [ -z "${PLACEMENT:-}" ] || args+=(--reactor-placement "$PLACEMENT")
    "$BASALT" "${args[@]}" >"$TMP/basalt.log" 2>&1 &
    BASALT_PID=$!
    for i in $(seq 1 100); do
        kill -0 "$BASALT_PID" 2>/dev/null || die "basalt target exited during startup"
        [ -S "$SOCK" ] && brpc bdev_get_bdevs >/dev/null 2>&1 && break
        sleep 0.1
    done
    [ -S "$SOCK" ] || die "basalt target did not create $SOCK"
    brpc bdev_malloc_create "{\"name\":\"$EXPORT\",\"num_blocks\":$NUM_BLOCKS,\"block_size\":$BLOCK_SIZE}" >/dev/null
    BASALT_PORT=""
    for port in $(free_ports); do
        if brpc nbd_server_start "{\"listen_address\":\"127.0.0.1\",\"port\":$port}" >"$TMP/nbd_server_start.json" 2>>"$TMP/rpc.err"; then
            BASALT_PORT=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["port"])' "$TMP/nbd_server_start.json")
            break
        fi
    done
    [ -n "$BASALT_PORT" ] || die "basalt: no free port in $PORT_LO-$PORT_HI (see $TMP/rpc.err)"
    brpc nbd_server_add_export "{\"bdev_name\":\"$EXPORT\",\"name\":\"$EXPORT\"}" >/dev/null
    BASALT_URI=nbd://127.0.0.1:$BASALT_PORT/$EXPORT
    log "basalt target pid $BASALT_PID serving $BASALT_URI ($SIZE_BYTES bytes)"
}

# ---------------------------------------------------------------- nbdkit
start_nbdkit() {
    local port i
    NBDKIT_PORT=""
    for port in $(free_ports); do
        rm -f "$TMP/nbdkit.pid"
        # -f: stay in the foreground so $! is nbdkit itself; -P: written once
        # the listening socket is ready. The memory plugin ignores the export
        # name, so clients use the default ("") export.
        nbdkit -f -i 127.0.0.1 -p "$port" -P "$TMP/nbdkit.pid" \
            memory size="$SIZE_BYTES" >"$TMP/nbdkit.log" 2>&1 &
        NBDKIT_PID=$!
        for i in $(seq 1 100); do
            [ -s "$TMP/nbdkit.pid" ] && break
            kill -0 "$NBDKIT_PID" 2>/dev/null || break
            sleep 0.05
        done
        if [ -s "$TMP/nbdkit.pid" ] && kill -0 "$NBDKIT_PID" 2>/dev/null; then
            NBDKIT_PORT=$port
            break
        fi
        stop_pid "$NBDKIT_PID" nbdkit
        NBDKIT_PID=""
    done
    [ -n "$NBDKIT_PORT" ] || die "nbdkit: could not listen on any port in $PORT_LO-$PORT_HI (see $TMP/nbdkit.log)"
    NBDKIT_URI=nbd://127.0.0.1:$NBDKIT_PORT/
    log "nbdkit pid $NBDKIT_PID serving $NBDKIT_URI ($SIZE_BYTES bytes)"
}

# ---------------------------------------------------------------- fio
# One fio run. JSON goes to --output (the nbd engine prints "fio: connected to
# NBD server" on stdout, which would corrupt JSON read from stdout).
run_fio() { # out.json uri name [fio options...]
    local out=$1 uri=$2 name=$3
    shift 3
    local alive
    for alive in "$BASALT_PID" "$NBDKIT_PID"; do
        kill -0 "$alive" 2>/dev/null || die "a server died (pid $alive) before fio run $name"
    done
    # In the background plus `wait`, so an INT/TERM trap runs at once (bash
    # defers traps until a foreground child exits) and cleanup can stop fio.
    fio --name="$name" --ioengine=nbd --uri="$uri" "$@" \
        --output-format=json --output="$out" >"$out.stdout" 2>"$out.stderr" &
    FIO_PID=$!
    local rc=0
    wait "$FIO_PID" || rc=$?
    FIO_PID=""
    [ "$rc" -eq 0 ] || { cat "$out.stderr" >&2; die "fio failed ($rc): $name against $uri"; }
}

FIO_COMMON=(--bs=4k --numjobs=1 --time_based=1 --runtime="$RUNTIME" --ramp_time="$RAMP" --lat_percentiles=1)
FIO_PATTERN="fio --name=CASE --ioengine=nbd --uri=nbd://127.0.0.1:PORT/EXPORT --rw={randread,randwrite} --iodepth={1,32} ${FIO_COMMON[*]} --output-format=json --output=FILE"
PREFILL_PATTERN="fio --name=prefill --ioengine=nbd --uri=nbd://127.0.0.1:PORT/EXPORT --rw=write --bs=1M --iodepth=8 --numjobs=1 --output-format=json --output=FILE"

# Server CPU time (user + system, all threads) in clock ticks, from /proc/PID/stat.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# ---------------------------------------------------------------- run
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
START_DATE=$(date -u '+%Y-%m-%d %H:%M:%S UTC')

start_basalt
start_nbdkit

for srv in basalt nbdkit; do
    if [ "$srv" = basalt ]; then uri=$BASALT_URI; else uri=$NBDKIT_URI; fi
    log "prefill $srv: sequential 1M write of $SIZE_BYTES bytes"
    run_fio "$TMP/prefill.$srv.json" "$uri" prefill --rw=write --bs=1M --iodepth=8 --numjobs=1
    python3 - "$TMP/prefill.$srv.json" "$SIZE_BYTES" <<'EOF'
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]
want = int(sys.argv[2])
if job["error"] or job["write"]["io_bytes"] != want:
    sys.exit(f"prefill wrote {job['write']['io_bytes']} of {want} bytes (error {job['error']})")
EOF
done

CASES=(randread:1 randread:32 randwrite:1 randwrite:32)
for c in "${CASES[@]}"; do
    rw=${c%%:*}
    qd=${c##*:}
    name=$rw-4k-qd$qd
    for srv in basalt nbdkit; do
        if [ "$srv" = basalt ]; then uri=$BASALT_URI; pid=$BASALT_PID; else uri=$NBDKIT_URI; pid=$NBDKIT_PID; fi
        log "$name on $srv (${RAMP}s ramp + ${RUNTIME}s)"
        cpu_before=$(cpu_ticks "$pid")
        run_fio "$TMP/$name.$srv.json" "$uri" "$name" --rw="$rw" --iodepth="$qd" "${FIO_COMMON[@]}"
        echo $(( $(cpu_ticks "$pid") - cpu_before )) >"$TMP/$name.$srv.cpu"
    done
done

LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

# ---------------------------------------------------------------- report
COMMIT=$(git -C "$REPO_ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ "$COMMIT" != unknown ] && ! git -C "$REPO_ROOT" diff --quiet HEAD -- 2>/dev/null; then
    COMMIT="$COMMIT (dirty tree)"
fi

report() {
    echo "# Basalt NBD vs nbdkit memory (fio nbd engine)"
    echo
    echo "- commit: $COMMIT"
    echo "- date: $START_DATE"
    echo "- nproc: $(nproc)"
    echo "- load average (1/5/15 min): start $LOAD_START, end $LOAD_END"
    echo "- basalt: $BASALT${REACTORS:+ -m $REACTORS}${PLACEMENT:+ --reactor-placement $PLACEMENT}, malloc bdev $NUM_BLOCKS x $BLOCK_SIZE B"
    echo "- nbdkit: $(nbdkit --version | head -n1), \`nbdkit -f -i 127.0.0.1 -p PORT memory size=$SIZE_BYTES\`"
    echo "- $(fio --version), size $SIZE_BYTES bytes, runtime ${RUNTIME}s + ramp ${RAMP}s per run, basalt then nbdkit per case"
    echo "- prefill: \`$PREFILL_PATTERN\`"
    echo "- cases: \`$FIO_PATTERN\`"
    echo "- latency = fio total latency (lat_ns: submit to completion), p99 from lat percentiles"
    echo "- server CPU us/IO = server process user+system time over the whole run (ramp included) / (IOPS x (ramp + runtime))"
    echo
    python3 - "$TMP" "$(getconf CLK_TCK)" "$RUNTIME" "$RAMP" "${CASES[@]}" <<'EOF'
import json, sys
tmp, clk_tck, runtime, ramp, cases = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5:]

def cpu_us_per_io(path, iops):
    ticks = int(open(path).read())
    return ticks / clk_tck * 1e6 / (iops * (runtime + ramp)) if iops else float("nan")

def stats(path, rw):
    job = json.load(open(path))["jobs"][0]
    if job["error"]:
        sys.exit(f"{path}: fio job error {job['error']}")
    d = job["read" if rw == "randread" else "write"]
    lat = d["lat_ns"]
    pct = lat.get("percentile") or d["clat_ns"].get("percentile", {})
    return d["iops"], lat["mean"] / 1000.0, pct.get("99.000000", float("nan")) / 1000.0

print("| case | basalt IOPS | nbdkit IOPS | ratio IOPS basalt/nbdkit "
      "| basalt mean lat us | nbdkit mean lat us | basalt p99 us | nbdkit p99 us "
      "| basalt CPU us/IO | nbdkit CPU us/IO |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for c in cases:
    rw, qd = c.split(":")
    name = f"{rw}-4k-qd{qd}"
    b = stats(f"{tmp}/{name}.basalt.json", rw)
    n = stats(f"{tmp}/{name}.nbdkit.json", rw)
    ratio = b[0] / n[0] if n[0] else float("nan")
    b_cpu = cpu_us_per_io(f"{tmp}/{name}.basalt.cpu", b[0])
    n_cpu = cpu_us_per_io(f"{tmp}/{name}.nbdkit.cpu", n[0])
    print(f"| {rw} 4k QD{qd} | {b[0]:.0f} | {n[0]:.0f} | {ratio:.2f} "
          f"| {b[1]:.1f} | {n[1]:.1f} | {b[2]:.1f} | {n[2]:.1f} | {b_cpu:.1f} | {n_cpu:.1f} |")
EOF
}

report >"$TMP/report.md"
cat "$TMP/report.md"
if [ -n "$REPORT" ]; then
    cp "$TMP/report.md" "$REPORT"
    log "report written to $REPORT"
fi
