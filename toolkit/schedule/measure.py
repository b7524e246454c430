"""Cost models measured on the device agent: HeteroLLM's profiler in its "real" and "predicted" modes (§4.2).

`measure_cost_model` runs in-order chunked prefills on the agent over a grid of chunk lengths (each a few chunks
long, so attention sees a grid of key lengths), groups the trace's op events by subgraph and keeps the busy
time of every subgraph — one sample per (lane, stage, tokens, keys). From those samples:
    real       the measured median of the exact (lane, stage, tokens, keys) when it was measured;
    predicted  a least-squares fit per (lane, stage) through each shape's median: t = a + b * FLOPs (a: the
               stage's fixed cost — norms, RoPE, residuals, launch; 1/b its effective rate), for any shape.
Both answer `time_us(subgraph)` like a named CostModel, so every scheduler runs on them unchanged; they
say `modelled: False`. `fit_error` reports the predicted mode's error on chunk lengths left out of its fit.

`measure_linears` times single linears on the `npu` and `gpu` lanes over a grid of rows and fits the rates
HeteroLLM's partition solver needs (the GPU as one fixed FLOP rate, §4.2), plus the cross-lane hand-off.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgeprobe_kernels.linear_records import W8A8_SCHEMES, scheme_of

from .graph import ScheduleError, Subgraph


def _fit(xs, ys) -> tuple[float, float]:
    """Least squares t = a + b * x with a, b >= 0 (a constant when the slope would be negative), through the
    median time at each distinct x, weighted by its sample count: one op preempted for 1-4 ms (the OS or another
    lane holding the core or the GIL) among fifteen 100 us samples of one shape would otherwise move the line."""
    groups: dict = {}
    for x_, y_ in zip(xs, ys):
        groups.setdefault(float(x_), []).append(float(y_))
    x = np.array(sorted(groups))
    y = np.array([np.median(groups[v]) for v in x])
    w = np.array([len(groups[v]) for v in x], float)
    if len(x) >= 2:
        b, a = np.polyfit(x, y, 1, w=np.sqrt(w))  # polyfit's weights multiply the residuals
        if b > 0 and a >= 0:
            return float(a), float(b)
        if b > 0:  # negative intercept: through the origin instead
            return 0.0, float((w * x) @ y / ((w * x) @ x))
    return float(np.average(y, weights=w)), 0.0


@dataclass
class MeasuredCostModel:
    """Subgraph times measured on an agent. samples: [{lane, stage, tokens, kv_len, flops, us}]."""

    samples: list
    mode: str = "predicted"           # "real" | "predicted"
    sync_us: float = 0.0
    source: str = ""
    fits: dict = field(default_factory=dict)   # "lane/stage" -> [a_us, b_us_per_flop]
    meta: dict = field(default_factory=dict)   # model, scheme, shadow_layers: what was measured
    modelled: bool = False

    def __post_init__(self):
        if self.mode not in ("real", "predicted"):
            raise ScheduleError(f"a measured cost model's mode must be 'real' or 'predicted', got {self.mode!r}")
        if not self.samples:
            raise ScheduleError("a measured cost model needs samples; run measure_cost_model on an agent first")
        if not self.fits:
            groups: dict = {}
            for s in self.samples:
                groups.setdefault(f"{s['lane']}/{s['stage']}", []).append(s)
            self.fits = {k: list(_fit([s["flops"] for s in v], [s["us"] for s in v])) for k, v in groups.items()}
        table: dict = {}
        for s in self.samples:
            table.setdefault((s["lane"], s["stage"], s["tokens"], s["kv_len"]), []).append(s["us"])
        self._table = {k: statistics.median(v) for k, v in table.items()}

    @property
    def name(self) -> str:
        return f"measured-{self.mode}"

    def with_mode(self, mode: str) -> "MeasuredCostModel":
        return MeasuredCostModel(self.samples, mode, self.sync_us, self.source, self.fits, self.meta)

    def time_us(self, g: Subgraph, lane: str | None = None) -> float:
        lane = lane or g.lane
        if self.mode == "real":
            t = self._table.get((lane, g.stage, g.tokens, g.kv_len))
            if t is not None:
                return t
        fit = self.fits.get(f"{lane}/{g.stage}")
        if fit is None:
            have = sorted(self.fits)
            raise ScheduleError(f"the measured cost model has no samples of stage {g.stage!r} on lane {lane!r} "
                                f"(it has {', '.join(have)}); measure on an agent with that lane")
        return fit[0] + fit[1] * g.flops

    def fit_error(self) -> dict:
        """Predicted mode's relative error per stage on each chunk length left out of the fit
        (leave-one-chunk-length-out): {"lane/stage": {"median": .., "max": ..}, "all": median}."""
        out, every = {}, []
        lengths = sorted({s["chunk"] for s in self.samples})
        for key in sorted(self.fits):
            lane, stage = key.split("/")
            errs = []
            for c in lengths:
                train = [s for s in self.samples if s["lane"] == lane and s["stage"] == stage and s["chunk"] != c]
                test = [s for s in self.samples if s["lane"] == lane and s["stage"] == stage and s["chunk"] == c]
                if not train or not test:
                    continue
                a, b = _fit([s["flops"] for s in train], [s["us"] for s in train])
                errs += [abs(a + b * s["flops"] - s["us"]) / max(s["us"], 1e-9) for s in test]
            if errs:
                out[key] = {"median": float(np.median(errs)), "max": float(np.max(errs)), "n": len(errs)}
                every += errs
        out["all"] = float(np.median(every)) if every else float("nan")
        return out

    def to_json(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # the file's kind keeps its first name: files already saved load, and older readers read new ones
        path.write_text(json.dumps({"kind": "edgeprobe-measured-profile", "version": 1, "mode": self.mode,
                                    "sync_us": self.sync_us, "source": self.source, "fits": self.fits,
                                    "meta": self.meta, "samples": self.samples}, indent=1))
        return path

    @classmethod
    def from_json(cls, path, mode: str | None = None) -> "MeasuredCostModel":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ScheduleError(f"cannot read a measured cost model from {path}: {e}") from None
        if not isinstance(d, dict) or d.get("kind") != "edgeprobe-measured-profile":
            raise ScheduleError(f"{path} is not an edgeprobe measured profile file (a measured cost model; write one "
                                "with `edgeprobe schedule --cost-model measured` or MeasuredCostModel.to_json)")
        try:
            return cls(d["samples"], mode or d.get("mode", "predicted"), d.get("sync_us", 0.0), d.get("source", ""),
                       d.get("fits") or {}, d.get("meta") or {})
        except (KeyError, TypeError) as e:
            raise ScheduleError(f"{path}: malformed measured cost model ({e}); measure again") from None


def samples_from_run(res, chunk: int) -> list:
    """One sample per subgraph of a measured chunked prefill: the busy time of its ops (their events'
    durations summed), with the subgraph's lane, stage, rows, keys and FLOPs."""
    subs = res.schedule.graph.by_name()
    busy: dict = {}
    for e in res.trace.events:
        g = e.get("group")
        if g in subs:
            busy[g] = busy.get(g, 0.0) + (e["end_us"] - e["start_us"])
    return [{"lane": subs[n].lane, "stage": subs[n].stage, "tokens": subs[n].tokens, "kv_len": subs[n].kv_len,
             "flops": subs[n].flops, "us": us, "chunk": chunk} for n, us in busy.items()]


def cross_lane_sync_us(res) -> float:
    """Median gap between an op's last cross-lane dependency ending and the op starting (lane hand-off)."""
    ev = {e["name"]: e for e in res.trace.events}
    gaps = []
    for e in res.trace.events:
        deps = [ev[d] for d in e.get("deps", []) if d in ev]
        cross = [d for d in deps if d["lane"] != e["lane"]]
        if cross and all(d["end_us"] <= e["start_us"] for d in deps):
            last = max(deps, key=lambda d: d["end_us"])
            if last["lane"] != e["lane"]:
                gaps.append(e["start_us"] - last["end_us"])
    return float(np.median(gaps)) if gaps else 0.0


def measure_cost_model(dev, qm, tokens, chunks=(64, 128, 256), n_chunks: int = 3, progress: bool = True,
                       rounds: int = 2) -> MeasuredCostModel:
    """Run in-order chunked prefills of `n_chunks` chunks at each chunk length on the agent `dev`, `rounds` times
    over the lengths (interleaved, so a slow minute of a shared machine does not land on one length alone), and
    build a MeasuredCostModel (predicted mode; `.with_mode("real")` for table lookups). tokens: int ids (real text,
    so shadow outliers are as in use), at least max(chunks) * n_chunks of them."""
    tokens = np.asarray(tokens, np.int32)
    need = max(chunks) * n_chunks
    if len(tokens) < need:
        raise ScheduleError(f"measuring chunks up to {max(chunks)} x {n_chunks} needs {need} tokens, got {len(tokens)}")
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    if rounds < 1:
        raise ScheduleError(f"measuring needs at least one round over the chunk lengths, got rounds={rounds}")
    it = list(chunks) * rounds
    bar = tqdm(it, desc="measuring subgraphs on the agent", disable=not progress) if tqdm else it
    samples, syncs = [], []
    # warm: JIT, and every token measured below once, so the cold shadow rows its outliers need are read already
    dev.prefill_chunked(qm, tokens[:need], min(chunks), "in-order", progress=progress)
    for c in bar:
        res = dev.prefill_chunked(qm, tokens[:c * n_chunks], c, "in-order", progress=False)
        samples += samples_from_run(res, c)
        syncs.append(cross_lane_sync_us(res))
    src = (f"measured on agent {dev.url} ({dev.info.get('cpu', '?')}; lanes {', '.join(dev.info.get('lanes', []))}; "
           f"npu emulated), {qm.scheme}, chunks {list(chunks)} x {n_chunks}, {rounds} rounds")
    from ..plan import shadow_layers

    meta = {"model": qm.manifest.get("model"), "scheme": qm.scheme, "shadow_layers": shadow_layers(qm.manifest)}
    return MeasuredCostModel(samples, "predicted", float(np.median(syncs)), src, meta=meta)


def measure_linears(dev, qm, rows=(32, 64, 128, 256, 512, 1024), repeat: int = 2, progress: bool = True):
    """Time layer 0's int8 GEMMs alone on the agent's `npu` and `gpu` lanes over `rows` and fit HeteroLLM's
    solver inputs: per lane t = launch + FLOPs / rate (the GPU a fixed FLOP rate, §4.2), and the hand-off
    between lanes. Ops run one after another (chained) so they do not share the cores while timed.
    Returns (HeteroCostModel with modelled=False, samples [{lane, m, k, n, us}])."""
    from .hetero import PREBUILT, HeteroCostModel

    lanes = [l for l in ("npu", "gpu") if l in dev.info.get("lanes", [])]
    if len(lanes) < 2:
        missing = sorted({"npu", "gpu"} - set(lanes))
        raise ScheduleError(f"HeteroLLM partitioning needs the npu and gpu lanes; this agent lacks {missing} (it has "
                            f"{dev.info.get('lanes')}; the gpu lane needs OpenCL: Debian pocl-opencl-icd)")
    L = qm.manifest["linears"]
    recs = {}
    for proj in ("attn_q", "attn_k", "ffn_up", "ffn_down"):
        rec = L[f"blk.0.{proj}"]
        if scheme_of(rec) not in W8A8_SCHEMES:
            raise ScheduleError(f"measuring the partition solver's rates needs int8 linears; blk.0.{proj} is "
                                f"{rec['kind']!r}")
        recs[proj] = rec
    M = max(rows)
    rng = np.random.default_rng(0)
    ks = sorted({int(r["shape"][1]) for r in recs.values()})
    inputs = {f"x{k}": rng.standard_normal((M, k)).astype(np.float32) for k in ks}
    ops, prev, meta = [], None, {}
    for r in range(repeat + 1):  # the first pass warms up (kernel builds, weight buffers)
        for lane in lanes:
            for proj, rec in recs.items():
                for m in rows:
                    name = f"r{r}.{lane}.{proj}.{m}"
                    ops.append({"name": name, "kind": "linear", "lane": lane,
                                "inputs": [{"input": f"x{rec['shape'][1]}"}],
                                "deps": [prev] if prev else [], "attrs": {"rec": rec, "part": "int8", "rows": [0, m]}})
                    meta[name] = (r, lane, m, int(rec["shape"][1]), int(rec["shape"][0]))
                    prev = name
    # the same GEMMs with both lanes at once (row-cut halves side by side): each lane's slowdown under contention
    conc = []
    for proj, rec in recs.items():
        for m in rows[-3:]:
            N = int(rec["shape"][0])
            names = []
            for lane, cols in zip(lanes, ([0, N // 2], [N // 2, N])):
                name = f"c.{lane}.{proj}.{m}"
                ops.append({"name": name, "kind": "linear", "lane": lane, "inputs": [{"input": f"x{rec['shape'][1]}"}],
                            "deps": [prev], "attrs": {"rec": rec, "part": "int8", "rows": [0, m], "cols": cols}})
                names.append(name)
            for lane, cols in zip(lanes, ([0, N // 2], [N // 2, N])):  # and each alone, for the ratio
                name = f"a.{lane}.{proj}.{m}"
                ops.append({"name": name, "kind": "linear", "lane": lane, "inputs": [{"input": f"x{rec['shape'][1]}"}],
                            "deps": names if lane == lanes[0] else [f"a.{lanes[0]}.{proj}.{m}"],
                            "attrs": {"rec": rec, "part": "int8", "rows": [0, m], "cols": cols}})
                conc.append((f"c.{lane}.{proj}.{m}", name, lane))
            prev = f"a.{lanes[1]}.{proj}.{m}"
    # the hand-off: tiny ops alternating lanes, each waiting for the previous one
    for j in range(8):
        name = f"sync{j}"
        ops.append({"name": name, "kind": "linear", "lane": lanes[j % 2], "inputs": [{"input": f"x{ks[0]}"}],
                    "deps": [prev], "attrs": {"rec": recs["attn_k"], "part": "int8", "rows": [0, 1]}})
        prev = name
    plan = {"ops": ops, "outputs": [prev], "meta": {"kind": "measure-linears"}}
    dev.upload(qm, progress=progress)
    dev.load_model(qm)
    res = dev.run(dev.put_plan(plan), inputs, title="HeteroLLM profiler: int8 GEMMs per lane")
    best: dict = {}
    for e in res.trace.events:
        if e["name"] in meta and meta[e["name"]][0] > 0:
            _, lane, m, k, n = meta[e["name"]]
            us = e["end_us"] - e["start_us"]
            best[(lane, m, k, n)] = min(us, best.get((lane, m, k, n), us))
    samples = [{"lane": l, "m": m, "k": k, "n": n, "us": us} for (l, m, k, n), us in sorted(best.items())]
    fits = {}
    for lane in lanes:
        s = [x for x in samples if x["lane"] == lane]
        fits[lane] = _fit([2 * x["m"] * x["k"] * x["n"] for x in s], [x["us"] for x in s])
    ev = {e["name"]: e for e in res.trace.events}
    gaps = [ev[f"sync{j}"]["start_us"] - ev[f"sync{j - 1}"]["end_us"] for j in range(1, 8)]
    dur = lambda n: ev[n]["end_us"] - ev[n]["start_us"]
    slow = {lane: float(np.median([dur(c) / max(dur(a), 1e-9) for c, a, l in conc if l == lane])) for lane in lanes}
    rate = lambda lane: 1.0 / max(fits[lane][1], 1e-12) / 1e3  # FLOP/µs -> GFLOP/s
    cm = HeteroCostModel("measured", npu_gops=rate("npu"), gpu_gflops=rate("gpu"), npu_launch_us=fits["npu"][0],
                         gpu_launch_us=fits["gpu"][0], sync_us=float(np.median(gaps)), prebuilt=PREBUILT,
                         source=f"measured on agent {dev.url}: npu lane emulated on the CPU, gpu lane OpenCL "
                                f"({dev.info.get('cpu', '?')}); rows {list(rows)}", modelled=False,
                         slowdown_npu=max(1.0, slow["npu"]), slowdown_gpu=max(1.0, slow["gpu"]))
    return cm, samples


# the old names, kept for code written against them ("profile" now means a corpus statistic only)
MeasuredProfile = MeasuredCostModel
measure_profile = measure_cost_model
