#!/bin/bash
# The guest half of linux_uses_an_image_over_nvme_tcp_through_crashes (tests/nvme_guest.rs):
# the Linux kernel's NVMe/TCP initiator against a 3-replica Basalt image that
# `basalt target` exports from the host (10.0.2.2).
#
#   nvme_image.sh PORT NQN TRIGGER_PORT SIZE_BYTES DISCARD_BYTES
#
# NQN's namespace 1 is the image, SIZE_BYTES long; DISCARD_BYTES is the most one discard
# should cover (the target's DMRSL). On the connection to TRIGGER_PORT the guest asks the
# host test to "kill" the OSD that leads the most PGs, later to "restart" it, and to
# "restart-target" (kill -9 the target, start it again from its saved configuration); the
# host answers each with a line once done.
set -euo pipefail
port="$1"
nqn="$2"
trigger="$3"
size="$4"
discard="$5"
script_name=nvme_image
# shellcheck source=common.sh
source /basalt/common.sh

modprobe nvme-tcp
open_host_requests "$trigger"

step "connect"
# Reconnecting a second after a lost connection (rather than Linux's default 10 s).
nvme connect -t tcp -a "$host" -s "$port" -n "$nqn" --reconnect-delay=1 --ctrl-loss-tmo=120
device="$(device_of "$nqn" 1)"
name="${device#/dev/}"
[ "$(blockdev --getsize64 "$device")" = "$size" ] ||
  fail "$device holds $(blockdev --getsize64 "$device") bytes, not $size"

step "the kernel bounds its discards by the target's limit"
seen="$(cat "/sys/block/$name/queue/discard_max_bytes")"
echo "discard_max_bytes $seen, discard_max_hw_bytes $(cat "/sys/block/$name/queue/discard_max_hw_bytes")"
[ "$seen" = "$discard" ] || fail "discard_max_bytes is $seen, not $discard"

# 48 MiB of 4 KiB random writes, each verified by fio when all are written; the OSD
# leading the most PGs dies while they go on.
write=(--name=write --filename="$device" --direct=1 --ioengine=libaio --iodepth=16
  --rw=randwrite --bs=4k --size=48M --verify=crc32c --verify_fatal=1 --randseed=4321)
step "fio randwrite with crc32c verify while the busiest leader is killed"
fio_while_host kill killed "${write[@]}"

step "the killed OSD restarts and catches up; every block verifies again"
ask_host restart caught-up
fio "${write[@]}" --verify_only | grep -E 'err='

# A second region, written while the target is killed and started again: Linux
# reconnects and sends again the writes the dead target had not answered.
second=(--name=second --filename="$device" --direct=1 --ioengine=libaio --iodepth=16
  --rw=randwrite --bs=4k --offset=64M --size=32M --verify=crc32c --verify_fatal=1
  --randseed=8765)
step "fio randwrite with crc32c verify while the target is killed and restarted"
fio_while_host restart-target restarted "${second[@]}"
fio "${write[@]}" --verify_only | grep -E 'err='

step "write zeroes (blkdiscard -z) reads back as zeroes, and only there"
zero_a_mib "$device" 128 -z

step "blkdiscard of the whole image reads back as zeroes"
blkdiscard "$device"
for at in 0 6000 12000 $((size / 4096 - 64)); do
  expect_zeroes "$device" "$at" 64
done

nvme disconnect -n "$nqn"
step "done"
