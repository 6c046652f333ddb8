#!/bin/bash
# The guest half of the cross-check in tests/nvme_guest.rs: the Linux kernel's NVMe/TCP
# target (nvmet-tcp) exports a 64 MiB RAM disk on the guest's port 4420, which the test
# forwards to the host; our initiator on the host drives it.
#
#   nvmet.sh NQN TRIGGER_PORT
#
# Once the target listens, the guest connects to TRIGGER_PORT on the host and waits for
# a line: the host sends it when its initiator is done.
set -euo pipefail
nqn="$1"
trigger="$2"

modprobe brd rd_nr=1 rd_size=65536
modprobe nvmet-tcp
cfs=/sys/kernel/config/nvmet
mkdir "$cfs/subsystems/$nqn"
echo 1 >"$cfs/subsystems/$nqn/attr_allow_any_host"
mkdir "$cfs/subsystems/$nqn/namespaces/1"
echo /dev/ram0 >"$cfs/subsystems/$nqn/namespaces/1/device_path"
echo 1 >"$cfs/subsystems/$nqn/namespaces/1/enable"
mkdir "$cfs/ports/1"
echo tcp >"$cfs/ports/1/addr_trtype"
echo ipv4 >"$cfs/ports/1/addr_adrfam"
echo 0.0.0.0 >"$cfs/ports/1/addr_traddr"
echo 4420 >"$cfs/ports/1/addr_trsvcid"
ln -s "$cfs/subsystems/$nqn" "$cfs/ports/1/subsystems/$nqn"
echo "nvmet: listening"

exec 3<>"/dev/tcp/10.0.2.2/$trigger"
echo ready >&3
read -r answer <&3
echo "nvmet: host says $answer"
[ "$answer" = done ]
