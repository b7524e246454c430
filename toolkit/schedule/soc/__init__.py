"""Phone SoCs as rooflines, one data file per SoC (`<name>.json` beside this file), every number with its source.

A lane (cpu, gpu, npu) has a compute rate per dtype (int8, fp16, fp32 in GOP/s or GFLOP/s, and `vector` for
element-wise work in G elements/s), a memory bandwidth it reaches alone, a fixed cost per op (dispatch) and per
subgraph (launch); the NPU adds its stage shapes (rows padded to pre-built lengths, dimensions to its tiles) and the
cost of building a static graph. The SoC adds the bandwidth of lanes streaming together, flash reads, and the
cost of one cross-lane synchronisation. An op costs

    fixed + max(FLOPs at the padded shape / rate of its dtype, bytes it streams / bandwidth)

where the bytes are its weights in the scheme's stored format, its activations and, for attention, the KV cache
(`SocCostModel.op_cost`, which also says which term bound it). The numbers come from the papers' component
measurements and vendor specifications only — never from their end-to-end results, which test the model
(`toolkit/schedule/paper_results.json`, `bench/papers.py`).

A file: {"format": "edgeprobe-soc", "version": 1, "name", "soc", "phones", "lanes": {lane: {"compute": {dtype:
Q}, "bandwidth": Q, "op_us": Q, "launch_us": Q[, "stage_rows": Q, "tile": Q, "graph_build_ms": Q]}},
"together_bandwidth": Q, "flash_read": Q, "sync_us": Q} where every Q is {"value", "unit", "source"}.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from edgeprobe_kernels.linear_records import scheme_of

from ..costmodel import CostModel, fit_for, fitted_time_us
from ..graph import ScheduleError

FOLDER = Path(__file__).resolve().parent
FORMAT, VERSION = "edgeprobe-soc", 1
DTYPE_BYTES = {"int8": 1, "fp16": 2, "fp32": 4}
MATMUL_KINDS = ("int8_linear", "linear", "float_sparse", "attention")
KV_BYTES = 2  # the KV cache in FP16 on every lane (llama.cpp, mllm and QNN keep it so)
FIT_REACH = 2.0  # a trace's fit prices ops up to this factor beyond the FLOPs it was fitted on
# the template's elementwise ops read this many inputs of their output's size (one for the rest)
_TWO_INPUTS = ("add", "swiglu", "geglu", "sigmoid_mul")


@dataclass(frozen=True)
class Lane:
    """One processor of a SoC as a roofline: rates by dtype (G op/s; `vector` in G elements/s), bandwidth alone
    (GB/s), fixed costs (µs), and for an NPU its stage shapes."""

    rates: dict
    bandwidth_gbs: float
    op_us: float = 0.0
    launch_us: float = 0.0
    stage_rows: tuple = ()   # pre-built row counts an op's M is padded up to (the NPU's static graphs)
    tile: int = 1            # K and N padded to multiples of it (HMX: 32)
    graph_build_ms: float = 0.0
    act_dtype: str = "fp16"  # what activations are stored in on this lane

    def rate(self, dtype: str) -> float | None:
        """The rate of `dtype`; one the file does not list runs at the lane's widest float rate (fp16, else fp32):
        no paper measures a faster path for it."""
        return self.rates.get(dtype) or self.rates.get("fp16") or self.rates.get("fp32")

    def padded_rows(self, m: int) -> int:
        if not self.stage_rows:
            return m
        for r in self.stage_rows:
            if r >= m:
                return r
        top = self.stage_rows[-1]
        return -(-m // top) * top  # beyond the largest graph: several of it


@dataclass(frozen=True)
class OpCost:
    """One op's time on a lane and what bound it: compute (FLOPs at the padded shape over the rate), bandwidth
    (bytes over the bandwidth) or overhead (the fixed cost larger than both)."""

    us: float
    compute_us: float
    memory_us: float
    fixed_us: float
    flops: float
    nbytes: float

    @property
    def bound(self) -> str:
        top = max(self.compute_us, self.memory_us)
        if self.fixed_us >= top:
            return "overhead"
        return "compute" if self.compute_us >= self.memory_us else "bandwidth"


@dataclass(frozen=True)
class SocCostModel(CostModel):
    """A phone SoC's roofline (module doc). A CostModel: the schedulers price subgraphs with it; bound to a chunk
    graph (for_graph) it prices each template op with its real shape, dtype and bytes."""

    soc: str = ""
    lanes: dict = field(default_factory=dict)           # lane -> Lane
    together_gbs: float = 0.0
    flash_gbs: float = 0.0
    sync_conventional_us: float = 0.0  # a synchronisation without HeteroLLM's fast sync (sync_us is with it)
    sources: dict = field(default_factory=dict, compare=False)   # "lanes.npu.compute.int8" -> source text
    phones: tuple = ()
    fits: dict = field(default_factory=dict)  # lane -> kind -> a fit from a real trace (foreign.fit), priced first
    graph_ops: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- the roofline of one op ------------------------------------------------------------------
    def lane(self, lane: str) -> Lane:
        spec = self.lanes.get(lane)
        if spec is None:
            raise ScheduleError(f"SoC {self.name!r} has no lane {lane!r} (lanes: {', '.join(self.lanes)})")
        return spec

    def dtype_of(self, op: dict, lane: str) -> str:
        """What an op computes in on `lane`: int8 GEMMs in int8; W4A16 (q4) and float work in FP16 on the GPU and
        NPU (HeteroLLM and the TTS paper compute so); on the CPU float work in FP32 and 4-bit weights in int8 dot
        products, as llama.cpp runs them; element-wise work at the vector rate."""
        kind = op["cost"][0]
        if kind == "int8_linear":
            return "int8"
        if kind == "elementwise":
            return "vector"
        if lane == "cpu" and scheme_of((op.get("attrs") or {}).get("rec") or {}) in ("q4_0", "q4_0-tile", "moe-mixed"):
            return "int8"  # llama.cpp's CPU path: 4-bit codes dotted with int8-quantized activations (Q8_0)
        return "fp32" if lane == "cpu" else "fp16"

    def op_cost(self, op: dict, lane: str | None = None, kv_len: int | None = None, bandwidth_gbs: float | None = None,
                weight_bytes: float | None = None) -> OpCost:
        """One template op on a lane. kv_len: the keys an attention op reads (a decode step's context; default the
        op's own, from its FLOPs). bandwidth_gbs: what the lane gets while others stream too (default: alone).
        weight_bytes: the bytes of weights it really reads when not its cost's (an MoE layer's routed experts)."""
        lane = lane or op["lane"]
        spec = self.lane(lane)
        kind, flops, wbytes = op["cost"]
        if weight_bytes is not None:
            wbytes = weight_bytes
        rows, cols = op["shape"]
        dtype = self.dtype_of(op, lane)
        act = DTYPE_BYTES[spec.act_dtype]
        a = op.get("attrs", {})
        if kind == "attention":
            H, KV, d, b = a.get("n_heads", 1), a.get("n_kv_heads", 1), a.get("head_dim", cols), a.get("batch", 1)
            t = max(rows // max(b, 1), 1)
            keys = kv_len if kv_len is not None else max(int(round(flops / max(4 * b * H * t * d, 1))), 1)
            flops = 4 * b * H * t * keys * d
            nbytes = 2 * b * keys * KV * d * KV_BYTES + 2 * rows * cols * act
        fitted = self._fitted(op, lane, kind, flops, wbytes)
        if fitted is not None:
            return fitted
        if kind == "attention":
            padded = flops * self._pad(spec, t, keys, d) if spec.stage_rows else flops
        elif kind in MATMUL_KINDS:
            k_in = (a.get("rec") or {}).get("shape", [0, 0])[1] or (flops // max(2 * rows * cols, 1))
            nbytes = wbytes + rows * (k_in + cols) * act
            padded = flops * self._pad(spec, rows, cols, k_in) if spec.stage_rows else flops
        else:  # element-wise: FLOPs are output elements; reads its inputs, writes its output
            n_in = 2 if op["kind"] in _TWO_INPUTS else 1
            nbytes = wbytes + (n_in + 1) * rows * cols * act
            padded = flops
        rate = spec.rate(dtype)
        if not rate:
            raise ScheduleError(f"SoC {self.name!r} gives lane {lane} no {dtype} rate")
        bw = bandwidth_gbs or spec.bandwidth_gbs
        compute_us = padded / (rate * 1e3)   # G op/s -> op/µs
        memory_us = nbytes / (bw * 1e3)      # GB/s -> bytes/µs
        fixed = spec.op_us
        return OpCost(fixed + max(compute_us, memory_us), compute_us, memory_us, fixed, padded, nbytes)

    def _fitted(self, op: dict, lane: str, kind: str, flops: float, wbytes: float) -> OpCost | None:
        """The op priced by a real trace's fit of its lane and kind (fixed + per FLOP + per weight byte, the rows'
        regime), where this model carries one and the op's FLOPs lie within FIT_REACH of those it was fitted on: a
        fitted lane and kind replace the named SoC's there, the roofline prices the rest."""
        if not self.fits or lane not in self.fits:
            return None
        f = fit_for(self.fits[lane], kind)
        if f is None:
            return None
        seen = f.get("flops_range")
        if seen and not seen[0] / FIT_REACH <= flops <= seen[1] * FIT_REACH:
            return None  # a fit speaks for the sizes it saw; far outside them the roofline does
        us = fitted_time_us(f, flops, wbytes, op["shape"][0])
        g = f["below"] if "below" in f and op["shape"][0] < f["below"]["rows_lt"] else f
        return OpCost(us, g["us_per_flop"] * flops, g.get("us_per_byte", 0.0) * wbytes, g["fixed_us"], flops, wbytes)

    @staticmethod
    def _pad(spec: Lane, m: int, n: int, k: int) -> float:
        """FLOPs at the NPU's shapes over FLOPs at the op's: rows up to a pre-built length, N and K to tiles."""
        t = spec.tile
        up = lambda v: -(-int(v) // t) * t if v else 0
        return (spec.padded_rows(max(int(m), 1)) / max(m, 1)) * (up(n) / max(n, 1)) * (up(k) / max(k, 1))

    def split_cost(self, op: dict, lanes=("gpu", "npu"), kv_len: int | None = None) -> OpCost:
        """HeteroLLM's row cutting (§4.1): the op's output rows split between two lanes so both finish together,
        each computing at its padded shape, the weights streamed at the lanes' bandwidth together; plus one sync."""
        parts = [self.op_cost(op, l, kv_len, bandwidth_gbs=self.together_gbs) for l in lanes]
        compute = 1.0 / sum(1.0 / max(p.compute_us, 1e-12) for p in parts)   # both finish together
        memory = parts[0].nbytes / (self.together_gbs * 1e3)
        fixed = max(p.fixed_us for p in parts) + self.sync_us
        return OpCost(fixed + max(compute, memory), compute, memory, fixed, sum(p.flops for p in parts) / 2,
                      parts[0].nbytes)

    # ---- the CostModel interface: subgraphs for the schedulers ------------------------------------
    def rate(self, lane: str, kind: str) -> float:
        dtype = {"int8_linear": "int8", "elementwise": "vector"}.get(kind, "fp32" if lane == "cpu" else "fp16")
        return self.lane(lane).rate(dtype)

    def for_graph(self, graph) -> "SocCostModel":
        """This model pricing `graph`'s subgraphs op by op (their template ops: shapes, dtypes, bytes)."""
        return replace(self, graph_ops=graph.ops_of())

    def op_time_us(self, op: dict, lane: str | None = None) -> float:
        return self.op_cost(op, lane).us

    def time_us(self, g, lane: str | None = None) -> float:
        lane = lane or g.lane
        t = self.lane(lane).launch_us
        ops = self.graph_ops.get(g.name)
        if ops is not None:
            return t + sum(self.op_cost(o, lane).us for o in ops)
        spec = self.lane(lane)  # unbound: each (kind, FLOPs) at its rate, the subgraph's weights at the bandwidth
        compute = sum(fl / (self.rate(lane, k) * 1e3) for k, fl in g.costs)
        return t + spec.op_us * len(g.costs) + max(compute, g.weight_bytes / (spec.bandwidth_gbs * 1e3))

    def describe(self) -> list[tuple[str, str, str]]:
        """(parameter, value, source) rows: what the file says, for a table."""
        return [(k, v["text"], v["source"]) for k, v in self.sources.items()]


# ---- files ------------------------------------------------------------------------------------------
def available() -> list[str]:
    return sorted(p.stem for p in FOLDER.glob("*.json"))


def is_soc_file(path) -> bool:
    """Whether the JSON file at `path` declares this format (a SoC file, not another cost model's)."""
    try:
        return json.loads(Path(path).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _q(node, where: str, path: Path, sources: dict):
    """A {"value", "unit", "source"} leaf -> its value, its source recorded under `where`."""
    if not isinstance(node, dict) or "value" not in node or not str(node.get("source", "")).strip():
        raise ScheduleError(f"{path}: {where}: every number needs {{\"value\", \"unit\", \"source\"}}; got {node!r}")
    v = node["value"]
    sources[where] = {"text": f"{v} {node.get('unit', '')}".strip(), "source": node["source"]}
    return v


def load(name_or_path) -> SocCostModel:
    """A SoC by name (a file of this folder: snapdragon-8gen2, snapdragon-8gen3, snapdragon-8elite) or a path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = FOLDER / f"{name_or_path}.json"
    if not path.is_file():
        raise ScheduleError(f"unknown SoC {str(name_or_path)!r}; choose one of {', '.join(available())} or give a "
                            "SoC file's path")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ScheduleError(f"{path}: not a readable SoC file ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ScheduleError(f"{path}: not an {FORMAT} file of version {VERSION}")
    src: dict = {}
    lanes, rates, launch, op_us = {}, {}, {}, {}
    for lane, ld in doc["lanes"].items():
        r = {dt: float(_q(q, f"lanes.{lane}.compute.{dt}", path, src)) for dt, q in ld["compute"].items()}
        kw = {k: _q(ld[k], f"lanes.{lane}.{k}", path, src) for k in ("op_us", "launch_us", "stage_rows", "tile",
                                                                          "graph_build_ms") if k in ld}
        lanes[lane] = Lane(rates=r, bandwidth_gbs=float(_q(ld["bandwidth"], f"lanes.{lane}.bandwidth", path, src)),
                           op_us=float(kw.get("op_us", 0.0)), launch_us=float(kw.get("launch_us", 0.0)),
                           stage_rows=tuple(int(x) for x in kw.get("stage_rows", ())), tile=int(kw.get("tile", 1)),
                           graph_build_ms=float(kw.get("graph_build_ms", 0.0)),
                           act_dtype="fp32" if lane == "cpu" else "fp16")
        rates[lane] = {"int8_linear": r.get("int8", r.get("fp16")), "default": r.get("fp16", r.get("fp32"))}
        launch[lane], op_us[lane] = lanes[lane].launch_us, lanes[lane].op_us
    together = float(_q(doc["together_bandwidth"], "together_bandwidth", path, src))
    flash = float(_q(doc["flash_read"], "flash_read", path, src))
    sync = float(_q(doc["sync_us"], "sync_us", path, src))
    slow = float(_q(doc["sync_conventional_us"], "sync_conventional_us", path, src)) \
        if "sync_conventional_us" in doc else sync
    if not math.isfinite(together) or together <= 0:
        raise ScheduleError(f"{path}: together_bandwidth must be a positive GB/s")
    return SocCostModel(name=doc["name"], rates=rates, launch_us=launch, sync_us=sync, op_us=op_us,
                        source=f"{path.name}: a roofline from the papers' component measurements and vendor "
                               "specifications (every number's source in the file)",
                        modelled=True, soc=doc.get("soc", doc["name"]), lanes=lanes, together_gbs=together,
                        flash_gbs=flash, sync_conventional_us=slow, sources=src,
                        phones=tuple(doc.get("phones", ())))


__all__ = ["SocCostModel", "Lane", "OpCost", "load", "available", "FOLDER"]
