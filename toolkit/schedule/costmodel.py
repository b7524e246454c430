"""The base of every cost model (CostModel: per-lane rates, launch, per-op and sync costs) and the pricing of an op
under a fit from a real trace (fitted_time_us): what the named SoC rooflines (schedule.soc) and the fitted and
measured models (schedule.cost, .measure) share, with no import of theirs."""
from __future__ import annotations

from dataclasses import dataclass, field

from .graph import ScheduleError, Subgraph

_FALLBACK_KIND = {"int8_linear": "linear", "float_sparse": "linear", "linear": "int8_linear"}


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


def fit_for(kinds: dict, kind: str) -> dict | None:
    """A lane's fit for an op of cost kind `kind`: its own, else the related kind's (None: the trace saw neither)."""
    return kinds.get(kind) or kinds.get(_FALLBACK_KIND.get(kind, ""))


def fitted_time_us(f: dict, flops: float, nbytes: float = 0.0, rows: int | None = None) -> float:
    """One op under a lane/kind fit: fixed_us + us_per_flop * FLOPs + us_per_byte * bytes, with the `below`
    regime's coefficients when the op's token rows M are under its threshold (version-1 fits: no bytes term)."""
    b = f.get("below")
    if b is not None and rows is not None and rows < b["rows_lt"]:
        f = b
    return f["fixed_us"] + f["us_per_flop"] * flops + f.get("us_per_byte", 0.0) * nbytes
