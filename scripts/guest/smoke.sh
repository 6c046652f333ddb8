#!/bin/bash
# Proves the guest can do what the tests will ask of it. Run on the host:
#
#   scripts/guest/smoke.sh
#
# It serves a random token over HTTP on the host's 127.0.0.1, then boots the guest with
# this same file as its script (the `--guest` half below) and a scratch virtio-blk disk.
# In the guest it checks the tools, fetches the token through 10.0.2.2, formats and
# mounts the virtio-blk disk, and runs fio with verification through the kernel's
# NVMe/TCP initiator against a kernel target (nvmet) inside the guest. When qemu-nbd is
# on the host (package qemu-utils) it also exports a scratch image from the host and
# runs fio through the guest kernel's NBD client against it: the shape of a test of a
# server of ours. Exits 0 when every check passed.
set -euo pipefail

if [ "${1:-}" != "--guest" ]; then
  here="$(cd "$(dirname "$0")" && pwd)"
  work="$(mktemp -d "${TMPDIR:-/tmp}/basalt-guest-smoke.XXXXXX")"
  server_pid=""
  nbd_pid=""
  trap 'kill $server_pid $nbd_pid 2>/dev/null; rm -rf "$work"' EXIT
  mkdir "$work/www"
  token="$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  echo "$token" >"$work/www/token"
  # Port 0 lets the kernel pick a free port, so parallel runs do not collide; the server
  # writes it to a file once it listens.
  python3 - "$work" <<'EOF' &
import http.server, os, socket, sys
work = sys.argv[1]
class Handler(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, directory=os.path.join(work, "www"), **kwargs)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
# A second free port for qemu-nbd, which cannot report one it picked itself (another
# process could take it before qemu-nbd does; unlikely enough for a smoke test).
probe = socket.socket()
probe.bind(("127.0.0.1", 0))
nbd_port = probe.getsockname()[1]
probe.close()
with open(os.path.join(work, "port.tmp"), "w") as f:
    f.write("%d %d\n" % (server.server_address[1], nbd_port))
os.rename(os.path.join(work, "port.tmp"), os.path.join(work, "port"))
server.serve_forever()
EOF
  server_pid=$!
  for _ in $(seq 100); do
    [ -f "$work/port" ] && break
    sleep 0.05
  done
  read -r port nbd_port <"$work/port"
  truncate -s 64M "$work/disk.raw"
  if command -v qemu-nbd >/dev/null; then
    truncate -s 64M "$work/nbd.raw"
    qemu-nbd -f raw -b 127.0.0.1 -p "$nbd_port" -x smoke -t "$work/nbd.raw" &
    nbd_pid=$!
  else
    echo "smoke.sh: no qemu-nbd on the host; skipping the NBD check" >&2
    nbd_port=0
  fi
  status=0
  "$here/run.sh" "$0" --guest "$port" "$token" "$nbd_port" -- \
    -drive "file=$work/disk.raw,if=virtio,format=raw,cache=unsafe" || status=$?
  exit "$status"
fi

# --- inside the guest -----------------------------------------------------------------
port="$2"
token="$3"
nbd_port="$4"
step() { echo "smoke: $*"; }

step "kernel $(uname -r), $(nproc) CPUs"
nvme version
fio --version
mkfs.ext4 -V

step "modules"
modprobe nvme-tcp
modprobe virtio_blk
lsmod | grep -E '^(nvme_tcp|nvme_fabrics|nvme_core|virtio_blk|virtio_net) '

step "network: fetching the token from the host at 10.0.2.2:$port"
ip -4 addr show dev eth0 | grep inet
# Not wget's -T: busybox 1.35's wget crashes with it; timeout(1) bounds the wait instead.
fetched="$(timeout 20 wget -q -O - "http://10.0.2.2:$port/token")"
[ "$fetched" = "$token" ] || { echo "smoke: fetched '$fetched', expected '$token'"; exit 1; }
# A raw TCP connection, as a test talking its own protocol would open (busybox nc has no -z).
timeout 10 bash -c "exec 3<>/dev/tcp/10.0.2.2/$port"

step "virtio-blk: ext4 on /dev/vda"
for _ in $(seq 50); do [ -b /dev/vda ] && break; sleep 0.1; done
mkfs.ext4 -q -F /dev/vda
mount -t ext4 /dev/vda /mnt
fio --name=ext4 --directory=/mnt --size=8M --bs=64k --rw=write --verify=crc32c --ioengine=psync >/dev/null
umount /mnt
fsck.ext4 -n -f /dev/vda

step "nvme/tcp: the kernel initiator against nvmet in the guest"
modprobe brd rd_nr=1 rd_size=65536
modprobe nvmet-tcp
nqn=nqn.2014-08.io.basalt:smoke
cfs=/sys/kernel/config/nvmet
mkdir "$cfs/subsystems/$nqn"
echo 1 >"$cfs/subsystems/$nqn/attr_allow_any_host"
mkdir "$cfs/subsystems/$nqn/namespaces/1"
echo /dev/ram0 >"$cfs/subsystems/$nqn/namespaces/1/device_path"
echo 1 >"$cfs/subsystems/$nqn/namespaces/1/enable"
mkdir "$cfs/ports/1"
echo tcp >"$cfs/ports/1/addr_trtype"
echo ipv4 >"$cfs/ports/1/addr_adrfam"
echo 127.0.0.1 >"$cfs/ports/1/addr_traddr"
echo 4420 >"$cfs/ports/1/addr_trsvcid"
ln -s "$cfs/subsystems/$nqn" "$cfs/ports/1/subsystems/$nqn"
nvme discover -t tcp -a 127.0.0.1 -s 4420 | grep -E 'subnqn|trsvcid'
nvme connect -t tcp -a 127.0.0.1 -s 4420 -n "$nqn"
device=""
for _ in $(seq 50); do
  for ctrl in /sys/class/nvme/nvme*; do
    [ "$(cat "$ctrl/subsysnqn" 2>/dev/null)" = "$nqn" ] || continue
    for ns in "$ctrl"/nvme*n1 /sys/block/"${ctrl##*/}"n1; do
      [ -e "$ns" ] && device="/dev/${ns##*/}"
    done
  done
  [ -n "$device" ] && [ -b "$device" ] && break
  sleep 0.1
done
[ -b "$device" ] || { echo "smoke: no block device for $nqn"; nvme list; exit 1; }
nvme list
fio --name=nvme --filename="$device" --direct=1 --ioengine=libaio --iodepth=8 \
  --rw=randwrite --bs=4k --size=16M --verify=crc32c --verify_fatal=1 | grep -E 'IOPS|err='
nvme disconnect -n "$nqn"

if [ "$nbd_port" != 0 ]; then
  step "nbd: the kernel client against qemu-nbd on the host at 10.0.2.2:$nbd_port"
  modprobe nbd
  nbd-client 10.0.2.2 "$nbd_port" /dev/nbd0 -N smoke
  fio --name=nbd --filename=/dev/nbd0 --direct=1 --ioengine=libaio --iodepth=8 \
    --rw=randwrite --bs=4k --size=8M --verify=crc32c --verify_fatal=1 | grep -E 'IOPS|err='
  nbd-client -d /dev/nbd0
fi

step "all checks passed"
