#!/usr/bin/env bash
# Crash torture, by hand (not part of the test suite): a monitor, three OSDs on small
# devices (320 MiB, sparse, so the cleaner and checkpoints work) and a target exporting a
# 160 MiB image over NBD. Each round, fio writes the whole image (or its first SIZE bytes)
# BS bytes at a time with crc32c verify headers (its own seed per round) while one OSD,
# chosen at random, is killed with SIGKILL at a random moment and restarted a few seconds
# later; the round's data is then verified. Every third round kills every OSD instead, and
# every fourth (not a third) the monitor with the OSD. After each round the PGs must
# become active+clean, the data verify again and `basalt pg scrub` find the replicas
# equal. A failure stops it with every process left running.
#
# Usage: scripts/torture.sh
# Environment: ROUNDS (default 20), BASALT (default target/release/basalt), BASE_DIR
# (default /var/tmp/torture), BS (default 4k), SIZE (default 160M), OSD_ARGS, KEEP=1
# keeps the directory after a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
BASE_DIR=${BASE_DIR:-/var/tmp/torture}
BASALT=${BASALT:-target/release/basalt}
ROUNDS=${ROUNDS:-20}
BS=${BS:-4k}
SIZE=${SIZE:-160M}
OSD_ARGS="--sparse-device ${OSD_ARGS:-}"
. bench/cluster-lib.sh
set +e
log() { echo "$(date +%T) $*" | tee -a "$BASE_DIR/torture.log"; }
# A failure leaves every process running, to be looked at.
fail() { log "$*"; trap - EXIT; exit 1; }
scrub() {
    for _ in 1 2 3 4 5 6; do
        "$BASALT" pg scrub --mon "$MON" >"$BASE_DIR/scrub.out" 2>&1 && return 0
        grep -q " inconsistent" "$BASE_DIR/scrub.out" && grep -vq "0 inconsistent" "$BASE_DIR/scrub.out" && return 1
        sleep 10
    done
    return 1
}

start_cluster 320MiB
create_pool t 16
"$BASALT" image create t/img --size 160MiB --mon "$MON" >/dev/null
SOCK=$BASE_DIR/target.sock
"$BASALT" target -r "$SOCK" -S "$BASE_DIR" >"$BASE_DIR/target.log" 2>&1 & pids+=($!)
sleep 1
"$BASALT" rpc -s "$SOCK" bdev_basalt_create "{\"name\":\"img\",\"pool\":\"t\",\"image\":\"img\",\"mons\":[\"$MON\"]}" >/dev/null || die rpc
PORT=$("$BASALT" rpc -s "$SOCK" nbd_server_start '{"listen_address":"127.0.0.1","port":0}' | python3 -c "import json,sys;print(json.load(sys.stdin)['port'])")
"$BASALT" rpc -s "$SOCK" nbd_server_add_export '{"bdev_name":"img","name":"img"}' >/dev/null || die export
URI=nbd://127.0.0.1:$PORT/img

restart_osd() { # n
    local n=$1
    "$BASALT" osd --data-dir "$BASE_DIR/osd.$n" --mon "$MON" --device-size 320MiB $OSD_ARGS \
        --metrics-addr "127.0.0.1:${metric_ports[$n]}" >>"$BASE_DIR/osd.$n.log" 2>&1 &
    osd_pids[$n]=$!; pids+=($!)
}
fio_round() { # seed extra...
    local seed=$1; shift
    fio --name=job --ioengine=nbd --uri="$URI" --rw=randwrite --bs="$BS" --iodepth=8 --size="$SIZE" \
        --verify=crc32c --randseed="$seed" --verify_fatal=1 --verify_state_save=0 \
        --output="$BASE_DIR/fio.$seed.out" "$@"
}
wait_clean() {
    for _ in $(seq 600); do
        "$BASALT" status --mon "$MON" 2>/dev/null | grep -q "16 active+clean" && return 0; sleep 0.5
    done
    return 1
}

for round in $(seq 1 "$ROUNDS"); do
    seed=$((1000 + round))
    # Writes with a kill -9 of a random OSD at a random moment, restarted a little later.
    # Two passes, so that the kills fall within the writes.
    fio_round $seed --do_verify=0 --loops=2 &
    fio_pid=$!
    sleep $((RANDOM % 6 + 2))
    if ((round % 3 == 0)); then
        for n in 0 1 2; do kill -9 "${osd_pids[$n]}"; done
        log "round $round: killed every OSD"
        sleep 2
        for n in 0 1 2; do restart_osd $n; done
    else
        victim=$((RANDOM % 3))
        kill -9 "${osd_pids[$victim]}"; log "round $round: killed osd.$victim"
        if ((round % 4 == 0)); then
            kill -9 "$mon_pid"; log "round $round: killed the monitor"
            sleep 1
            "$BASALT" mon --data-dir "$BASE_DIR/mon" --listen "$MON" >>"$BASE_DIR/mon.log" 2>&1 &
            mon_pid=$!; pids+=($!)
        fi
        sleep $((RANDOM % 5 + 1))
        restart_osd $victim
    fi
    wait $fio_pid || fail "round $round: fio write FAILED"
    fio_round $seed --verify_only || fail "round $round: verify FAILED"
    log "round $round: verified"
    wait_clean || fail "round $round: not clean"
    fio_round $seed --verify_only || fail "round $round: verify after restart FAILED"
    scrub || { cat "$BASE_DIR/scrub.out"; fail "round $round: scrub FAILED"; }
    log "round $round: clean, verified, scrubbed"
done
log "done"
