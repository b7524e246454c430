"""The agent's ops, one module per job: `registry` (the table, OpError, FLOPs), `dense`, `linear`, `fused`.

Importing this package registers every op kind in `OPS`. The MoE and flash-FFN ops live beside it
(`experts.py`, `neurons.py`, which import `ops.registry`) and are loaded on their first call.
"""
from __future__ import annotations

from . import dense, fused, linear  # noqa: F401  (each registers its ops)
from .fused import check_fused
from .linear import runs_beside
from .registry import GATHERS_ROWS, OPS, OpError, RunnerCache, bytes_in, flops, op

__all__ = ["GATHERS_ROWS", "OPS", "OpError", "RunnerCache", "bytes_in", "check_fused", "flops", "op", "runs_beside"]


@op("ffn_flash")
def _ffn_flash(inp, attrs, ctx):
    from ..neurons import op_ffn_flash  # loaded on first use: neurons imports ops.registry

    return op_ffn_flash(inp, attrs, ctx)


@op("moe_ffn")
def _moe_ffn(inp, attrs, ctx):
    from ..experts import op_moe_ffn

    return op_moe_ffn(inp, attrs, ctx)
