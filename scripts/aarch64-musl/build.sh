#!/usr/bin/env bash
# A static aarch64-unknown-linux-musl `tandem` binary without any toolchain
# download (docs/mobile.md, "A static aarch64 binary"):
#
# * the musl standard library for aarch64 is not shipped by rustup here, nor
#   by Debian, PyPI or crates.io; it is built from source with cargo's
#   -Zbuild-std from Debian's `rust-web-src` (the library sources of Debian's
#   rustc-web, /usr/lib/rustlib/src/rust), with RUSTC_BOOTSTRAP=1 because
#   build-std is unstable on a stable compiler;
# * musl's C library, crt objects and headers for aarch64 come from Debian's
#   `musl-dev:arm64` and `musl:arm64`, downloaded and unpacked (never
#   installed: a multiarch arm64 libc on the host confuses qemu, see
#   .ci/aarch64-toolchain);
# * the link uses Debian's aarch64 glibc cross gcc as a driver with
#   -nostdlib and musl's crt1/crti/crtn + libc.a, gcc's crtbegin/crtend
#   (not crtbeginT: its frame registration jumps to 0 under musl) and
#   libgcc_eh for unwinding (as `-lunwind`); that libgcc_eh was built against
#   glibc >= 2.35 and calls _dl_find_object, which musl lacks:
#   dl_find_object.c here supplies it over dl_iterate_phdr.
#
# Usage: scripts/aarch64-musl/build.sh [cargo build args...]
#        (default: --release -p tandem). Output in
#        $CARGO_TARGET_DIR (default target-aarch64-musl)/aarch64-unknown-linux-musl/.
# Needs: .ci/aarch64-toolchain (gcc-aarch64-linux-gnu, qemu-user, rustc-web),
# plus rust-web-src (installed here if missing). Release build of `tandem`:
# tens of minutes on 2 cores.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
here="$root/scripts/aarch64-musl"
target=aarch64-unknown-linux-musl
export PATH="/usr/bin:$PATH"   # Debian's rustc/cargo (their sources are rust-web-src)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target-aarch64-musl}
work="$CARGO_TARGET_DIR/musl-sysroot"
mkdir -p "$work"

if ! dpkg -s rust-web-src >/dev/null 2>&1; then
  timeout 300 apt-get update -qq
  DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq rust-web-src
fi
musl="$work/x/usr/lib/aarch64-linux-musl"
if [ ! -f "$musl/libc.a" ]; then
  arches=(-o APT::Architectures::=amd64 -o APT::Architectures::=arm64)
  timeout 300 apt-get "${arches[@]}" update -qq
  (cd "$work" && chmod 755 . && timeout 300 apt-get "${arches[@]}" download musl-dev:arm64 musl:arm64)
  for d in "$work"/musl*_arm64.deb; do dpkg-deb -x "$d" "$work/x"; done
  timeout 300 apt-get update -qq   # back to this machine's own architecture
fi
gcclib=$(dirname "$(aarch64-linux-gnu-gcc -print-libgcc-file-name)")
inc=(-nostdinc -isystem "$work/x/usr/include/aarch64-linux-musl" -isystem "$(aarch64-linux-gnu-gcc -print-file-name=include)")
aarch64-linux-gnu-gcc -O2 -c "${inc[@]}" "$here/dl_find_object.c" -o "$work/dl_find_object.o"
mkdir -p "$work/lib"
ln -sf "$gcclib/libgcc_eh.a" "$work/lib/libunwind.a"
# The name must not end in "ld" (rustc would then speak ld's flags to it).
cat > "$work/aarch64-musl-cc" <<CC
#!/bin/sh
exec aarch64-linux-gnu-gcc -static -nostdlib -nostartfiles "$musl/crt1.o" "$musl/crti.o" "$gcclib/crtbegin.o" "\$@" "$work/dl_find_object.o" -L"$work/lib" -L"$musl" -Wl,--start-group -lc -lgcc -lgcc_eh -Wl,--end-group "$gcclib/crtend.o" "$musl/crtn.o"
CC
chmod +x "$work/aarch64-musl-cc"

export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_MUSL_LINKER="$work/aarch64-musl-cc"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_MUSL_RUSTFLAGS="-C link-self-contained=no -C target-feature=+crt-static"
# ring's C code, against musl's headers.
export CC_aarch64_unknown_linux_musl=aarch64-linux-gnu-gcc
export AR_aarch64_unknown_linux_musl=aarch64-linux-gnu-ar
export CFLAGS_aarch64_unknown_linux_musl="${inc[*]}"
cd "$root"
if [ $# -eq 0 ]; then set -- --release -p tandem; fi
cargo build -Zbuild-std=std,panic_unwind --target "$target" "$@"
