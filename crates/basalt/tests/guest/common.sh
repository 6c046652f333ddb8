# shellcheck shell=bash
# Functions the guest scripts of the tests share; scripts/guest/run.sh puts this
# file beside the script as /basalt/common.sh.

# The block device of namespace NSID of subsystem NQN, once it exists (no udev here).
device_of() {
  local want_nqn="$1" nsid="$2" dir ns
  for _ in $(seq 100); do
    # With native multipath, the namespace's node hangs off the subsystem.
    for dir in /sys/class/nvme-subsystem/nvme-subsys* /sys/class/nvme/nvme*; do
      [ "$(cat "$dir/subsysnqn" 2>/dev/null)" = "$want_nqn" ] || continue
      for ns in "$dir"/nvme*n"$nsid"; do
        case "${ns##*/}" in *c*n*) continue ;; esac
        if [ -e "$ns" ] && [ -b "/dev/${ns##*/}" ]; then
          echo "/dev/${ns##*/}"
          return 0
        fi
      done
    done
    sleep 0.1
  done
  echo "guest: no block device for namespace $nsid of $want_nqn" >&2
  nvme list >&2 || true
  return 1
}

# Reads COUNT 4 KiB blocks at 4 KiB block OFFSET of DEVICE and fails unless all are zero.
expect_zeroes() {
  local device="$1" offset="$2" count="$3"
  if ! dd if="$device" bs=4096 skip="$offset" count="$count" iflag=direct status=none |
    cmp -s - <(head -c $((count * 4096)) /dev/zero); then
    echo "guest: blocks $offset+$count of $device are not zeroes" >&2
    return 1
  fi
}

# Writes three files of random data (TENTHS, twice and three times TENTHS tenths of a
# MiB) to the ext4 filesystem mounted at /mnt and their checksums to /tmp/sums; then frees
# 4 MiB and trims the free space (fstrim: the kernel merges free extents into discards of
# several ranges).
write_files_and_trim() {
  local tenths="$1" i
  for i in 1 2 3; do
    head -c $((i * tenths * 1048576 / 10)) /dev/urandom >"/mnt/file$i"
  done
  (cd /mnt && sha256sum file1 file2 file3) >/tmp/sums
  head -c $((4 << 20)) /dev/urandom >/mnt/scratch
  rm /mnt/scratch
  sync
  fstrim -v /mnt
}
