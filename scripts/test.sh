#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs the external clients the tests use (fio,
# qemu-img/qemu-io, the libnbd tools and Python bindings, losetup), then checks formatting, runs clippy with warnings
# as errors, and runs every test (unit, property, process and tidy tests).
set -euo pipefail
cd "$(dirname "$0")/.."

# tool -> Debian package
declare -A packages=(
  [fio]=fio
  [qemu-img]=qemu-utils
  [qemu-io]=qemu-utils
  [nbdinfo]=libnbd-bin
  [nbdcopy]=libnbd-bin
  [losetup]=mount
)
missing=()
for tool in "${!packages[@]}"; do
  command -v "$tool" >/dev/null || missing+=("${packages[$tool]}")
done
# Debian's Python bindings of libnbd (a client that can leave block sizes unasked).
[ -e /usr/lib/python3/dist-packages/nbd.py ] || missing+=(python3-libnbd)
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "test.sh: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends $(printf '%s\n' "${missing[@]}" | sort -u) >/dev/null
fi

# The suite's scratch files (OSD devices, fio files) need about 1 GiB besides the build.
echo "test.sh: free space: $(df -h --output=avail . | tail -1 | tr -d ' ')" >&2
echo "test.sh: cargo fmt --check" >&2
cargo fmt --all -- --check
echo "test.sh: cargo clippy" >&2
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "test.sh: cargo test" >&2
cargo test --workspace --locked
