#!/bin/bash
# The guest half of two_targets_are_two_paths_to_an_image (tests/nvme_guest.rs): Linux's
# native NVMe multipath over two `basalt target` processes that export one Basalt image
# as the same namespace of the same subsystem (each with its own controller ids).
#
#   nvme_multipath.sh PORT_A PORT_B NQN TRIGGER_PORT
#
# On the connection to TRIGGER_PORT (at 10.0.2.2) the guest asks the host test to
# "kill-a": kill -9 the target behind PORT_A; the host answers "killed".
set -euo pipefail
port_a="$1"
port_b="$2"
nqn="$3"
trigger="$4"
script_name=nvme_multipath
# shellcheck source=common.sh
source /basalt/common.sh

modprobe nvme-tcp
open_host_requests "$trigger"

step "connect to both targets: one namespace, two paths"
nvme connect -t tcp -a "$host" -s "$port_a" -n "$nqn" --ctrl-loss-tmo=5 --reconnect-delay=1
nvme connect -t tcp -a "$host" -s "$port_b" -n "$nqn" --ctrl-loss-tmo=5 --reconnect-delay=1
device="$(device_of "$nqn" 1)"
nvme list-subsys
# A path device (nvmeXcYnZ, hidden) per controller, one block device for the namespace.
paths="$(ls -d /sys/class/nvme/nvme*/nvme*c*n1 | wc -l)"
[ "$paths" = 2 ] || fail "namespace 1 has $paths paths, not 2"
heads="$(ls /dev | grep -c '^nvme[0-9]*n1$' || true)"
[ "$heads" = 1 ] || fail "$heads block devices for namespace 1, not 1: $(ls /dev | grep nvme)"
# Both paths carry I/O, so that the kill below catches commands under way on its path.
for policy in /sys/class/nvme-subsystem/nvme-subsys*/iopolicy; do
  echo round-robin >"$policy"
done
cat /sys/class/nvme-subsystem/nvme-subsys*/iopolicy

write=(--name=write --filename="$device" --direct=1 --ioengine=libaio --iodepth=16
  --rw=randwrite --bs=4k --size=48M --verify=crc32c --verify_fatal=1 --randseed=2468)
step "fio randwrite with crc32c verify while target A is killed"
fio_while_host kill-a killed "${write[@]}"

nvme disconnect -n "$nqn" || true
step "done"
