#!/bin/bash
# The guest half of tests/nvme_guest.rs: the Linux kernel's NVMe/TCP initiator and
# nvme-cli against `basalt target` on the host (10.0.2.2).
#
#   nvme_tcp.sh PORT NQN RESTRICTED_NQN TRIGGER_PORT
#
# NQN exports a 128 MiB namespace to any host; RESTRICTED_NQN allows one host that is not
# this guest. On a connection to TRIGGER_PORT the guest asks the host test to
# "add-namespace" 2 to NQN; the host answers "added" once it is.
set -euo pipefail
port="$1"
nqn="$2"
restricted="$3"
trigger="$4"
script_name=nvme_tcp

# shellcheck source=common.sh
source /basalt/common.sh

modprobe nvme-tcp

step "discover"
discovered="$(nvme discover -t tcp -a "$host" -s "$port")"
echo "$discovered"
grep -q "subnqn: *$nqn" <<<"$discovered"
grep -q "trsvcid: *$port" <<<"$discovered"
if grep -q "subnqn: *$restricted" <<<"$discovered"; then
  echo "nvme_tcp: discovery lists a subsystem this host may not use" >&2
  exit 1
fi

step "a host that is not allowed is refused"
if nvme connect -t tcp -a "$host" -s "$port" -n "$restricted" 2>&1; then
  echo "nvme_tcp: connected to $restricted, which does not allow this host" >&2
  exit 1
fi

step "connect"
nvme connect -t tcp -a "$host" -s "$port" -n "$nqn"
device="$(device_of "$nqn" 1)"
nvme list
[ "$(blockdev --getsize64 "$device")" = $((128 << 20)) ]
nvme id-ctrl "$device" | tee /tmp/id-ctrl | grep -E '^(sn|mn|subnqn|mdts|cntlid|oncs|sgls) '
grep -q "^subnqn *: $nqn" /tmp/id-ctrl
grep -q "^sn *: BASALTGUEST1" /tmp/id-ctrl
nvme id-ns "$device" | grep -E '^(nsze|ncap|nlbaf|flbas|dlfeat)|in use'
nvme id-ns "$device" -n 1 | grep -q "^nsze *: 0x40000"

step "fio randwrite with crc32c verify, then a verify-only pass"
fio --name=write --filename="$device" --direct=1 --ioengine=libaio --iodepth=16 \
  --rw=randwrite --bs=4k --size=24M --verify=crc32c --verify_fatal=1 --do_verify=1 \
  --numjobs=1 | grep -E 'IOPS|err='
fio --name=write --filename="$device" --direct=1 --ioengine=libaio --iodepth=16 \
  --rw=randwrite --bs=4k --size=24M --verify=crc32c --verify_fatal=1 --verify_only \
  | grep -E 'err='
# Larger writes go through R2T and several H2CData PDUs.
fio --name=large --filename="$device" --direct=1 --ioengine=libaio --iodepth=4 \
  --rw=write --bs=256k --offset=32M --size=16M --verify=crc32c --verify_fatal=1 | grep -E 'IOPS|err='

step "a read past the end fails, and the error log names its LBA"
if nvme read "$device" -n 1 -s $((0x40000 - 1)) -c 1 -z 1024 -d /dev/null 2>&1; then
  echo "nvme_tcp: a read past the end succeeded" >&2
  exit 1
fi
nvme error-log "$device" -e 1 | tee /tmp/error-log
grep -Eiq '^lba[[:space:]]*:[[:space:]]*(0x3ffff|262143)' /tmp/error-log

step "flush"
nvme flush "$device" -n 1

step "deallocate reads back as zeroes"
dd if=/dev/urandom of="$device" bs=4096 seek=12800 count=64 oflag=direct status=none
nvme dsm "$device" -n 1 --ad -s $((12800 * 8)) -b $((64 * 8))
expect_zeroes "$device" 12800 64

step "write zeroes reads back as zeroes"
dd if=/dev/urandom of="$device" bs=4096 seek=13000 count=32 oflag=direct status=none
nvme write-zeroes "$device" -n 1 -s $((13000 * 8)) -c $((32 * 8 - 1))
expect_zeroes "$device" 13000 32

step "ext4: mkfs, files, checksums across unmount and remount"
ext4_files "$device" 15

step "disconnect and reconnect: the files are still there"
nvme disconnect -n "$nqn"
for _ in $(seq 50); do [ -b "$device" ] || break; sleep 0.1; done
nvme connect -t tcp -a "$host" -s "$port" -n "$nqn"
device="$(device_of "$nqn" 1)"
check_files "$device"

step "a namespace hot-added on the target shows up"
open_host_requests "$trigger"
ask_host add-namespace added
second="$(device_of "$nqn" 2)"
[ "$(blockdev --getsize64 "$second")" = $((32 << 20)) ]
fio --name=second --filename="$second" --direct=1 --ioengine=libaio --iodepth=8 \
  --rw=randwrite --bs=4k --size=8M --verify=crc32c --verify_fatal=1 | grep -E 'err='

nvme disconnect -n "$nqn"
step "done"
