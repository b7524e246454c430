"""The emulated phone CPU: Debian's arm64 Python (numpy, pyzmq, msgpack, no numba) under qemu-aarch64.

`scripts/arm64_python.sh` builds it once (make test / make demo run it through scripts/setup.sh) into
`<cache>/arm64/`: `root/` (the unpacked arm64 packages) and `bin/python3` (a wrapper that execs
`qemu-aarch64 -L root root/usr/bin/python3.11`). `Device.local(arch="arm64")` starts the agent with that wrapper,
and `Device.ssh(..., python=str(arm64.python()))` deploys to it as to a phone. Results are real arm64 results;
times are emulation times (about 0.14 GFLOP/s for a float32 GEMM here), not a phone's.
"""
from __future__ import annotations

import os
import platform
import shutil
import tempfile
from pathlib import Path

from .errors import EdgeprobeError

ARCH_ALIASES = {"arm64": "arm64", "aarch64": "arm64"}
BUILD_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "arm64_python.sh"
AGENT_PACKAGES = {"edgeprobe_agent": "device_agent", "edgeprobe_kernels": "kernels"}  # import name -> repo folder


class Arm64Error(EdgeprobeError, RuntimeError):
    """The emulated arm64 Python is missing or unusable; the message says how to build it."""


def home() -> Path:
    """$EDGEPROBE_ARM64, else <edgeprobe cache>/arm64 (where scripts/arm64_python.sh builds by default)."""
    from .models import default_cache_dir

    return Path(os.environ.get("EDGEPROBE_ARM64") or default_cache_dir() / "arm64")


def python() -> Path:
    """The arm64 interpreter (a wrapper script running it under qemu-aarch64); Arm64Error when it is not built."""
    if shutil.which("qemu-aarch64") is None:
        raise Arm64Error("qemu-aarch64 is not installed (Debian: apt-get install qemu-user; make test installs it)")
    exe = home() / "bin" / "python3"
    if not os.access(exe, os.X_OK):
        raise Arm64Error(f"no arm64 Python at {exe}: build it with `make setup-arm64` in the edgeprobe checkout (or "
                         f"`bash {BUILD_SCRIPT}`; make demo and make test build it too, once: about 20 s and 140 MB)")
    return exe


def is_native(arch: str | None) -> bool:
    """Does `arch` name this machine's own architecture (or none at all)?"""
    if arch is None:
        return True
    here = platform.machine().lower()
    return ARCH_ALIASES.get(arch.lower(), arch.lower()) == ARCH_ALIASES.get(here, here)


def interpreter(arch: str | None) -> tuple[list, Path | None]:
    """(argv prefix, PYTHONPATH folder) that run the agent for `arch`: this Python for the host's own arch, the arm64
    wrapper with a fresh folder holding only the device's packages (remove it when done) for arm64."""
    import sys

    if is_native(arch):
        return [sys.executable], None
    if ARCH_ALIASES.get(arch.lower()) != "arm64":
        raise Arm64Error(f"arch {arch!r} cannot run here: use arm64 (qemu-aarch64) or this machine's "
                         f"{platform.machine()}")
    exe = python()
    return [str(exe)], agent_path()


def agent_path() -> Path:
    """A new folder that holds `edgeprobe_agent` and `edgeprobe_kernels` (links to this checkout's folders) and nothing
    else: the emulated device imports the agent from it, never the host toolkit."""
    repo = Path(__file__).resolve().parent.parent
    d = Path(tempfile.mkdtemp(prefix="edgeprobe-arm64-agent-"))
    for name, folder in AGENT_PACKAGES.items():
        (d / name).symlink_to(repo / folder, target_is_directory=True)
    return d
