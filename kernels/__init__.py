"""edgeprobe_kernels: compute kernels (numba CPU, NPU-semantics, OpenCL) each beside a numpy reference.

Depends only on numpy, numba and optionally pyopencl. Kernels arrive with the quantization issue.
"""
from __future__ import annotations

import os

__version__ = "0.1.0"


def _numba_cache_under_the_root() -> None:
    """numba's compiled kernels go under the edgeprobe cache (paths.cache_root()/numba), beside every other piece of
    edgeprobe's state, not into __pycache__ of wherever the package lies: emptying $EDGEPROBE_CACHE starts from
    nothing. A NUMBA_CACHE_DIR the user set is kept."""
    import sys

    from .paths import cache_root

    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    os.environ["NUMBA_CACHE_DIR"] = str(cache_root() / "numba")
    if "numba" in sys.modules:  # imported before us: its config has read the environment already
        sys.modules["numba"].config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]


_numba_cache_under_the_root()


def _prefer_tbb() -> str | None:
    """Make numba's parallel kernels use the TBB threading layer where the `tbb` wheel is installed (its libtbb
    loaded by path: the wheel puts it in the environment's lib/, outside the loader's search path). TBB steals work,
    so a parallel kernel finishes on the cores it actually gets; numba's OpenMP layer splits every loop statically
    and waits for each thread's share: beside busy processes on 2 cores, in-process SmolLM2 decode steps took
    0.5-1.6 s under OpenMP and 28-79 ms under TBB (issue 17). A layer the user (or the agent:
    device_agent/__main__.py) chose with NUMBA_THREADING_LAYER is kept; "tbb" there gets its library loaded.
    Returns the library loaded, or None."""
    if os.environ.get("NUMBA_THREADING_LAYER", "tbb") != "tbb":
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
