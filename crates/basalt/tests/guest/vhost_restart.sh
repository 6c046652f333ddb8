#!/bin/bash
# The guest half of the life-cycle test in tests/vhost_guest.rs: /dev/vda is a
# vhost-user-blk controller on a file bdev, its chardev opened with reconnect=1.
#
# First boot: write a verified pattern and reboot. Second boot (the same controller, after
# a device reset): the pattern reads back; then, while fio writes and verifies at queue
# depth 32, ask the host to restart the target (it kills it with SIGKILL and starts it again
# from its saved configuration): the requests in flight at the kill are replayed, fio's
# verify passes; then read the pattern back, write more and read that back. Last, ask the host to grow the disk (it grows the file from 64 to 96 MiB
# and calls bdev_uring_rescan): the running guest sees the new size within 10 s (the
# target's configuration change notice) and its new part takes a verified pattern.
set -euo pipefail
step() { echo "vhost_restart: $*"; }

modprobe virtio_blk
for _ in $(seq 100); do [ -b /dev/vda ] && break; sleep 0.1; done
[ -b /dev/vda ]

# Which boot this is, in the disk's last 4 KiB block (outside both patterns).
marker_block=$(($(blockdev --getsize64 /dev/vda) / 4096 - 1))
marker() {
  dd if=/dev/vda bs=4096 skip="$marker_block" count=1 iflag=direct status=none |
    head -c 16 | tr -d '\0 '
}
set_marker() {
  printf '%-4096s' "$1" | dd of=/dev/vda bs=4096 seek="$marker_block" count=1 \
    oflag=direct status=none
}
# fio writes a pattern with crc32c headers; --verify_only reads it back later.
pattern() {
  fio --name="pattern$1" --filename=/dev/vda --direct=1 --ioengine=libaio --iodepth=8 \
    --rw=randwrite --bs=4k --offset="$1" --size=16M --verify=crc32c --verify_fatal=1 \
    "${@:2}" | grep -E 'err='
}

case "$(marker)" in
  "")
    step "first boot: a verified pattern"
    pattern 0
    set_marker reboot
    step "rebooting"
    sync
    reboot -f
    ;;
  reboot)
    step "second boot: the pattern reads back after the reset"
    pattern 0 --verify_only=1
    set_marker restarted
    # Writes at queue depth 2 x 16 run across the target's death: the requests in flight then
    # are replayed by the restarted target (from the in-flight region QEMU keeps), so none
    # is lost and none completes twice; fio verifies each pass.
    # Two jobs, one per vCPU, so both of the controller's queues carry requests (blk-mq
    # maps a queue to each CPU); each writes its own 16 MiB.
    timeout 300 fio --name=across --filename=/dev/vda --direct=1 --ioengine=libaio \
      --iodepth=16 --rw=randwrite --bs=4k --offset=16M --size=16M --offset_increment=16M \
      --numjobs=2 --cpus_allowed=0-1 --cpus_allowed_policy=split --loops=4 \
      --verify=crc32c --verify_fatal=1 --output=/tmp/across.txt &
    fio_pid=$!
    sleep 1
    step "restart the target now"
    across=0
    wait "$fio_pid" || across=$?
    grep -E 'err=|verify' /tmp/across.txt || true
    [ "$across" -eq 0 ] || { echo "vhost_restart: fio across the restart failed ($across)"; exit 1; }
    step "writes across the restart verified"
    step "the pattern reads back through the restarted target"
    pattern 0 --verify_only=1
    step "new writes go through"
    pattern 16M
    pattern 16M --verify_only=1
    step "grow the disk now"
    for _ in $(seq 100); do
      [ "$(blockdev --getsize64 /dev/vda)" -eq $((96 << 20)) ] && break
      sleep 0.1
    done
    step "the disk is $(blockdev --getsize64 /dev/vda) bytes"
    [ "$(blockdev --getsize64 /dev/vda)" -eq $((96 << 20)) ]
    pattern 80M
    pattern 80M --verify_only=1
    step "done"
    ;;
  *)
    echo "vhost_restart: unexpected marker '$(marker)'" >&2
    exit 1
    ;;
esac
