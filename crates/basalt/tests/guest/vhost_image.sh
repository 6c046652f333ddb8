#!/bin/bash
# The guest half of a_guest_runs_on_an_image_through_an_osd_crash (tests/vhost_guest.rs):
# the Linux virtio-blk driver on a vhost-user-blk controller of `basalt target` serving a
# 3-replica Basalt image (QEMU connects it as /dev/vda, two queues).
#
#   vhost_image.sh TRIGGER_PORT SIZE_BYTES DISCARD_BYTES
#
# DISCARD_BYTES is the most one discard or write zeroes should cover (the controller's
# max_discard_sectors). On the connection to TRIGGER_PORT (at 10.0.2.2) the guest asks
# the host test to "kill" the OSD that leads the most PGs and then to "restart" it; the
# host answers each with a line once done.
set -euo pipefail
trigger="$1"
size="$2"
discard="$3"
device=/dev/vda
script_name=vhost_image
# shellcheck source=common.sh
source /basalt/common.sh

modprobe virtio_blk
for _ in $(seq 100); do [ -b "$device" ] && break; sleep 0.1; done
[ -b "$device" ] || fail "no $device"
open_host_requests "$trigger"

step "size, queues, and the discard limit the driver took"
[ "$(blockdev --getsize64 "$device")" = "$size" ] ||
  fail "$device holds $(blockdev --getsize64 "$device") bytes, not $size"
ls /sys/block/vda/mq | wc -l | grep -qx 2 || fail "not two queues"
for limit in discard_max_bytes write_zeroes_max_bytes; do
  seen="$(cat "/sys/block/vda/queue/$limit")"
  echo "$limit $seen"
  [ "$seen" = "$discard" ] || fail "$limit is $seen, not $discard"
done

# Two jobs, one per vCPU and so one per queue, of 4 KiB random writes verified by fio;
# the OSD leading the most PGs dies while they go on.
write=(--name=write --filename="$device" --direct=1 --ioengine=libaio --iodepth=16
  --rw=randwrite --bs=4k --size=24M --numjobs=2 --offset_increment=32M
  --cpus_allowed=0-1 --cpus_allowed_policy=split
  --verify=crc32c --verify_fatal=1 --randseed=4321 --group_reporting)
step "fio randwrite with crc32c verify while the busiest leader is killed"
fio_while_host kill killed "${write[@]}"

step "the killed OSD restarts and catches up; every block verifies again"
ask_host restart caught-up
fio "${write[@]}" --verify_only | grep -E 'err='

step "discard and write zeroes read back as zeroes, and only there"
zero_a_mib "$device" 100
zero_a_mib "$device" 100 -z

step "blkdiscard of the whole image reads back as zeroes"
blkdiscard "$device"
for at in 0 6000 12000 $((size / 4096 - 64)); do
  expect_zeroes "$device" "$at" 64
done

step "ext4: mkfs, files, fstrim, checksums across a remount"
ext4_files "$device" 15
step "done"
