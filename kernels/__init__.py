"""edgeprobe_kernels: compute kernels (numba CPU, NPU-semantics, OpenCL) each beside a numpy reference.

Depends only on numpy, numba and optionally pyopencl. Kernels arrive with the quantization issue.
"""
from __future__ import annotations

import os

__version__ = "0.1.0"


def _prefer_tbb() -> str | None:
    """Make numba's parallel kernels use the TBB threading layer where the `tbb` wheel is installed (its libtbb
    loaded by path: the wheel puts it in the environment's lib/, outside the loader's search path). TBB steals work,
    so a parallel kernel finishes on the cores it actually gets; numba's OpenMP layer splits every loop statically
    and waits for each thread's share: with a CPU-bound process beside it on one of 2 cores, a SmolLM2 decode step
    took ~950 ms under OpenMP and ~30 ms under TBB (measured, in-process, issue 17). A layer the user chose
    (NUMBA_THREADING_LAYER) is kept. Returns the library loaded, or None."""
    if os.environ.get("NUMBA_THREADING_LAYER"):
        return None
    try:
        import ctypes
        import importlib.metadata

        import numba

        files = importlib.metadata.files("tbb") or []
        lib = next((f.locate() for f in files if f.name == "libtbb.so.12"), None)
        if lib is None or not os.path.exists(lib):
            return None
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)  # numba's tbbpool extension links libtbb.so.12 by name
        numba.config.THREADING_LAYER = "tbb"
        return os.path.normpath(str(lib))
    except (ImportError, OSError, importlib.metadata.PackageNotFoundError):
        return None


TBB = _prefer_tbb()
