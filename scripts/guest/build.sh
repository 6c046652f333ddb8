#!/usr/bin/env bash
# Builds the Linux guest that run.sh boots: a Debian 12 kernel and an initramfs holding
# busybox, bash, kmod, nvme-cli, fio, e2fsprogs, util-linux (blkdiscard -z) and nbd-client
# with their shared libraries
# and the kernel modules the tests need. Everything comes from Debian's archive as .debs
# downloaded at run time into $BASALT_GUEST_DIR (default /var/tmp/basalt-guest), never into
# the repository. Warm runs return at once; `rm -rf $BASALT_GUEST_DIR` starts over (that is
# also how to pick up a newer kernel or package versions).
#
# Results: $BASALT_GUEST_DIR/vmlinuz (and vmlinux, the same kernel uncompressed),
# initramfs.cpio.lz4, the unpacked guest root in root/ for inspection, and guest.env with
# the paths run.sh uses (QEMU, firmware, kernel, initramfs). Prints nothing on a warm
# cache unless -v is given.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
dir="${BASALT_GUEST_DIR:-/var/tmp/basalt-guest}"
verbose=0
[ "${1:-}" = "-v" ] && verbose=1

# Packages whose programs the guest runs. Their library dependencies are added by
# resolve_closure below; add a package here and its libraries follow.
guest_packages=(busybox-static bash kmod nvme-cli fio e2fsprogs util-linux nbd-client)

# Modules copied into the initramfs, with their dependencies (modprobe resolves those).
# The full module tree is ~400 MB; the initramfs carries only this subset.
guest_modules=(
  nvme nvme-core nvme-fabrics nvme-tcp nvmet nvmet-tcp
  virtio_pci virtio_net virtio_blk virtio_scsi virtio_console virtio_rng
  nbd loop null_blk brd sd_mod
  ext4 configfs 9p 9pnet_virtio
  crc32c_generic crc32c-intel crc64_rocksoft_generic crct10dif_generic crct10dif-pclmul
)

log() { echo "guest/build.sh: $*" >&2; }

mkdir -p "$dir"
# Tests may call run.sh concurrently; the lock makes the first one build and the others
# wait for its result instead of racing on the same files.
exec 9>"$dir/build.lock"
flock 9

# The stamp covers everything that shapes the result, so editing build.sh or init.sh
# rebuilds, and nothing else does.
stamp="$(cat "$here/build.sh" "$here/init.sh" | sha256sum | cut -d' ' -f1)"
if [ -f "$dir/guest.env" ] && [ -f "$dir/initramfs.cpio.lz4" ] && [ "$(cat "$dir/stamp" 2>/dev/null)" = "$stamp" ]; then
  [ "$verbose" = 1 ] && log "up to date in $dir"
  exit 0
fi
started=$SECONDS

# Host tools: depmod/modprobe (kmod) to resolve the module subset, readelf (binutils) to
# check that every library the guest programs need is present, cpio to pack the result.
declare -A host_tools=([depmod]=kmod [modprobe]=kmod [cpio]=cpio [readelf]=binutils
  [dpkg-deb]=dpkg [flock]=util-linux [lz4]=lz4 [xz]=xz-utils)
missing=()
for tool in "${!host_tools[@]}"; do
  command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || [ -x "/sbin/$tool" ] ||
    missing+=("${host_tools[$tool]}")
done
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
if ((${#missing[@]})); then
  log "installing ${missing[*]}"
  $sudo apt-get update -qq
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
export PATH="$PATH:/usr/sbin:/sbin"

# apt-get download runs as user _apt, which cannot write into a root-owned cache;
# downloading as the caller avoids a warning per package and works without root.
apt_opts=(-qq -o APT::Sandbox::User="$(id -un)")

# Downloads packages into a folder unless a .deb of that name is already there, so warm
# caches do not touch the network.
download() {
  local target="$1"
  shift
  mkdir -p "$target"
  local wanted=()
  for package in "$@"; do
    compgen -G "$target/${package}_*.deb" >/dev/null || wanted+=("$package")
  done
  ((${#wanted[@]})) || return 0
  log "downloading ${#wanted[@]} packages into $target"
  (cd "$target" && apt-get download "${apt_opts[@]}" "${wanted[@]}")
}

# The guest's packages and every library package they depend on, transitively. Only
# packages named lib* (and zlib1g) are followed: the others (python3, debconf, perl) are
# there for maintainer scripts or tools the guest does not run. check_libraries proves
# afterwards that nothing needed was skipped.
resolve_closure() {
  declare -A seen=()
  local level=("$@") next package
  while ((${#level[@]})); do
    next=()
    for package in "${level[@]}"; do seen[$package]=1; done
    while read -r package; do
      [ -n "${seen[$package]:-}" ] && continue
      case "$package" in lib* | zlib1g) next+=("$package"); seen[$package]=1 ;; esac
    done < <(apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks \
      --no-replaces --no-enhances "${level[@]}" |
      sed -n 's/^ *|\{0,1\}\(Pre\)\{0,1\}Depends: \([^<][^ ]*\)$/\2/p' | sed 's/:any$//' | sort -u)
    level=("${next[@]}")
  done
  printf '%s\n' "${!seen[@]}" | sort
}

# Fails when a guest program or library needs a shared library that is not in the
# guest; the loader would otherwise fail at the first use, deep inside a test.
check_libraries() {
  local root="$1" file needed
  declare -A present=()
  while read -r file; do present[${file##*/}]=1; done < <(find "$root" \( -type f -o -type l \) -name '*.so*')
  local absent=()
  while read -r file; do
    while read -r needed; do
      [ -n "${present[$needed]:-}" ] || absent+=("$needed (for ${file#"$root"})")
    done < <(readelf -d "$file" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  done < <(find "$root" -path "$root/lib/modules" -prune -o -type f -perm -u+x -print -o -type f -name '*.so*' -print)
  if ((${#absent[@]})); then
    log "libraries missing from the guest:"
    printf '  %s\n' "${absent[@]}" | sort -u >&2
    exit 1
  fi
}

# --- QEMU -----------------------------------------------------------------------------
# A qemu-system-x86_64 already on the host is used as it is. Otherwise QEMU is unpacked
# into the cache instead of installed: Debian 12's qemu-system-x86 breaks newer
# qemu-utils (a backport is installed on our CI machines, and the tests use its qemu-io),
# so `apt-get install` would remove it. `apt-get install --download-only` fetches exactly
# the packages the host lacks; the libraries it already has are used from the host.
qemu_root="$dir/qemu"
if command -v qemu-system-x86_64 >/dev/null; then
  qemu="$(command -v qemu-system-x86_64)"
  qemu_env=()
else
  qemu="$qemu_root/usr/bin/qemu-system-x86_64"
  if [ ! -x "$qemu" ]; then
    mkdir -p "$dir/debs/qemu/partial"
    log "downloading QEMU into $dir/debs/qemu"
    # NoLocking: only the dpkg lock is at stake, which a download does not need, and
    # taking it would need root.
    apt-get install --download-only -y --no-install-recommends "${apt_opts[@]}" \
      -o Debug::NoLocking=1 -o Dir::Cache::archives="$dir/debs/qemu" \
      qemu-system-x86 qemu-system-data >/dev/null
    rm -rf "$qemu_root.tmp"
    for deb in "$dir"/debs/qemu/*.deb; do dpkg-deb -x "$deb" "$qemu_root.tmp"; done
    rm -rf "$qemu_root"
    mv "$qemu_root.tmp" "$qemu_root"
  fi
  # Debian builds the TCG accelerator as a loadable module, looked for under /usr/lib
  # unless QEMU_MODULE_DIR says otherwise.
  qemu_lib="$qemu_root/usr/lib/x86_64-linux-gnu"
  qemu_env=("LD_LIBRARY_PATH=$qemu_lib" "QEMU_MODULE_DIR=$qemu_lib/qemu")
  if env "${qemu_env[@]}" ldd "$qemu" | grep 'not found' >/dev/null; then
    env "${qemu_env[@]}" ldd "$qemu" | grep 'not found' >&2
    log "the unpacked QEMU lacks libraries; remove $qemu_root and $dir/debs/qemu and rerun"
    exit 1
  fi
fi
# qboot boots a -kernel in milliseconds where SeaBIOS takes seconds under TCG.
bios=""
for candidate in /usr/share/qemu/qboot.rom "$qemu_root/usr/share/qemu/qboot.rom"; do
  [ -f "$candidate" ] && bios="$candidate" && break
done
if [ -z "$bios" ]; then
  download "$dir/debs/firmware" qemu-system-data
  rm -rf "$dir/firmware"
  dpkg-deb -x "$(ls "$dir"/debs/firmware/qemu-system-data_*.deb | head -1)" "$dir/firmware"
  bios="$dir/firmware/usr/share/qemu/qboot.rom"
fi

# --- kernel ---------------------------------------------------------------------------
# linux-image-amd64 only points at the versioned package that holds the kernel.
kernel_package="$(ls "$dir"/debs/kernel/linux-image-6*.deb 2>/dev/null | head -1 || true)"
if [ -z "$kernel_package" ]; then
  versioned="$(apt-cache depends linux-image-amd64 | sed -n 's/^ *Depends: \(linux-image-[0-9].*\)$/\1/p' | head -1)"
  [ -n "$versioned" ] || { log "cannot resolve linux-image-amd64"; exit 1; }
  download "$dir/debs/kernel" "$versioned"
  kernel_package="$(ls "$dir"/debs/kernel/linux-image-6*.deb | head -1)"
fi
# Unpacked for each build and removed after it: 400 MB of modules, of which the guest
# takes 3 MB.
kernel_root="$dir/kernel"
rm -rf "$kernel_root"
dpkg-deb -x "$kernel_package" "$kernel_root"
kernel_version="$(ls "$kernel_root/lib/modules" | head -1)"
# The package ships no modules.dep (its postinst runs depmod on the installed system).
depmod -b "$kernel_root" "$kernel_version"

# --- guest root -----------------------------------------------------------------------
mapfile -t closure < <(resolve_closure "${guest_packages[@]}")
download "$dir/debs/guest" "${closure[@]}"

root="$dir/root.tmp"
rm -rf "$root"
mkdir -p "$root"
for package in "${closure[@]}"; do
  deb="$(ls "$dir/debs/guest/${package}_"*.deb | head -1)"
  dpkg-deb -x "$deb" "$root"
done
# Unused by the guest, and every megabyte costs boot time (unpacking the initramfs is
# the slowest step of the boot under TCG): documentation, locales, and glibc's charset
# converters (8 MB; UTF-8 and ASCII are built into libc).
rm -rf "$root"/usr/share/{doc,man,info,locale,lintian,bash-completion,zsh,gdb} \
  "$root"/usr/lib/x86_64-linux-gnu/gconv "$root"/etc/init.d "$root"/lib/systemd

# Busybox fills in every command that no Debian package provided (sh, ip, nc, wget, mount,
# dmesg ...), so the real programs win where both exist.
while read -r applet; do
  name="${applet##*/}"
  exists=0
  for bin in bin sbin usr/bin usr/sbin; do
    [ -e "$root/$bin/$name" ] || [ -L "$root/$bin/$name" ] && exists=1
  done
  [ "$exists" = 1 ] && continue
  mkdir -p "$root/$(dirname "$applet")"
  ln -s /bin/busybox "$root/$applet"
done < <("$root/bin/busybox" --list-full)

modules="$root/lib/modules/$kernel_version"
mkdir -p "$modules"
while read -r _ path _; do
  relative="${path#"$kernel_root/lib/modules/$kernel_version/"}"
  mkdir -p "$modules/$(dirname "$relative")"
  cp "$path" "$modules/$relative"
done < <(for module in "${guest_modules[@]}"; do
  modprobe -d "$kernel_root" -S "$kernel_version" --show-depends "$module"
done | grep '^insmod ' | sort -u)
cp "$kernel_root/lib/modules/$kernel_version"/modules.{order,builtin,builtin.modinfo} "$modules/"
depmod -b "$root" "$kernel_version"

mkdir -p "$root"/{proc,sys,dev,tmp,run,mnt,root,etc/nvme,var/tmp}
ln -sf /proc/self/mounts "$root/etc/mtab"
echo 'root:x:0:0:root:/root:/bin/bash' >"$root/etc/passwd"
echo 'root:x:0:' >"$root/etc/group"
install -m 755 "$here/init.sh" "$root/init"
check_libraries "$root"

# --- results --------------------------------------------------------------------------
# Written under temporary names and renamed, so a run.sh reading the previous build is
# never handed a half-written file.
#
# LZ4 (the legacy frame format, the only one the kernel unpacks) rather than gzip or zstd:
# under TCG the guest unpacks this 100 MB archive in about 1.5 s instead of 3.5 s.
(cd "$root" && find . -print0 | LC_ALL=C sort -z | cpio -o -0 -H newc -R 0:0 --quiet) |
  lz4 -l -9 -q >"$dir/initramfs.cpio.lz4.tmp"
mv "$dir/initramfs.cpio.lz4.tmp" "$dir/initramfs.cpio.lz4"
cp "$kernel_root/boot/vmlinuz-$kernel_version" "$dir/vmlinuz.tmp"
mv "$dir/vmlinuz.tmp" "$dir/vmlinuz"
# vmlinuz decompresses itself (xz) before printing a line, 3 s under TCG. QEMU boots the
# uncompressed ELF inside it directly through its PVH entry point, skipping that; the
# xz stream starts at its magic number, and the Xen note 18 (PHYS32_ENTRY) marks a PVH
# entry point.
kernel="$dir/vmlinuz"
offset="$(LC_ALL=C grep -abo $'\xfd7zXZ\x00' "$dir/vmlinuz" | head -1 | cut -d: -f1 || true)"
# (xz reads from a process substitution: in a pipe, tail would die of SIGPIPE when xz
# stops at the end of the stream, and pipefail would call that a failure.)
if [ -n "$offset" ] &&
  xz -dc --single-stream >"$dir/vmlinux.tmp" 2>/dev/null < <(tail -c +"$((offset + 1))" "$dir/vmlinuz") &&
  readelf -n "$dir/vmlinux.tmp" 2>/dev/null | grep 'Xen.*(0x00000012)' >/dev/null; then
  mv "$dir/vmlinux.tmp" "$dir/vmlinux"
  kernel="$dir/vmlinux"
else
  rm -f "$dir/vmlinux.tmp" "$dir/vmlinux"
  log "no PVH kernel in vmlinuz; booting vmlinuz (3 s slower under TCG)"
fi
rm -rf "$dir/root" "$kernel_root"
# Kept to look into: it is exactly what the guest sees.
mv "$root" "$dir/root"
cat >"$dir/guest.env.tmp" <<EOF
qemu=$(printf '%q' "$qemu")
qemu_env=(${qemu_env[*]@Q})
qemu_data=$(printf '%q' "$( ((${#qemu_env[@]})) && echo "$qemu_root/usr/share/qemu")")
bios=$(printf '%q' "$bios")
kernel=$(printf '%q' "$kernel")
initramfs=$(printf '%q' "$dir/initramfs.cpio.lz4")
kernel_version=$(printf '%q' "$kernel_version")
EOF
mv "$dir/guest.env.tmp" "$dir/guest.env"
echo "$stamp" >"$dir/stamp"
log "built $kernel ($kernel_version) and $dir/initramfs.cpio.lz4 ($(du -h "$dir/initramfs.cpio.lz4" | cut -f1)) in $((SECONDS - started)) s"
