#!/bin/bash
# PID 1 of the guest (installed as /init in the initramfs by build.sh). Brings up what a
# test script expects of a small Linux machine, runs /basalt/script (added by run.sh)
# with the arguments in /basalt/args, reports its exit status and powers off.
#
# The status goes to the second serial port, which run.sh reads from a file: a marker on
# the console alone could be split by kernel messages printed in the middle of the line.
# It is printed on the console as well, for people reading the log.
#
# Not `set -e`: whatever fails here, the guest must still report and power off, or
# run.sh would wait for its timeout.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TERM=dumb

mount -t devtmpfs devtmpfs /dev
# The initramfs has no /dev/console node, so the kernel started us without a console.
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
hostname basalt-guest
ln -sf /proc/self/fd /dev/fd

report() {
  echo "BASALT-GUEST-EXIT=$1"
  echo "BASALT-GUEST-EXIT=$1" >/dev/ttyS1
  sync
  # run.sh starts QEMU with -no-reboot, so a reboot ends QEMU; this needs no ACPI. When
  # the script may reboot the guest (BASALT_GUEST_REBOOT), QEMU reboots, so power off.
  if grep -qw basalt.reboot /proc/cmdline; then poweroff -f; else reboot -f; fi
  sleep 60
}

# nvmet is configured through configfs, which is a module here.
modprobe configfs && mount -t configfs configfs /sys/kernel/config

ip link set lo up
modprobe virtio_pci
modprobe virtio_net
for _ in $(seq 50); do
  [ -e /sys/class/net/eth0 ] && break
  sleep 0.1
done
# QEMU's user-mode network: the host's loopback is reachable at 10.0.2.2. A static
# address saves udhcpc's second or two under TCG.
if [ -e /sys/class/net/eth0 ]; then
  ip addr add 10.0.2.15/24 dev eth0
  ip link set eth0 up
  ip route add default via 10.0.2.2
else
  echo "init: no eth0; the guest has no network" >&2
fi

# `nvme gen-hostnqn` derives the NQN from the DMI product UUID, all zeros under QEMU;
# two guests, or a guest and the host, would then collide at the target.
uuid="$(cat /proc/sys/kernel/random/uuid)"
echo "nqn.2014-08.org.nvmexpress:uuid:$uuid" >/etc/nvme/hostnqn
echo "$uuid" >/etc/nvme/hostid

if [ ! -f /basalt/script ]; then
  echo "init: no /basalt/script in the initramfs (start the guest with run.sh)" >&2
  report 126
fi
args=()
[ -f /basalt/args ] && eval "args=($(cat /basalt/args))"
chmod +x /basalt/script
cd /tmp || true
echo "init: running the script after $(cut -d' ' -f1 /proc/uptime) s of uptime"
# run.sh's boot watchdog waits for this.
echo "BASALT-GUEST-BOOTED" >/dev/ttyS1
# A script with a #! line picks its interpreter; one without runs under bash.
if [ "$(head -c2 /basalt/script)" = "#!" ]; then
  /basalt/script "${args[@]}" </dev/null
else
  bash /basalt/script "${args[@]}" </dev/null
fi
report $?
