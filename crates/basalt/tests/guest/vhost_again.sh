#!/bin/bash
# The second boot of tests/vhost_guest.rs: a new QEMU attaches to the same controllers
# (the target kept running) and finds the files the first boot wrote.
set -euo pipefail
modprobe virtio_blk
for _ in $(seq 100); do [ -b /dev/vda ] && break; sleep 0.1; done
mount -t ext4 /dev/vda /mnt
(cd /mnt && sha256sum -c sums)
head -c 65536 /dev/urandom >/mnt/again
sync
umount /mnt
fsck.ext4 -n -f /dev/vda >/dev/null
echo "vhost_again: done"
