"""Cost models: how long a subgraph takes on a lane. Every time from here is *modelled*, and says so.

A CostModel prices each op of a subgraph (graph.template's cost: kind and FLOPs — int8_linear, linear,
float_sparse, attention, elementwise) at a per-lane, per-kind rate, plus a fixed launch cost per subgraph and a
sync cost when a dependency crosses lanes.

Named cost models are built from the papers' published numbers (documented per model). Cost models measured on
an agent (HeteroLLM's "real" and "predicted" modes) live in measure.py and load here from their JSON files.
("Profile" is a corpus statistic, edgeprobe.profile; DeviceProfile, PROFILES and device_profile are the old
names of CostModel, COST_MODELS and cost_model, kept for code written against them.)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .graph import ScheduleError, Subgraph


@dataclass(frozen=True)
class CostModel:
    name: str
    rates: dict            # lane -> {op kind: GFLOP/s (GOP/s for int8)}
    launch_us: dict        # lane -> fixed cost per subgraph, µs
    sync_us: float = 0.0   # added when a subgraph waits for one on another lane
    op_us: dict = field(default_factory=dict)  # lane -> fixed cost per op (dispatch, allocation, event), µs
    source: str = ""
    modelled: bool = True
    notes: dict = field(default_factory=dict)

    def rate(self, lane: str, kind: str) -> float:
        r = self.rates.get(lane)
        if r is None:
            raise ScheduleError(f"cost model {self.name!r} has no lane {lane!r} (lanes: {', '.join(self.rates)})")
        rate = r.get(kind) or r.get("default")
        if rate is None:
            raise ScheduleError(f"cost model {self.name!r} cannot price {kind!r} on {lane}")
        return rate

    def op_time_us(self, op: dict, lane: str | None = None) -> float:
        """One template op (graph.template: cost [kind, FLOPs, bytes]) on a lane, launch cost excluded."""
        kind, flops, _ = op["cost"]
        lane = lane or op["lane"]
        return self.op_us.get(lane, 0.0) + flops / (self.rate(lane, kind) * 1e3)  # GFLOP/s -> FLOP/µs

    def time_us(self, g: Subgraph, lane: str | None = None) -> float:
        """A subgraph: its lane's launch cost plus each op's FLOPs at the lane's rate for the op's cost kind."""
        lane = lane or g.lane
        if lane not in self.rates:
            raise ScheduleError(f"cost model {self.name!r} has no lane {lane!r} (lanes: {', '.join(self.rates)})")
        t = self.launch_us.get(lane, 0.0) + self.op_us.get(lane, 0.0) * len(g.costs)
        for kind, flops in g.costs:
            t += flops / (self.rate(lane, kind) * 1e3)
        return t


# Snapdragon 8 Gen 3 (Xiaomi 14), modelled from mllm-NPU §3.4: "Qwen1.5-1.8B, prompt 256: NPU execution
# 315 ms, about twice the CPU's". The rates are chosen so that this cost model, on Qwen1.5-1.8B's chunk graph
# at prompt 256 / chunk 256, gives exactly that: NPU int8 linears 2.0 TOP/s effective (315 ms), CPU float
# work (attention, shadow outliers) 90 GFLOP/s effective (158 ms).
# GPU (Adreno 750) as a fixed FP16 rate, 1 TFLOP/s effective (HeteroLLM §2: GPU prefill throughput is a
# fraction of the NPU's). Sync: ~100 µs per cross-processor hand-off (HeteroLLM §4.2 measures syncs of tens
# to hundreds of µs).
SNAPDRAGON_8GEN3 = CostModel(
    name="snapdragon-8gen3",
    rates={"npu": {"int8_linear": 2000.0, "default": 2000.0},
           "cpu": {"attention": 90.0, "float_sparse": 40.0, "default": 90.0, "int8_linear": 60.0},
           "gpu": {"attention": 1000.0, "float_sparse": 200.0, "default": 1000.0, "int8_linear": 1000.0}},
    launch_us={"npu": 50.0, "cpu": 20.0, "gpu": 30.0},
    sync_us=100.0,
    source="modelled: calibrated to mllm-NPU §3.4 (Qwen1.5-1.8B, 256 tokens: NPU 315 ms, CPU about half) and "
           "HeteroLLM §2",
)

# This host's lanes as edgeprobe emulates them (2 cores): rates from bench/quant.py and bench/agent.py —
# exact int8 GEMM by K-blocked float32 BLAS on one thread ≈60–100 GOP/s (the emulated NPU), numpy float
# ≈100 GFLOP/s on one thread, OpenCL on PoCL ≈38 GFLOP/s. Elementwise ops (norms, SwiGLU, adds, RoPE; "FLOPs" =
# output elements) run at numpy's ≈0.3 G elements/s over their several passes, and every op pays ≈30 µs on its lane
# thread (seen in agent traces: a 64×1536 SwiGLU takes ~0.4 ms, not the 1.4 µs a GEMM rate gives; the shadow GEMMs at
# prune rate 0 are hundreds of such ops). For predictions that match the agent, measure.
THIS_HOST = CostModel(
    name="this-host-emulated",
    rates={"npu": {"int8_linear": 70.0, "elementwise": 0.3, "default": 70.0},
           "cpu": {"attention": 30.0, "float_sparse": 5.0, "elementwise": 0.3, "default": 30.0, "int8_linear": 70.0},
           "gpu": {"attention": 20.0, "float_sparse": 5.0, "elementwise": 0.3, "default": 38.0, "int8_linear": 38.0}},
    launch_us={"npu": 200.0, "cpu": 100.0, "gpu": 300.0},
    op_us={"npu": 30.0, "cpu": 30.0, "gpu": 60.0},
    sync_us=50.0,
    source="modelled from this machine's benchmarks (bench/quant.py, bench/agent.py)",
)

COST_MODELS = {m.name: m for m in (SNAPDRAGON_8GEN3, THIS_HOST)}


def cost_model(name):
    """A named modelled cost model, or a measured one from its JSON file. A cost model object passes through."""
    if not isinstance(name, str):
        return name
    if name.endswith(".json"):
        if _json_format(name) == "edgeprobe-fitted-cost-model":  # fitted from a phone's trace (edgeprobe.foreign)
            from ..foreign.fit import load_cost_model

            return load_cost_model(name)
        from .measure import MeasuredCostModel

        return MeasuredCostModel.from_json(name)
    if name in ("measured", "measured-real"):
        raise ScheduleError(f"cost model {name!r} is measured on an agent: use `edgeprobe schedule --cost-model "
                            f"{name}` (measures on a local agent and caches it), Device.measure_cost_model, or a saved "
                            ".json")
    if name not in COST_MODELS:
        raise ScheduleError(f"unknown cost model {name!r}; choose one of {', '.join(COST_MODELS)}, measured, "
                            "measured-real, or a measured cost model's .json file")
    return COST_MODELS[name]


def _json_format(path) -> str | None:
    """The "format" a cost model's JSON file declares (None: unreadable here, or a measured one, which has none)."""
    import json
    from pathlib import Path

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # MeasuredCostModel.from_json says what is wrong with it
    return doc.get("format") if isinstance(doc, dict) else None


# the old names (a device's speeds were once called its profile): notebooks and users' code import them
DeviceProfile = CostModel
PROFILES = COST_MODELS
device_profile = cost_model
