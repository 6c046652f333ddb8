#!/bin/bash
# The guest half of tests/nbd_guest.rs: the Linux kernel's NBD client (nbd-client and
# nbd.ko) against a Basalt image that `basalt target` exports over NBD from the host
# (10.0.2.2).
#
#   nbd_kernel.sh PORT EXPORT SIZE_BYTES
set -euo pipefail
port="$1"
export_name="$2"
size="$3"
device=/dev/nbd0
script_name=nbd_kernel
# shellcheck source=common.sh
source /basalt/common.sh

modprobe nbd

step "connect"
nbd-client "$host" "$port" "$device" -N "$export_name"
[ "$(blockdev --getsize64 "$device")" = "$size" ] ||
  fail "$device holds $(blockdev --getsize64 "$device") bytes, not $size"
echo "discard_max_bytes $(cat /sys/block/nbd0/queue/discard_max_bytes)"

step "fio randwrite with crc32c verify, then a verify-only pass"
write=(--name=write --filename="$device" --direct=1 --ioengine=libaio --iodepth=16
  --rw=randwrite --bs=4k --size=32M --verify=crc32c --verify_fatal=1)
fio "${write[@]}" --do_verify=1 | grep -E 'IOPS|err='
fio "${write[@]}" --verify_only | grep -E 'err='
# Larger writes, as the kernel splits them.
fio --name=large --filename="$device" --direct=1 --ioengine=libaio --iodepth=4 \
  --rw=write --bs=1M --offset=40M --size=16M --verify=crc32c --verify_fatal=1 | grep -E 'IOPS|err='

step "discard and write zeroes read back as zeroes, and only there"
zero_a_mib "$device" 60
zero_a_mib "$device" 60 -z

step "ext4: mkfs, files, fstrim, checksums across unmount, disconnect and reconnect"
ext4_files "$device" 15
nbd-client -d "$device"
nbd-client "$host" "$port" "$device" -N "$export_name"
check_files "$device"
nbd-client -d "$device"
step "done"
