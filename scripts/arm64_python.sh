#!/usr/bin/env bash
# Build (once) an emulated phone CPU: Debian bookworm's arm64 Python 3.11 with numpy, pyzmq and msgpack (no numba,
# as under Termux), unpacked into a folder and run with qemu-aarch64. No root filesystem, chroot or root needed:
# apt-get fetches the arm64 .debs into a private package list, dpkg -x unpacks them.
#
#   scripts/arm64_python.sh [DEST]     default DEST: $EDGEPROBE_ARM64, else <edgeprobe cache>/arm64 (as toolkit/arm64.py)
#
# DEST/bin/python3 is the interpreter (a wrapper that execs qemu-aarch64 -L DEST/root ...): Device.local(arch="arm64")
# starts the agent with it, and Device.ssh(python=DEST/bin/python3) deploys to it as to a phone.
set -euo pipefail
DEST="${1:-${EDGEPROBE_ARM64:-${EDGEPROBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgeprobe}/arm64}}"
# what the agent needs on a phone, and OpenBLAS (Debian's default libblas3 is the slow reference BLAS)
WANT=(python3.11-minimal libpython3.11-stdlib python3-numpy python3-zmq python3-msgpack libopenblas0-pthread libopenblas0)
CHECK='import platform, numpy, zmq, msgpack, importlib.util as u
assert platform.machine() == "aarch64", platform.machine()
assert u.find_spec("numba") is None, "numba must be absent"
print("arm64 python", platform.python_version(), "numpy", numpy.__version__, "pyzmq", zmq.__version__, "msgpack",
      ".".join(map(str, msgpack.version)))'

command -v qemu-aarch64 >/dev/null || { echo "arm64: qemu-aarch64 is missing (Debian: apt-get install qemu-user)" >&2; exit 1; }
if [ -x "$DEST/bin/python3" ] && "$DEST/bin/python3" -c "$CHECK" >/dev/null 2>&1; then
  exit 0  # built before and still works
fi

t0=$(date +%s)
mkdir -p "$(dirname "$DEST")"
WORK="$(mktemp -d "$DEST.build.XXXXXX")"  # beside DEST, so the final mv is a rename
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/apt/lists/partial" "$WORK/apt/cache/archives/partial" "$WORK/debs" "$WORK/out/root" "$WORK/out/bin"
: > "$WORK/apt/status"  # an empty dpkg status: apt resolves the whole dependency closure for arm64
APT=(apt-get -q -oAPT::Architecture=arm64 -oAPT::Architectures=arm64 -oDir::State::Lists="$WORK/apt/lists"
     -oDir::State::status="$WORK/apt/status" -oDir::Cache="$WORK/apt/cache" -oDebug::NoLocking=1
     -oAPT::Sandbox::User="$(id -un)")  # our own folders: no _apt user needs to reach them
echo "arm64: fetching Debian's arm64 package lists"
"${APT[@]}" update >/dev/null
mapfile -t PKGS < <("${APT[@]}" -s install --no-install-recommends "${WANT[@]}" | awk '/^Inst /{print $2}')
[ ${#PKGS[@]} -gt 0 ] || { echo "arm64: apt resolved no packages for ${WANT[*]}" >&2; exit 1; }
echo "arm64: downloading ${#PKGS[@]} packages"
(cd "$WORK/debs" && "${APT[@]}" download "${PKGS[@]}" >/dev/null)
for deb in "$WORK"/debs/*.deb; do
  dpkg -x "$deb" "$WORK/out/root"
  dpkg-deb -f "$deb" Package Version | paste -sd' ' >> "$WORK/out/packages.txt"
done
# what Debian's update-alternatives would do: BLAS and LAPACK are OpenBLAS (pthreads)
lib="$WORK/out/root/usr/lib/aarch64-linux-gnu"
for so in libblas.so.3 liblapack.so.3 libopenblas.so.0; do
  ln -sf "openblas-pthread/$so" "$lib/$so"
done
cat > "$WORK/out/bin/python3" <<'EOF'
#!/bin/sh
# Debian arm64 Python 3.11 under qemu-aarch64 (built by scripts/arm64_python.sh); no user site: only the root's packages.
ROOT="$(dirname "$(dirname "$(readlink -f "$0")")")/root"
# EDGEPROBE_EMULATOR: the agent marks its cpu lane's events emulated "isa" (real arm64 results, emulation times)
EDGEPROBE_EMULATOR=qemu-aarch64 PYTHONNOUSERSITE=1 exec qemu-aarch64 -L "$ROOT" "$ROOT/usr/bin/python3.11" "$@"
EOF
chmod +x "$WORK/out/bin/python3"
"$WORK/out/bin/python3" -c "$CHECK"
rm -rf "$DEST"
mv "$WORK/out" "$DEST"
echo "arm64: built $DEST ($(du -sh "$DEST" | cut -f1), $(( $(date +%s) - t0 )) s)"
