#!/bin/bash
# The guest half of tests/vhost_guest.rs: the Linux virtio-blk driver on two
# vhost-user-blk controllers of `basalt target` (QEMU connects them as /dev/vda, two
# queues, and /dev/vdb, read-only).
#
#   vhost_blk.sh SIZE_BYTES SERIAL
set -euo pipefail
size="$1"
serial="$2"
script_name=vhost_blk
# shellcheck source=common.sh
source /basalt/common.sh

modprobe virtio_blk
for _ in $(seq 100); do [ -b /dev/vda ] && [ -b /dev/vdb ] && break; sleep 0.1; done
[ -b /dev/vda ] && [ -b /dev/vdb ]

step "size, serial, queues, read-only flag, write cache"
[ "$(blockdev --getsize64 /dev/vda)" = "$size" ]
[ "$(cat /sys/block/vda/serial)" = "$serial" ]
ls /sys/block/vda/mq | wc -l | grep -qx 2
[ "$(cat /sys/block/vda/ro)" = 0 ]
[ "$(cat /sys/block/vdb/ro)" = 1 ]
# FLUSH is offered and CONFIG_WCE is not: the guest takes the disk for one with a
# volatile write cache and sends flushes (fsync, journal commits), which the bdev makes
# durable; a write completes when the bdev has it, not when it is on stable storage.
[ "$(cat /sys/block/vda/queue/write_cache)" = "write back" ]
cat /sys/block/vda/queue/discard_max_bytes /sys/block/vda/queue/write_zeroes_max_bytes

step "fio randwrite with crc32c verify, two jobs on two queues"
fio --name=verify --filename=/dev/vda --direct=1 --ioengine=libaio --iodepth=16 \
  --rw=randwrite --bs=4k --size=16M --numjobs=2 --offset_increment=16M \
  --verify=crc32c --verify_fatal=1 --group_reporting | grep -E 'IOPS|err='
fio --name=large --filename=/dev/vda --direct=1 --ioengine=libaio --iodepth=4 \
  --rw=write --bs=512k --offset=40M --size=8M --verify=crc32c --verify_fatal=1 | grep -E 'err='

step "discard reads back as zeroes"
dd if=/dev/urandom of=/dev/vda bs=4096 seek=12800 count=64 oflag=direct status=none
blkdiscard -o $((12800 * 4096)) -l $((64 * 4096)) /dev/vda
if ! dd if=/dev/vda bs=4096 skip=12800 count=64 iflag=direct status=none |
  cmp -s - <(head -c $((64 * 4096)) /dev/zero); then
  echo "vhost_blk: discarded blocks are not zeroes" >&2
  exit 1
fi

step "write zeroes reads back as zeroes"
# The driver sends VIRTIO_BLK_T_WRITE_ZEROES for BLKZEROOUT only when the device offers it.
[ "$(cat /sys/block/vda/queue/write_zeroes_max_bytes)" -gt 0 ]
dd if=/dev/urandom of=/dev/vda bs=4096 seek=13000 count=32 oflag=direct status=none
blkdiscard -z -o $((13000 * 4096)) -l $((32 * 4096)) /dev/vda
if ! dd if=/dev/vda bs=4096 skip=13000 count=32 iflag=direct status=none |
  cmp -s - <(head -c $((32 * 4096)) /dev/zero); then
  echo "vhost_blk: blocks written with zeroes are not zeroes" >&2
  exit 1
fi

step "ext4 (inode tables zeroed by write zeroes), files, checksums across remount"
mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 /dev/vda
mount -t ext4 /dev/vda /mnt
write_files_and_trim 10
umount /mnt
mount -t ext4 /dev/vda /mnt
(cd /mnt && sha256sum -c /tmp/sums)
cp /tmp/sums /mnt/sums
umount /mnt
fsck.ext4 -n -f /dev/vda >/dev/null

step "the read-only controller refuses writes"
if dd if=/dev/zero of=/dev/vdb bs=4096 count=1 oflag=direct status=none 2>/dev/null; then
  echo "vhost_blk: a write to the read-only disk succeeded" >&2
  exit 1
fi
dd if=/dev/vdb of=/dev/null bs=4096 count=16 iflag=direct status=none

step "done"
