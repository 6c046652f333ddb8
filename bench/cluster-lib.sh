# Sourced by the cluster benchmarks (cluster.sh, idle.sh): a monitor and three OSDs on
# loopback, each OSD serving metrics. The caller sets BASALT and BASE_DIR (made afresh
# here, removed on exit unless KEEP is set), and may set OSD_ARGS.

rm -rf "$BASE_DIR"; mkdir -p "$BASE_DIR"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    [ -n "${KEEP:-}" ] || rm -rf "$BASE_DIR"
}
trap cleanup EXIT

die() { echo "$(basename "$0"): $*" >&2; exit 1; }
free_port() { python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# start_cluster DEVICE_SIZE: sets MON, mon_pid, metric_ports and osd_pids; waits until the three
# OSDs are up.
start_cluster() {
    MON=127.0.0.1:$(free_port)
    "$BASALT" mon --data-dir "$BASE_DIR/mon" --listen "$MON" >"$BASE_DIR/mon.log" 2>&1 & pids+=($!)
    mon_pid=$!
    metric_ports=(); osd_pids=()
    for n in 0 1 2; do
        metric_ports+=("$(free_port)")
        "$BASALT" osd --data-dir "$BASE_DIR/osd.$n" --mon "$MON" --device-size "$1" ${OSD_ARGS:-} \
            --metrics-addr "127.0.0.1:${metric_ports[$n]}" >"$BASE_DIR/osd.$n.log" 2>&1 &
        pids+=($!); osd_pids+=($!)
    done
    local up=0
    for _ in $(seq 300); do
        up=$("$BASALT" osd ls --json --mon "$MON" 2>/dev/null | python3 -c "import json,sys;print(sum(o['up'] for o in json.load(sys.stdin)))" 2>/dev/null || echo 0)
        [ "$up" = 3 ] && break; sleep 0.2
    done
    [ "$up" = 3 ] || die "only $up of 3 OSDs came up; see $BASE_DIR/*.log (KEEP=1 keeps them)"
}

# fresh_cluster DEVICE_SIZE: stops what runs, empties BASE_DIR, then start_cluster (for
# scripts that run each build on a cluster of its own).
fresh_cluster() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$BASE_DIR"; mkdir -p "$BASE_DIR"; pids=()
    start_cluster "$1"
}

# create_pool NAME PGS: a pool of 3 replicas; waits until its PGs are active+clean.
create_pool() {
    "$BASALT" pool create "$1" --pg-count "$2" --size 3 --mon "$MON" >/dev/null
    for _ in $(seq 600); do
        "$BASALT" status --mon "$MON" | grep -q "$2 active+clean" && return 0; sleep 0.2
    done
    die "the PGs did not all become active+clean"
}

# metric_sum NAME: a metric summed over the three OSDs ("nan" if the build lacks it).
metric_sum() {
    command -v curl >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl >/dev/null; }
    local total=0 value
    for port in "${metric_ports[@]}"; do
        value=$(curl -s "127.0.0.1:$port/metrics" | awk -v m="$1" '$1 == m {print $2}')
        total=$(python3 -c "print(float('$total') + float('${value:-nan}'))")
    done
    echo "$total"
}
