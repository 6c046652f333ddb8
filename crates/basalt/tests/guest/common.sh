# shellcheck shell=bash
# Functions the guest scripts of the tests share; scripts/guest/run.sh puts this
# file beside the script as /basalt/common.sh. A script sets `script_name` (its name in
# messages) before it sources this file.

# The host, as the guest reaches it (QEMU's user-mode networking).
host=10.0.2.2

step() { echo "${script_name:-guest}: $*"; }

fail() {
  echo "${script_name:-guest}: $*" >&2
  exit 1
}

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
  nvme list >&2 || true
  fail "no block device for namespace $nsid of $want_nqn"
}

# Reads COUNT 4 KiB blocks at 4 KiB block OFFSET of DEVICE and fails unless all are zero.
expect_zeroes() {
  local device="$1" offset="$2" count="$3"
  dd if="$device" bs=4096 skip="$offset" count="$count" iflag=direct status=none |
    cmp -s - <(head -c $((count * 4096)) /dev/zero) ||
    fail "blocks $offset+$count of $device are not zeroes"
}

# Writes three files of random data (TENTHS, twice and three times TENTHS tenths of a
# MiB) to the ext4 filesystem mounted at /mnt and their checksums to /tmp/sums; then frees
# 4 MiB and trims the free space (fstrim: a discard of each free extent).
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

# Opens the connection to the host test's requests, at PORT of the host, as fd 3.
open_host_requests() {
  exec 3<>"/dev/tcp/$host/$1"
}

# Asks the host test for WHAT on that connection and waits for ANSWER.
ask_host() {
  local what="$1" want="$2" answer
  echo "$what" >&3
  read -r answer <&3 || fail "the host did not answer '$what'"
  [ "$answer" = "$want" ] || fail "the host answered '$what' with '$answer'"
}

# Writes 3 MiB of random data at MiB AT of DEVICE, zeroes the middle MiB with
# `blkdiscard HOW` (HOW: -z for write zeroes, empty for a discard) and checks that it
# reads back as zeroes and that the MiBs around it did not change.
zero_a_mib() {
  local device="$1" at="$2" how="${3:-}"
  head -c $((3 << 20)) /dev/urandom >/tmp/random
  dd if=/tmp/random of="$device" bs=1M seek="$at" oflag=direct status=none
  # shellcheck disable=SC2086 # HOW is one option or none
  blkdiscard $how -o $(((at + 1) << 20)) -l $((1 << 20)) "$device"
  expect_zeroes "$device" $(((at + 1) * 256)) 256
  dd if="$device" bs=1M skip="$at" count=3 iflag=direct status=none >/tmp/read
  cmp -n $((1 << 20)) /tmp/random /tmp/read &&
    cmp /tmp/random /tmp/read $((2 << 20)) $((2 << 20)) ||
    fail "blkdiscard $how changed data beside its MiB"
}

# Runs fio's writes with ARGs (a crc32c-verified write job) in the background and asks
# the host for WHAT (answered ANSWER) 2 s in; fails unless fio was still writing when the
# answer came (so that what the host did happened under the writes), then ends them
# without an error, and they all verify.
fio_while_host() {
  local what="$1" want="$2" pid
  shift 2
  fio "$@" --do_verify=0 --output=/tmp/fio-out >/dev/null &
  pid=$!
  sleep 2
  kill -0 "$pid" 2>/dev/null || fail "fio's writes ended before '$what': nothing was tested"
  ask_host "$what" "$want"
  kill -0 "$pid" 2>/dev/null ||
    fail "fio's writes ended before the host's '$want': they may not have met it"
  wait "$pid" || {
    cat /tmp/fio-out >&2
    fail "fio failed across '$what'"
  }
  grep -E 'IOPS|err=|clat \(' /tmp/fio-out
  fio "$@" --verify_only | grep -E 'err='
}

# ext4 on DEVICE: mkfs, files written and trimmed as write_files_and_trim TENTHS does, and
# their checksums checked after a remount.
ext4_files() {
  local device="$1" tenths="$2"
  mkfs.ext4 -q -F "$device"
  mount -t ext4 "$device" /mnt
  write_files_and_trim "$tenths"
  umount /mnt
  check_files "$device"
}

# Mounts DEVICE, checks the files' checksums in /tmp/sums, unmounts it and checks the
# filesystem.
check_files() {
  local device="$1"
  mount -t ext4 "$device" /mnt
  (cd /mnt && sha256sum -c /tmp/sums)
  umount /mnt
  fsck.ext4 -n -f "$device" >/dev/null
}
