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
host=10.0.2.2
device=/dev/nbd0
step() { echo "nbd_kernel: $*"; }
fail() {
  echo "nbd_kernel: $*" >&2
  exit 1
}

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
head -c $((3 << 20)) /dev/urandom >/tmp/random
for how in "" -z; do
  dd if=/tmp/random of="$device" bs=1M seek=60 oflag=direct status=none
  blkdiscard $how -o $((61 << 20)) -l $((1 << 20)) "$device"
  expect_zeroes "$device" $((61 * 256)) 256
  dd if="$device" bs=1M skip=60 count=3 iflag=direct status=none >/tmp/read
  cmp -n $((1 << 20)) /tmp/random /tmp/read || fail "blkdiscard $how: the MiB before changed"
  cmp /tmp/random /tmp/read $((2 << 20)) $((2 << 20)) || fail "blkdiscard $how: the MiB after changed"
done

step "ext4: mkfs, files, fstrim, checksums across unmount, disconnect and reconnect"
mkfs.ext4 -q -F "$device"
mount -t ext4 "$device" /mnt
write_files_and_trim 15
umount /mnt
nbd-client -d "$device"
nbd-client "$host" "$port" "$device" -N "$export_name"
mount -t ext4 "$device" /mnt
(cd /mnt && sha256sum -c /tmp/sums)
umount /mnt
fsck.ext4 -n -f "$device" >/dev/null
nbd-client -d "$device"
step "done"
