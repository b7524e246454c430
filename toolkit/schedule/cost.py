"""Cost models: how long a subgraph takes on a lane. Every time from here is *modelled*, and says so.

A CostModel prices each op of a subgraph (graph.template's cost: kind and FLOPs — int8_linear, linear,
float_sparse, attention, elementwise) at a per-lane, per-kind rate, plus a fixed launch cost per subgraph and a
sync cost when a dependency crosses lanes. The phones' named models (schedule.soc: snapdragon-8gen2, -8gen3,
-8elite) are rooflines that price each op by max(FLOPs / rate, bytes / bandwidth) plus its fixed costs, every number
from a paper's component measurement or a specification. Cost models measured on
an agent (HeteroLLM's "real" and "predicted" modes) live in measure.py and load here from their JSON files.
("Profile" is a corpus statistic, edgeprobe.profile; DeviceProfile, PROFILES and device_profile are the old
names of CostModel, COST_MODELS and cost_model, kept for code written against them.)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from .costmodel import _FALLBACK_KIND, CostModel, fit_for, fitted_time_us  # noqa: F401 - importable from here
from .graph import ScheduleError

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

# The phones: a roofline per SoC, every number sourced (schedule/soc/<name>.json). snapdragon-8gen3 is the name
# the FLOPs-only model of mllm-NPU §3.4's one sentence had: a contract, now this roofline.
from .soc import available as _socs  # noqa: E402 - soc's models derive from CostModel above
from .soc import load as _load_soc

SOC_MODELS = {n: _load_soc(n) for n in _socs()}
SNAPDRAGON_8GEN3 = SOC_MODELS["snapdragon-8gen3"]
COST_MODELS = {**SOC_MODELS, THIS_HOST.name: THIS_HOST}


def cost_model(name):
    """A named modelled cost model, or a measured one from its JSON file. A cost model object passes through."""
    if not isinstance(name, str):
        return name
    if name.endswith(".json"):
        if _json_format(name) == FITTED_JSON_FORMAT:  # fitted from a phone's trace (edgeprobe.foreign.fit)
            return load_fitted(name)
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

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # MeasuredCostModel.from_json says what is wrong with it
    return doc.get("format") if isinstance(doc, dict) else None


# the old names (a device's speeds were once called its profile): notebooks and users' code import them
DeviceProfile = CostModel
PROFILES = COST_MODELS
device_profile = cost_model


# ---- fitted from a real trace (edgeprobe.foreign.fit makes them) ----------------------------------------------------
FITTED_JSON_FORMAT = "edgeprobe-fitted-cost-model"
FITTED_JSON_VERSION = 2   # 2: a bytes term (us_per_byte) and an M-threshold regime (below); 1 (FLOPs only) loads
FITTED_JSON_VERSIONS = (1, 2)
_BYTES_KINDS = ("linear", "int8_linear")  # the template's kinds whose ops read weight bytes


@dataclass(frozen=True)
class FittedCostModel(CostModel):
    """A CostModel fitted from a real trace: per lane and kind fixed_us + us_per_flop * FLOPs + us_per_byte * weight
    bytes, with other coefficients below an M threshold where the trace showed a kernel change (`fits`, see
    foreign.fit.fit_line); lanes the trace lacks are priced by the named `base` cost model.

    A Subgraph carries (kind, FLOPs) per op: time_us prices its ops one by one (bytes and rows exact) when the model
    is bound to the graph (for_graph; schedule.predict does it), else it shares the subgraph's weight_bytes among its
    linears by FLOPs and takes its rows (`tokens`) for each op (the LM head's bytes are outside weight_bytes)."""
    fits: dict = field(default_factory=dict)      # lane -> kind -> fit_line(...)
    base: str | None = None
    held_out: dict = field(default_factory=dict)
    trace_source: dict = field(default_factory=dict)
    graph_ops: dict = field(default_factory=dict, compare=False, repr=False)  # subgraph name -> its op dicts

    def _base(self):
        return cost_model(self.base) if self.base else None

    def _fit(self, lane: str, kind: str) -> dict | None:
        kinds = self.fits.get(lane)
        if kinds is None:
            return None
        f = fit_for(kinds, kind)
        if f is None:
            raise ScheduleError(f"fitted cost model {self.name!r} saw no {kind!r} op on {lane} "
                                f"(fitted: {', '.join(kinds)})")
        return f

    def rate(self, lane: str, kind: str) -> float:
        f = self._fit(lane, kind)
        if f is None:
            return self._base().rate(lane, kind) if self.base else super().rate(lane, kind)
        return float("inf") if f["us_per_flop"] <= 0 else 1e-3 / f["us_per_flop"]

    def for_graph(self, graph) -> "FittedCostModel":
        """This model priced op by op over `graph`'s template ops (a ChunkGraph): exact bytes and rows per op."""
        return replace(self, graph_ops=graph.ops_of())

    def as_soc(self):
        """The same model as its base SoC's roofline (schedule.soc) with the fitted lanes and kinds priced by their
        fits: what schedule.predict prices prefill, decode, batches and flash with. Needs a SoC base."""
        from .soc import SocCostModel, available, load

        if self.base not in available():
            raise ScheduleError(f"fitted cost model {self.name!r} has base {self.base!r}; a phone prediction needs a "
                                f"SoC base ({', '.join(available())}): fit again with base=...")
        base = load(self.base)
        assert isinstance(base, SocCostModel)
        return replace(base, name=self.name, fits=self.fits, modelled=False, source=self.source,
                       notes={**base.notes, "fitted_from": self.trace_source, "held_out": self.held_out})

    def op_time_us(self, op: dict, lane: str | None = None) -> float:
        kind, flops, nbytes = op["cost"]
        lane = lane or op["lane"]
        f = self._fit(lane, kind)
        if f is None:
            if not self.base:
                return super().op_time_us(op, lane)
            return self._base().op_time_us(op, lane)
        return fitted_time_us(f, flops, nbytes, op["shape"][0])

    def time_us(self, g, lane: str | None = None) -> float:
        lane = lane or g.lane
        if lane not in self.fits:
            if not self.base:
                return super().time_us(g, lane)
            return self._base().time_us(g, lane)
        t = self.launch_us.get(lane, 0.0)
        ops = self.graph_ops.get(g.name)
        if ops is not None and [(o["cost"][0], o["cost"][1]) for o in ops] == [tuple(c) for c in g.costs]:
            return t + sum(self.op_time_us(o, lane) for o in ops)
        lin = sum(fl for kind, fl in g.costs if kind in _BYTES_KINDS) or 1
        for kind, flops in g.costs:
            nbytes = g.weight_bytes * flops / lin if kind in _BYTES_KINDS else 0.0
            t += fitted_time_us(self._fit(lane, kind), flops, nbytes, g.tokens)
        return t

    # ---- files ----------------------------------------------------------------------------------
    def to_json(self, path=None) -> str:
        doc = {"format": FITTED_JSON_FORMAT, "version": FITTED_JSON_VERSION, "name": self.name, "source": self.source,
               "fits": self.fits, "base": self.base, "sync_us": self.sync_us, "launch_us": self.launch_us,
               "held_out": self.held_out, "trace_source": self.trace_source}
        text = json.dumps(doc, indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, path) -> "FittedCostModel":
        """A saved model; version 1 files (FLOPs only: no us_per_byte, no `below`) price as they did."""
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            msg = f"{path}: document: not readable JSON ({e}); expected a {FITTED_JSON_FORMAT} file"
            raise ScheduleError(msg) from None
        if not isinstance(doc, dict) or doc.get("format") != FITTED_JSON_FORMAT or doc.get(
                "version") not in FITTED_JSON_VERSIONS:
            got = (doc.get("format"), doc.get("version")) if isinstance(doc, dict) else type(doc).__name__
            raise ScheduleError(f"{path}: document: format/version {got}; expected a {FITTED_JSON_FORMAT} file of "
                                f"version {' or '.join(map(str, FITTED_JSON_VERSIONS))}")
        return _build_fitted(doc["name"], doc["fits"], doc.get("base"), doc.get("source", ""), doc.get("sync_us", 0.0),
                             doc.get("launch_us", {}), doc.get("held_out", {}), doc.get("trace_source", {}))


def _build_fitted(name, fits, base, source, sync_us, launch_us, held, trace_source) -> FittedCostModel:
    rates = {lane: {k: (1e-3 / f["us_per_flop"]) if f["us_per_flop"] > 0 else float("inf") for k, f in kinds.items()}
             for lane, kinds in fits.items()}
    return FittedCostModel(name=name, rates=rates, launch_us=dict(launch_us), sync_us=float(sync_us),
                           op_us={}, source=source, modelled=False, notes={"fitted_from": trace_source},
                           fits=fits, base=base, held_out=held, trace_source=trace_source)


load_fitted = FittedCostModel.from_json  # a fitted cost model saved with FittedCostModel.to_json
