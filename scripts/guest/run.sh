#!/usr/bin/env bash
# shellcheck disable=SC2154 # qemu, qemu_env, bios, kernel and initramfs come from guest.env
# Boots the Linux guest under QEMU, runs SCRIPT in it as root with ARGs, streams the guest
# console to stdout and exits with the script's exit status.
#
#   scripts/guest/run.sh SCRIPT [ARG...] [-- QEMU_ARG...]
#
# Exit status: the script's; 124 when the guest did not finish within
# $BASALT_GUEST_TIMEOUT seconds (default 300); 125 when the guest stopped without
# reporting a status (a kernel panic, QEMU failing to start). See README.md.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
dir="${BASALT_GUEST_DIR:-/var/tmp/basalt-guest}"
timeout_s="${BASALT_GUEST_TIMEOUT:-300}"
memory="${BASALT_GUEST_MEMORY:-1G}"
cpus="${BASALT_GUEST_CPUS:-2}"

if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  echo "usage: $0 SCRIPT [ARG...] [-- QEMU_ARG...]" >&2
  exit 2
fi
script="$1"
shift
script_args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  script_args+=("$1")
  shift
done
[ $# -gt 0 ] && shift
qemu_args=("$@")

# Quick when nothing changed; builds on first use so a test needs nothing but run.sh.
"$here/build.sh"
# Sets qemu, qemu_env (an array of VAR=value), qemu_data, bios, kernel and initramfs.
# shellcheck source=/dev/null
source "$dir/guest.env"

work="$(mktemp -d "${TMPDIR:-/tmp}/basalt-guest.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# The script travels as a small cpio of its own ahead of the prebuilt initramfs: the
# kernel unpacks concatenated archives into one root, so nothing large is rebuilt. Ahead,
# because the kernel reads an LZ4 archive to the end of the initrd.
mkdir -p "$work/cpio/basalt"
cp "$script" "$work/cpio/basalt/script"
# Functions the test scripts beside SCRIPT share, which they source as /basalt/common.sh.
common="$(dirname "$script")/common.sh"
[ -f "$common" ] && cp "$common" "$work/cpio/basalt/common.sh"
# Quoted for bash's eval in init.sh, which runs bash too, so any argument survives.
printf '%q ' ${script_args[@]+"${script_args[@]}"} >"$work/cpio/basalt/args"
(cd "$work/cpio" && find . | cpio -o -H newc -R 0:0 --quiet) | gzip -1 >"$work/script.cpio.gz"
cat "$work/script.cpio.gz" "$initramfs" >"$work/initrd"

# panic=-1 with -no-reboot turns a guest panic into QEMU exiting, not a hang.
append="console=ttyS0 panic=-1 quiet ${BASALT_GUEST_APPEND:-}"
# shellcheck disable=SC2054 # the commas are QEMU's
machine=(
  -accel tcg -machine pc -cpu max -smp "$cpus" -m "$memory"
  # Guest RAM in a shared memfd, so vhost-user devices (which map guest memory in another
  # process) work when a test adds one.
  -object "memory-backend-memfd,id=ram,size=$memory,share=on" -machine memory-backend=ram
  -bios "$bios" -kernel "$kernel" -initrd "$work/initrd"
  -nodefaults -no-user-config -display none
  -serial stdio -serial "file:$work/status"
  # romfile= skips the iPXE option ROM: nothing network-boots, and it saves a second.
  -netdev "user,id=net0${BASALT_GUEST_NETDEV:+,$BASALT_GUEST_NETDEV}" -device virtio-net-pci,netdev=net0,romfile=
)
[ -n "${qemu_data:-}" ] && machine+=(-L "$qemu_data")
# BASALT_GUEST_REBOOT=1 lets a script reboot the guest (it runs again on the next boot and
# must tell the boots apart; init.sh, told by basalt.reboot, then ends QEMU by powering off
# through ACPI); otherwise a reboot, like a panic, ends QEMU.
if [ -n "${BASALT_GUEST_REBOOT:-}" ]; then
  append="basalt.reboot $append"
else
  machine+=(-no-reboot)
fi
machine+=(-append "$append")

# stdin from /dev/null: QEMU would otherwise put a terminal into raw mode and forward
# keystrokes to the guest console. In the background so that a test harness stopping
# run.sh stops QEMU too, instead of leaving it running until the timeout.
#
# Boot watchdog: rarely, a guest under TCG never reaches init (no console output at all,
# both vCPUs busy, until the timeout). When init has not said so on the status port
# within $BASALT_GUEST_BOOT_TIMEOUT seconds (default 180; a boot takes about 4), QEMU is
# stopped and started again, up to $BASALT_GUEST_BOOT_TRIES times in all (default 2).
boot_timeout_s="${BASALT_GUEST_BOOT_TIMEOUT:-180}"
boot_tries="${BASALT_GUEST_BOOT_TRIES:-2}"
trap 'kill -TERM "$qemu_pid" 2>/dev/null' INT TERM HUP
for try in $(seq "$boot_tries"); do
  : >"$work/status"
  env ${qemu_env[@]+"${qemu_env[@]}"} timeout -k 10 "$timeout_s" "$qemu" "${machine[@]}" ${qemu_args[@]+"${qemu_args[@]}"} </dev/null &
  qemu_pid=$!
  booted=""
  for _ in $(seq "$boot_timeout_s"); do
    if grep -q BASALT-GUEST-BOOTED "$work/status" 2>/dev/null || ! kill -0 "$qemu_pid" 2>/dev/null; then
      booted=1
      break
    fi
    sleep 1
  done
  if [ -n "$booted" ] || [ "$try" -eq "$boot_tries" ]; then
    break
  fi
  echo "guest/run.sh: the guest did not reach init within $boot_timeout_s s; starting it again" >&2
  kill -TERM "$qemu_pid" 2>/dev/null
  wait "$qemu_pid" 2>/dev/null || true
done
qemu_status=0
wait "$qemu_pid" || qemu_status=$?
# A signal interrupts wait before QEMU is gone; wait for it so the status file is final.
while kill -0 "$qemu_pid" 2>/dev/null; do
  qemu_status=0
  wait "$qemu_pid" || qemu_status=$?
done

status="$(tr -d '\r' <"$work/status" 2>/dev/null | sed -n 's/^BASALT-GUEST-EXIT=\([0-9]*\)$/\1/p' | tail -1)"
if [ -n "$status" ]; then
  exit "$status"
fi
if [ "$qemu_status" -eq 124 ]; then
  echo "guest/run.sh: the guest did not finish within $timeout_s s (BASALT_GUEST_TIMEOUT)" >&2
  exit 124
fi
echo "guest/run.sh: the guest stopped without reporting a status (QEMU exited $qemu_status)" >&2
exit 125
