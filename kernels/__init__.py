"""edgeprobe_kernels: compute kernels (numba CPU, NPU-semantics, OpenCL) each beside a numpy reference.

Depends only on numpy, numba and optionally pyopencl. Kernels arrive with the quantization issue.
"""
__version__ = "0.1.0"
