"""The hvx backend's toolchain and build cache: kernels/hvx/*.c compiled by Debian's clang-15 for Hexagon v67 with
128-byte HVX into one freestanding program, cached under <edgeprobe cache>/hvx/ ($EDGEPROBE_HVX_CACHE) by the hash of
its sources, the compiler's version and the flags, so an agent builds it once per change. hvx_bridge runs it.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from .paths import cache_root

ISA = "hexagon-v67-hvx128"
SOURCE_DIR = Path(__file__).parent / "hvx"
CLANG, LLD, QEMU = "clang-15", "ld.lld-15", "qemu-hexagon"
CFLAGS = ["--target=hexagon-unknown-linux-musl", "-mv67", "-mhvx", "-mhvx-length=128b", "-O2", "-ffreestanding",
          "-nostdlib", "-static", "-fuse-ld=lld", "-Wall", "-Wextra", "-Werror"]
INSTALL_HINT = "apt-get install clang-15 lld-15 qemu-user (or run scripts/setup.sh)"


class HvxError(RuntimeError):
    """The Hexagon program refused a request, died, or could not be built."""


class HvxUnavailable(HvxError):
    """The toolchain (clang-15 for Hexagon, ld.lld-15, qemu-hexagon) is missing."""


def toolchain() -> dict:
    """Paths of the tools the hvx backend needs (None where missing)."""
    return {name: shutil.which(name) for name in (CLANG, LLD, QEMU)}


def unavailable_reason() -> str | None:
    """None when the hvx backend can run here, else what is missing and the command that installs it."""
    missing = [k for k, v in toolchain().items() if v is None]
    if missing:
        return f"the hvx backend needs {', '.join(missing)} (Hexagon clang, lld, qemu-user): {INSTALL_HINT}"
    return None


def available() -> bool:
    return unavailable_reason() is None


def sources(source_dir: Path | None = None) -> list[Path]:
    """The program's C sources and headers (source_dir: another copy of kernels/hvx/)."""
    return sorted(p for p in (source_dir or SOURCE_DIR).iterdir() if p.suffix in (".c", ".h"))


def cache_dir() -> Path:
    return Path(os.environ.get("EDGEPROBE_HVX_CACHE") or cache_root() / "hvx")


def build(out_dir: Path | None = None, source_dir: Path | None = None) -> Path:
    """Compile kernels/hvx/*.c (or source_dir's) into one static Hexagon program, cached by sources + compiler
    version + flags."""
    why = unavailable_reason()
    if why:
        raise HvxUnavailable(why)
    version = subprocess.run([CLANG, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256(version.encode() + " ".join(CFLAGS).encode())
    srcs = sources(source_dir)
    for p in srcs:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    target = (out_dir or cache_dir()) / f"edgeprobe-hvx-{h.hexdigest()[:16]}.elf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    r = subprocess.run([CLANG, *CFLAGS, *[str(p) for p in srcs if p.suffix == ".c"], "-o", str(tmp)],
                       capture_output=True, text=True)
    if r.returncode:
        tmp.unlink(missing_ok=True)
        raise HvxError(f"building the Hexagon program failed:\n{r.stderr[-3000:]}")
    os.replace(tmp, target)  # atomic: a concurrent build of the same hash leaves one good file
    return target
