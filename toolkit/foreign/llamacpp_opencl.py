"""llama.cpp's OpenCL backend (Adreno GPUs) built with GGML_OPENCL_PROFILING: the `cl_profiling.csv` it writes when the
backend is freed (ggml-opencl.cpp, write_profiling_info), one row per kernel launch:

    op name, kernel name, exec duration (ms), global size, local size, output size
    Qcur-0,kernel_mul_mat_Ab_Bi_8x4,0.267008,1x1024x32,1x4x32,4096x2x1x1

The duration is the event's CL_PROFILING_COMMAND_END - START. The rows carry no start time (the cl_trace.json
written beside them does): kernels are laid end to end in file order, as the in-order queue ran them. The op name is
the ggml tensor the kernel computes (`Qcur-0`: layer 0); the ggml op type comes from the kernel's name, one op may
take several kernels (the Adreno matmul path transposes the activations first: `kernel_transpose_32_16`).
"""
from __future__ import annotations

import re

from .base import ForeignTraceError, event, read_text

FORMAT = "llamacpp-opencl-csv"
HEADER = "op name, kernel name, exec duration (ms), global size, local size, output size"
EXPECTED = f"llama.cpp OpenCL cl_profiling.csv ('{HEADER}', then one row per kernel)"
# kernel name prefix -> ggml op (kernel names of ggml-opencl.cpp); the first match wins, so longer prefixes first
_KINDS = (("kernel_rms_norm_mul", "RMS_NORM+MUL"), ("kernel_rms_norm", "RMS_NORM"), ("kernel_transpose", "TRANSPOSE"),
          ("kernel_mul_mat", "MUL_MAT"), ("kernel_mul_mv", "MUL_MAT"), ("kernel_mul_mm", "MUL_MAT"),
          ("kernel_gemv", "MUL_MAT"), ("kernel_gemm", "MUL_MAT"), ("mul_mm_", "MUL_MAT"), ("CL_mul_mat", "MUL_MAT"),
          ("kernel_flash_attn", "FLASH_ATTN_EXT"), ("kernel_rope", "ROPE"), ("kernel_swiglu", "SWIGLU"),
          ("kernel_geglu", "GEGLU"), ("kernel_soft_max", "SOFT_MAX"), ("kernel_add", "ADD"), ("kernel_mul", "MUL"),
          ("kernel_cpy", "CPY"), ("kernel_set_rows", "SET_ROWS"), ("kernel_get_rows", "GET_ROWS"),
          ("kernel_concat", "CONCAT"), ("kernel_scale", "SCALE"))
_DIMS = re.compile(r"\d+(x\d+)*")
# where a kernel's output keeps the token rows: ggml ne1 for row-wise ops, ne2 for ROPE ([head_dim, heads, tokens])
_ROWS_AT = {"MUL_MAT": 1, "RMS_NORM+MUL": 1, "RMS_NORM": 1, "SWIGLU": 1, "GEGLU": 1, "ADD": 1, "MUL": 1, "ROPE": 2}


def sniff(text: str) -> bool:
    return text.lstrip().startswith(HEADER)


def kind_of(kernel: str) -> str:
    """The ggml op a kernel computes, from its name; an unknown kernel keeps its own name."""
    return next((op for prefix, op in _KINDS if kernel.startswith(prefix)), kernel)


def _layer(name: str) -> int:
    m = re.search(r"-(\d+)$", name) or re.search(r"_l(\d+)\b", name)
    return int(m[1]) if m else -1


def read(path) -> tuple[list, dict]:
    """The CSV at `path` -> (events, meta) of a Trace: one gpu-lane event per kernel launch, µs = ms * 1000."""
    text = read_text(path, EXPECTED)
    lines = text.splitlines()
    first = next((n for n, l in enumerate(lines, 1) if l.strip()), None)
    if first is None or lines[first - 1].strip() != HEADER:
        got = lines[first - 1].strip()[:80] if first else "an empty file"
        raise ForeignTraceError(path, f"line {first or 1}", f"header {got!r}", EXPECTED)
    events, t = [], 0.0
    for n, line in enumerate(lines[first:], first + 1):
        if not line.strip():
            continue
        parts = line.rsplit(",", 5)  # the op name may hold a comma; the five fields after it cannot
        if len(parts) != 6:
            raise ForeignTraceError(path, f"line {n}", f"{len(parts)} of 6 fields (truncated?): {line[:80]!r}",
                                    EXPECTED)
        op, kernel, ms, gsize, lsize, osize = (p.strip() for p in parts)
        try:
            dur = float(ms) * 1e3
        except ValueError:
            dur = -1.0
        if dur < 0 or not all(_DIMS.fullmatch(s) for s in (gsize, lsize, osize)) or not kernel:
            raise ForeignTraceError(path, f"line {n}", f"not a kernel row: {line[:80]!r}", EXPECTED)
        kind = kind_of(kernel)
        shape = [int(v) for v in osize.split("x")]
        e = event(op, kind, "gpu", t, t + dur, _layer(op), line=n, kernel=kernel, output=op, shape=shape,
                  global_size=[int(v) for v in gsize.split("x")], local_size=[int(v) for v in lsize.split("x")])
        if kind in _ROWS_AT and len(shape) > _ROWS_AT[kind]:
            e["rows"] = shape[_ROWS_AT[kind]]
        events.append(e)
        t += dur
    if not events:
        raise ForeignTraceError(path, "whole file", "a header and no kernel row", EXPECTED)
    meta = {"source": {"tool": "llama.cpp ggml-opencl (GGML_OPENCL_PROFILING)", "format": FORMAT, "version": None},
            "title": f"{path}", "measured": True, "skipped_lines": 0,
            "time": {"unit": "exec duration (ms) = CL_PROFILING_COMMAND_END - START, times 1000 -> us",
                     "start": "kernels laid end to end in file order: the rows carry no start time"}}
    return events, meta
