"""Kernel backends per lane: which ones this agent can run, which one each lane uses.

    cpu   numba (numpy where numba is missing, as on a phone without it)
    npu   numba: NPU-semantics kernels on this CPU (numpy where numba is missing: same results);
          hvx: Hexagon v67 HVX machine code under qemu-hexagon
    gpu   opencl

A backend names a lane's code path; `lane_kernels` says what really computes on it: "numba", or "numpy" where numba
is missing (the kernels' numpy references: same results within each kernel's stated tolerance), "opencl", "hvx".
hello reports both, and every trace event carries its lane's kernels as "backend".
"""
from __future__ import annotations

BACKENDS = {"cpu": ("numba", "numpy"), "npu": ("numba", "hvx"), "gpu": ("opencl",)}


def numba_available() -> bool:
    """Is numba importable here? (Termux has no numba package; the kernels then run their numpy references.)"""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def opencl_devices() -> list[dict]:
    """The OpenCL devices pyopencl finds ([] without pyopencl or an ICD): the gpu lane's, hello's `opencl`."""
    try:
        import pyopencl as cl
    except ImportError:
        return []
    try:
        return [{"platform": p.name, "device": d.name, "fp16": "cl_khr_fp16" in d.extensions,
                 "compute_units": d.max_compute_units} for p in cl.get_platforms() for d in p.get_devices()]
    except Exception:  # no ICD installed: no GPU lane
        return []


def opencl_unavailable() -> str | None:
    """Why there is no gpu lane here (None when pyopencl finds a device), naming what to install or check."""
    try:
        import pyopencl as cl
    except ImportError:
        return "pyopencl is not installed (pip install pyopencl; Termux: pkg install ocl-icd opencl-headers first)"
    try:
        if any(p.get_devices() for p in cl.get_platforms()):
            return None
        err = ""
    except Exception as e:  # ocl-icd raises PLATFORM_NOT_FOUND_KHR when no .icd file names a driver
        err = f" ({type(e).__name__}: {str(e)[:120]})"
    return (f"pyopencl found no OpenCL device{err}: no ICD names a driver it can load (Debian: pocl-opencl-icd; on a "
            "phone under Termux the vendor's /vendor/lib64/libOpenCL.so must be named in $PREFIX/etc/OpenCL/vendors "
            "and be loadable from Termux; see README, On a real phone)")


def lane_kernels(lane: str, chosen: str | None) -> str | None:
    """What computes on `lane` under backend `chosen`: numba, numpy (numba missing) or opencl. The kernels pick numba
    whenever it imports; the hvx backend runs only NPU work as Hexagon code (those events say "hvx" themselves)."""
    if lane in ("cpu", "npu"):
        return "numba" if numba_available() else "numpy"
    return chosen


def _why_not(lane: str, name: str, opencl=None) -> str | None:
    """None when `name` can run here, else why not (with how to install it). opencl: the devices, if known."""
    if name == "numba" and lane == "npu":
        return None  # the NPU-semantics kernels fall back to numpy without numba
    if name == "numba":
        return None if numba_available() else "numba is not installed (pip install numba; Termux has no numba package)"
    if name == "numpy":
        return None
    if name == "hvx":
        from edgeprobe_kernels import hvx_bridge

        return hvx_bridge.unavailable_reason()
    if name == "opencl":
        if opencl is None:
            opencl = opencl_devices()
        return None if opencl else opencl_unavailable()
    return f"unknown backend {name!r}"


def check_backend(lane: str, name: str) -> str:
    """The backend name when the lane can use it here; ValueError naming what is missing otherwise."""
    if name not in BACKENDS.get(lane, ()):
        raise ValueError(f"the {lane} lane has backends {', '.join(BACKENDS.get(lane, ()))}, not {name!r}")
    why = _why_not(lane, name)
    if why:
        raise ValueError(f"--{lane}-backend {name} is unavailable: {why}")
    if name == "hvx":  # build and start the DSP now, so a broken toolchain shows at startup, not mid-run
        from edgeprobe_kernels import hvx_bridge

        hvx_bridge.shared().start()
    return name


def lane_backends(chosen: dict, lanes, opencl=None) -> dict:
    """hello's view: {lane: {"available": [...], "chosen": name, "kernels": what computes, "unavailable": {name: why}}}
    for the agent's lanes."""
    out = {}
    for lane in lanes:
        names = BACKENDS.get(lane, ())
        why = {n: _why_not(lane, n, opencl) for n in names}
        avail = [n for n in names if why[n] is None]
        default = chosen.get(lane) or (avail[0] if avail else None)
        out[lane] = {"available": avail, "chosen": default, "kernels": lane_kernels(lane, default),
                     "unavailable": {n: w for n, w in why.items() if w}}
        if lane == "npu":  # what the lane's events' time means (executor.EMULATED_LANES, the hvx backend's "isa")
            out[lane]["emulated"] = "isa" if default == "hvx" else "semantics"
            if default == "hvx":
                from edgeprobe_kernels.hvx_bridge import ISA

                out[lane]["isa"] = ISA
    return out
