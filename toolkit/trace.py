"""Execution traces: per-op events from the device agent, as Perfetto JSON, a dataframe, metrics and a timeline.

An event: {name, kind, lane, layer, chunk, start_us, end_us (agent clock, or host clock once aligned),
bytes_in, bytes_out, flops, emulated, deps, shape}. Lanes are processors (cpu, npu, gpu) plus `io`
for reads from flash. Events of emulated lanes say so: emulated "semantics" (a phone NPU's kernels computed by
this CPU), "isa" (real Hexagon machine code under qemu-hexagon: then also isa, hvx_packets and the labelled
dsp_cycles_estimate / dsp_clock_hz), False for measured work. Both strings are truthy: `if e["emulated"]` holds.
An agent in an emulated arm64 Python (qemu-aarch64) marks its cpu lane "isa" too. `backend` says what computed the
op: numba, numpy (an agent without numba, as under Termux), opencl or hvx.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

LANE_ORDER = ("npu", "gpu", "cpu", "io")
LANE_LABEL = {"npu": "npu (emulated on CPU)", "gpu": "gpu (OpenCL)", "cpu": "cpu", "io": "io (flash reads)"}
ISA_LANE_LABEL = "npu (Hexagon HVX code under qemu-hexagon)"  # the npu lane's events carry an isa: the hvx backend
EVENT_ARGS = ("layer", "chunk", "bytes_in", "bytes_out", "flops", "emulated", "backend", "shape", "isa", "hvx_packets",
              "hvx_insns", "scalar_packets", "dsp_cycles_estimate", "dsp_us_estimate", "dsp_clock_hz")


def span_of(events: list) -> tuple[float, list]:
    """(makespan us of the events, the events it spans): flash reads ("io") count only in a trace of nothing else."""
    ev = [e for e in events if e["lane"] != "io"] or events
    return max(max(e["end_us"] for e in ev) - min(e["start_us"] for e in ev), 1e-9), ev


def flash_read_bytes(events: list) -> int:
    return int(sum(e.get("bytes_in", 0) for e in events if e["kind"] == "flash_read"))


@dataclass
class Trace:
    events: list
    meta: dict = field(default_factory=dict)

    @property
    def lanes(self) -> list[str]:
        seen = {e["lane"] for e in self.events}
        return [l for l in LANE_ORDER if l in seen] + sorted(seen - set(LANE_ORDER))

    def lane_label(self, lane: str) -> str:
        """How a lane is named on timelines: what its processor is here (an isa lane runs Hexagon code)."""
        if lane == "npu" and any(e.get("isa") for e in self.events if e["lane"] == lane):
            return ISA_LANE_LABEL
        if lane == "cpu" and any(e.get("emulated") == "isa" for e in self.events if e["lane"] == lane):
            return "cpu (arm64 code under qemu-aarch64)"  # an agent in the emulated arm64 Python
        return LANE_LABEL.get(lane, lane)

    def _t0(self) -> float:
        return min((e["start_us"] for e in self.events), default=0.0)

    # ---- numbers --------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """makespan_ms; per lane: busy % of the makespan, ops, bubbles (idle gaps between its first and
        last op, count and total ms), emulated or not."""
        if not self.events:
            return {"makespan_ms": 0.0, "lanes": {}}
        span, ev = span_of(self.events)
        lanes = {}
        for lane in self.lanes:
            iv = sorted((e["start_us"], e["end_us"]) for e in self.events if e["lane"] == lane)
            busy, gaps, gap_us, end = 0.0, 0, 0.0, None
            for a, b in iv:
                if end is not None and a > end:
                    gaps += 1
                    gap_us += a - end
                lo = a if end is None else max(a, end)
                busy += max(0.0, b - lo)
                end = b if end is None else max(end, b)
            lanes[lane] = {"busy_pct": 100.0 * busy / span, "ops": len(iv), "busy_ms": busy / 1e3,
                           "bubbles": gaps, "bubble_ms": gap_us / 1e3,
                           "emulated": any(e.get("emulated") for e in self.events if e["lane"] == lane)}
        return {"makespan_ms": span / 1e3, "lanes": lanes, "flops": int(sum(e.get("flops", 0) for e in ev)),
                "flash_read_bytes": flash_read_bytes(self.events)}

    def to_dataframe(self):
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("Trace.to_dataframe needs pandas: pip install 'edgeprobe[notebook]'") from e
        t0 = self._t0()
        rows = [{**e, "start_ms": (e["start_us"] - t0) / 1e3, "dur_ms": (e["end_us"] - e["start_us"]) / 1e3}
                for e in self.events]
        return pd.DataFrame(rows)

    # ---- files ----------------------------------------------------------------------------------
    def to_chrome_json(self, path) -> Path:
        """Chrome trace-event JSON (opens in Perfetto and chrome://tracing): one track per lane with its
        name, complete events with args, flow arrows for dependencies that cross lanes."""
        return write_chrome_json(path, {self.meta.get("title", "edgeprobe agent"): self})

    def chrome_events(self, pid: int = 1, t0: float | None = None, name: str | None = None) -> list[dict]:
        """This trace as Chrome trace events of process `pid` named `name` (default its title): a thread per lane,
        times in µs from t0 (default its first event), flow ids unique to the process."""
        t0 = self._t0() if t0 is None else t0
        tid = {lane: i + 1 for i, lane in enumerate(self.lanes)}
        out = [{"ph": "M", "name": "process_name", "pid": pid,
                "args": {"name": name or self.meta.get("title", "edgeprobe agent")}},
               {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}]
        for lane, t in tid.items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": t,
                        "args": {"name": self.lane_label(lane)}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": t, "args": {"sort_index": t}})
        by_name = {e["name"]: e for e in self.events}
        flow = (pid - 1) << 32  # arrows of different processes never share an id (one trace: 1, 2, ... as ever)
        for e in self.events:
            args = {k: e[k] for k in EVENT_ARGS if k in e}
            out.append({"ph": "X", "name": e["name"], "cat": e["kind"], "pid": pid, "tid": tid[e["lane"]],
                        "ts": e["start_us"] - t0, "dur": max(e["end_us"] - e["start_us"], 0.001), "args": args})
            for d in e.get("deps", []):
                src = by_name.get(d)
                if src is None or src["lane"] == e["lane"]:
                    continue
                flow += 1
                out.append({"ph": "s", "id": flow, "name": "dep", "cat": "dep", "pid": pid, "tid": tid[src["lane"]],
                            "ts": src["end_us"] - t0 - 0.001})
                out.append({"ph": "f", "bp": "e", "id": flow, "name": "dep", "cat": "dep", "pid": pid,
                            "tid": tid[e["lane"]], "ts": e["start_us"] - t0})
        return out

    def save(self, path) -> Path:
        Path(path).write_text(json.dumps({"events": self.events, "meta": self.meta}))
        return Path(path)

    @classmethod
    def load(cls, path) -> "Trace":
        d = json.loads(Path(path).read_text())
        return cls(d["events"], d.get("meta", {}))

    def groups(self) -> dict:
        """name -> (lane, start_us, end_us) per op group (a scheduled subgraph), or per op when ungrouped."""
        out: dict = {}
        for e in self.events:
            if e["lane"] == "io":
                continue
            g = e.get("group", e["name"])
            lane, s, t = out.get(g, (e["lane"], e["start_us"], e["end_us"]))
            out[g] = (lane, min(s, e["start_us"]), max(t, e["end_us"]))
        return out

    def compare(self, other: "Trace", title: str | None = None):
        """Lay `other` (e.g. a predicted trace) over this one (e.g. measured), matched by op group.

        Returns (figure, rows): rows give each matched group's measured and predicted duration (ms) and the
        relative prediction error; the figure draws both timelines, lane by lane, one above the other.
        """
        import plotly.graph_objects as go

        mine, theirs = self.groups(), other.groups()
        t0a = min((v[1] for v in mine.values()), default=0.0)
        t0b = min((v[1] for v in theirs.values()), default=0.0)
        rows = []
        for name in sorted(set(mine) & set(theirs), key=lambda n: mine[n][1]):
            a, b = mine[name], theirs[name]
            da, db = (a[2] - a[1]) / 1e3, (b[2] - b[1]) / 1e3
            rows.append({"group": name, "lane": a[0], "measured_ms": da, "predicted_ms": db,
                         "error": (db - da) / da if da > 0 else float("nan")})
        fig = go.Figure()
        for label, groups, t0, opacity in ((self.meta.get("title", "measured"), mine, t0a, 0.9),
                                           (other.meta.get("title", "predicted"), theirs, t0b, 0.5)):
            names = list(groups)
            fig.add_bar(y=[f"{groups[n][0]} · {'measured' if groups is mine else 'predicted'}" for n in names],
                        x=[(groups[n][2] - groups[n][1]) / 1e3 for n in names],
                        base=[(groups[n][1] - t0) / 1e3 for n in names], orientation="h", name=label, opacity=opacity,
                        customdata=names, hovertemplate="%{customdata}<br>%{base:.1f} ms + %{x:.2f} ms<extra></extra>")
        errs = np.array([r["error"] for r in rows if np.isfinite(r["error"])])
        sub = (f"{len(rows)} matched groups; median |error| {100 * np.median(np.abs(errs)):.0f}%" if len(errs)
               else "no matched groups")
        fig.update_layout(barmode="overlay", title=(title or "measured vs predicted") + f"<br><sup>{sub}</sup>",
                          xaxis_title="time (ms)", height=360, legend=dict(orientation="h", y=-0.25))
        return fig, rows

    # ---- picture --------------------------------------------------------------------------------
    def figure(self, title: str | None = None):
        """Plotly timeline: lanes as rows, ops as bars coloured by kind, hover with shape, bytes and FLOPs."""
        import plotly.graph_objects as go

        t0 = self._t0()
        fig = go.Figure()
        kinds = sorted({e["kind"] for e in self.events})
        for kind in kinds:
            ev = [e for e in self.events if e["kind"] == kind]
            fig.add_bar(
                y=[self.lane_label(e["lane"]) for e in ev], x=[(e["end_us"] - e["start_us"]) / 1e3 for e in ev],
                base=[(e["start_us"] - t0) / 1e3 for e in ev], orientation="h", name=kind,
                marker_color=kind_color(kind),
                customdata=[[e["name"], str(e.get("shape", "")), e.get("bytes_in", 0) / 1e3, e.get("flops", 0) / 1e6,
                             f"emulated ({e['emulated']})" if isinstance(e.get("emulated"), str)
                             else "emulated" if e.get("emulated") else ""] for e in ev],
                hovertemplate="%{customdata[0]} %{customdata[4]}<br>%{base:.2f} ms + %{x:.3f} ms<br>"
                              "out %{customdata[1]}, "
                              "in %{customdata[2]:.0f} kB, %{customdata[3]:.1f} MFLOP<extra>" + kind + "</extra>")
        m = self.metrics()
        busy = ", ".join(f"{l} {v['busy_pct']:.0f}%" for l, v in m["lanes"].items())
        fig.update_layout(barmode="overlay", title=(title or self.meta.get("title", "execution trace")) +
                          f"<br><sup>makespan {m['makespan_ms']:.1f} ms; busy {busy}</sup>",
                          xaxis_title="time (ms)", yaxis=dict(categoryorder="array",
                          categoryarray=[self.lane_label(l) for l in reversed(self.lanes)]),
                          legend=dict(orientation="h", y=-0.2), height=320 + 30 * len(self.lanes))
        return fig


def write_chrome_json(path, traces: dict) -> Path:
    """Traces {name: Trace} in one Perfetto file, a process per trace (a farm's devices), on one time axis: every
    client aligns its agent's clock to the host's, so runs that overlapped in time overlap in the file. One trace
    keeps its meta as otherData; several keep theirs under otherData["processes"][name]."""
    t0 = min((t._t0() for t in traces.values() if t.events), default=0.0)
    out = []
    for pid, (name, trace) in enumerate(traces.items(), 1):
        out += trace.chrome_events(pid, t0, name)
    other = (next(iter(traces.values())).meta if len(traces) == 1
             else {"processes": {n: t.meta for n, t in traces.items()}})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}))
    return path


# one colour per op kind in every figure (plotly's default cycles by position, so a kind present in one run and
# absent in the next, e.g. flash reads, would repaint every other kind); schedule stages included
KIND_COLORS = {"linear": "#636efa", "attention": "#ef553b", "rope": "#ff6692", "swiglu": "#b6e880", "add": "#00cc96",
               "rms_norm": "#19d3f3", "embed": "#ffa15a", "lm_head": "#ab63fa", "flash_read": "#7f7f7f",
               "ffn_flash": "#fecb52", "moe_ffn": "#fecb52", "concat": "#bcbd22",
               "qkv": "#636efa", "ffn": "#1f3fbf", "attn": "#ef553b", "shadow": "#ffa15a"}
_EXTRA = ("#8c564b", "#e377c2", "#17becf", "#9467bd", "#2ca02c", "#d62728")


def kind_color(kind: str) -> str:
    """A fixed colour for an op kind (unknown kinds get a stable one from their name)."""
    return KIND_COLORS.get(kind) or _EXTRA[zlib.crc32(kind.encode()) % len(_EXTRA)]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))
