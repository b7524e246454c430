"""Execution traces: per-op events from the device agent, as Perfetto JSON, a dataframe, metrics and a timeline.

An event: {name, kind, lane, layer, chunk, start_us, end_us (agent clock, or host clock once aligned),
bytes_in, bytes_out, flops, emulated, deps, shape}. Lanes are processors (cpu, npu, gpu) plus `io`
for reads from flash. Events of emulated lanes say so: emulated "semantics" (a phone NPU's kernels computed by
this CPU), "isa" (real Hexagon machine code under qemu-hexagon: then also isa, hvx_packets and the labelled
dsp_cycles_estimate / dsp_clock_hz), False for measured work. Both strings are truthy: `if e["emulated"]` holds.
An agent in an emulated arm64 Python (qemu-aarch64) marks its cpu lane "isa" too. `backend` says what computed the
op: numba, numpy (an agent without numba, as under Termux), opencl or hvx. Events a cost model predicted say
predicted (and modelled: a named model); events imported from a phone's trace (edgeprobe.foreign) say measured, with
the tool in meta["source"]. Each lane's label says which of these its times are (Trace.lane_label).
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .foreign.base import CHROME_KEY  # the readers refuse what carries it: edgeprobe's own times are not measured

LANE_ORDER = ("npu", "hmx", "hvx", "dma", "gpu", "cpu", "io")
# an agent's lanes on this host; every label starts with its lane's name (Trace.load reads the lane back from it)
LANE_LABEL = {"npu": "npu (emulated on CPU)", "hmx": "hmx (Hexagon matrix unit)", "hvx": "hvx (Hexagon vector threads)",
              "dma": "dma (Hexagon DMA)",
              "gpu": "gpu (OpenCL)", "cpu": "cpu", "io": "io (flash reads)"}
ISA_LANE_LABEL = "npu (Hexagon HVX code under qemu-hexagon)"  # the npu lane's events carry an isa: the hvx backend
EVENT_ARGS = ("layer", "chunk", "group", "bytes_in", "bytes_out", "flops", "emulated", "measured", "modelled",
              "predicted", "backend", "shape", "isa", "hvx_packets", "hvx_insns", "scalar_packets",
              "dsp_cycles_estimate", "dsp_us_estimate", "dsp_clock_hz", "cycles", "mhz", "tensors", "inputs", "output",
              "input_shapes", "dtypes", "template_ops", "unmatched", "pass", "deps")
MIN_BAR_FRACTION = 0.002  # a bar is drawn at least this share of the time axis wide (its hover gives the real time)


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
        """How a lane is named on timelines: what its times are in this trace. Predicted by a cost model (modelled,
        or fitted to measurements), measured on a phone by a tool (an imported trace), emulated (NPU semantics on
        this CPU, or Hexagon / arm64 code under qemu), or this host's own processor."""
        ev = [e for e in self.events if e["lane"] == lane]
        meta = self.meta
        if any(e.get("predicted") for e in ev) or (meta.get("predicted") and not any(e.get("measured") for e in ev)):
            cm = meta.get("cost_model") or meta.get("profile") or "a cost model"
            modelled = meta.get("modelled", any(e.get("modelled") for e in ev))
            if modelled:
                return f"{lane} (modelled: {cm})"
            if cm == "measured-real":  # schedule.measure's cost models, named by their mode
                return f"{lane} (predicted: the agent's measured times)"
            if cm == "measured-predicted":
                return f"{lane} (predicted: fitted to the agent's measured times)"
            return f"{lane} (predicted: {cm}, fitted to measurements)"
        if any(e.get("measured") for e in ev) or meta.get("measured"):
            src = meta.get("source")
            tool = src.get("tool") if isinstance(src, dict) else src
            return f"{lane} (measured: {tool})" if tool else f"{lane} (measured)"
        if lane == "npu" and any(e.get("isa") for e in ev):
            return ISA_LANE_LABEL
        if lane == "cpu" and any(e.get("emulated") == "isa" for e in ev):
            return "cpu (arm64 code under qemu-aarch64)"  # an agent in the emulated arm64 Python
        if lane == "npu" and ev and not any(e.get("emulated") for e in ev):
            return "npu"  # neither emulated, predicted nor imported: say nothing it is not
        return LANE_LABEL.get(lane, lane)

    def provenance(self) -> str:
        """What this trace's times are, in a word: predicted, measured (imported from a phone), emulated or host."""
        if self.meta.get("predicted") or any(e.get("predicted") for e in self.events):
            return "predicted"
        if self.meta.get("measured") or any(e.get("measured") for e in self.events):
            return "measured"
        return "emulated" if any(e.get("emulated") for e in self.events) else "host"

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
    def load(cls, path, process: str | None = None) -> "Trace":
        """A trace file: its own format (Trace.save), or Chrome/Perfetto JSON: what `edgeprobe run --trace`,
        to_chrome_json and the demo's report write (events, lanes, times and args come back), or another tool's
        Chrome JSON (read by edgeprobe.foreign). A file of several processes (a farm's devices) needs `process`."""
        from .errors import EdgeprobeError

        try:
            d = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise EdgeprobeError(f"{path}: cannot read a trace: {e}") from None
        if isinstance(d, dict) and "events" in d:
            return cls(d["events"], d.get("meta", {}))
        if isinstance(d, dict) and isinstance(d.get("traceEvents"), list):
            return _from_chrome(d, path, process)
        if isinstance(d, list) and d and isinstance(d[0], dict) and "ph" in d[0]:
            return cls.load_foreign(path, "chrome-json")
        raise EdgeprobeError(f"{path}: not a trace; expected edgeprobe's trace JSON ({{\"events\": [...]}}) or Chrome "
                             "trace-event JSON ({\"traceEvents\": [...]})")

    @classmethod
    def load_foreign(cls, path, format: str = "auto", mhz: float | None = None) -> "Trace":
        """A phone's trace recorded by another tool (llama.cpp's Hexagon profile, Chrome JSON ...):
        edgeprobe.foreign.load_foreign; every event measured. mhz: the clock of a cycle-timed file that states none."""
        from .foreign.read import read_foreign

        return cls(*read_foreign(path, format, mhz=mhz))

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

    def _group_info(self) -> dict:
        """group -> (kind, chunk): the stage a scheduled subgraph's name ends with (qkv, attn, ffn, ...), else its
        first event's kind; the chunk of its first event."""
        out: dict = {}
        for e in self.events:
            if e["lane"] == "io":
                continue
            g = e.get("group", e["name"])
            if g not in out:
                stage = g.rsplit(".", 1)[-1] if "group" in e else ""
                out[g] = (stage if stage in KIND_COLORS else e["kind"], e.get("chunk"))
        return out

    def compare(self, other: "Trace", title: str | None = None):
        """Lay `other` (e.g. a predicted trace) over this one (e.g. measured), matched by op group.

        Returns (figure, rows): rows give each matched group's measured and predicted duration (ms) and the
        relative prediction error; the figure draws both timelines, lane by lane, one above the other (each lane
        labelled with what its times are), bars outlined and at least MIN_BAR_FRACTION of the axis wide, coloured
        by kind or by chunk (buttons toggle), the predicted bars paler.
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
        sides = []
        for trace, groups, t0, side, opacity in ((self, mine, t0a, "measured", 0.95),
                                                 (other, theirs, t0b, "predicted", 0.55)):
            info = trace._group_info()
            span = max((max((v[2] for v in groups.values()), default=t0) - t0) / 1e3, 1e-9)
            sides.append((trace, groups, t0, side, opacity, info, span))
        min_ms = MIN_BAR_FRACTION * max(s[-1] for s in sides)
        fig = go.Figure()
        kinds = sorted({k for s in sides for k, _ in s[5].values()})
        chunks = list(dict.fromkeys(_chunk_label(c) for c in sorted({c for s in sides for _, c in s[5].values()},
                                                                    key=_chunk_key)))
        for colouring, cats in (("kind", kinds), ("chunk", chunks)):
            for cat in cats:
                first = True
                for trace, groups, t0, side, opacity, info, _ in sides:
                    names = [n for n in groups if (info[n][0] if colouring == "kind" else _chunk_label(info[n][1]))
                             == cat]
                    if not names:
                        continue
                    color = kind_color(cat) if colouring == "kind" else chunk_color(info[names[0]][1])
                    fig.add_bar(y=[f"{trace.lane_label(groups[n][0])} · {side}" for n in names],
                                x=[max((groups[n][2] - groups[n][1]) / 1e3, min_ms) for n in names],
                                base=[(groups[n][1] - t0) / 1e3 for n in names], orientation="h", name=cat,
                                legendgroup=f"{colouring}:{cat}", showlegend=first, visible=colouring == "kind",
                                opacity=opacity, marker=dict(color=color, line=dict(color=outline_color(color),
                                                                                   width=1)),
                                customdata=[[n, (groups[n][2] - groups[n][1]) / 1e3, side] for n in names],
                                hovertemplate="%{customdata[0]} (%{customdata[2]})<br>%{base:.1f} ms + "
                                              "%{customdata[1]:.2f} ms<extra></extra>")
                    first = False
        n_kind = sum(1 for t in fig.data if t.visible)
        errs = np.array([r["error"] for r in rows if np.isfinite(r["error"])])
        sub = (f"{len(rows)} matched groups; median |error| {100 * np.median(np.abs(errs)):.0f}%" if len(errs)
               else "no matched groups")
        names = (self.meta.get("title", "measured"), other.meta.get("title", "predicted"))
        lanes = [f"{t.lane_label(l)} · {side}" for t, side in ((self, "measured"), (other, "predicted"))
                 for l in t.lanes if l != "io"]
        head = title_layout(title or "measured vs predicted", f"{sub}; measured: {names[0]}; predicted: {names[1]}",
                            controls=True)
        fig.update_layout(barmode="overlay", **head, xaxis_title="time (ms)",
                          height=270 + head["margin"]["t"] + 24 * len(lanes),
                          yaxis=dict(categoryorder="array", categoryarray=list(reversed(lanes))),
                          legend=dict(orientation="h", y=-0.25, title=dict(text="op kind")),
                          updatemenus=[colour_toggle(n_kind, len(fig.data) - n_kind)])
        return fig, rows

    def prediction_scatter(self, other: "Trace", title: str | None = None):
        """Predicted (other) against measured (this) duration per matched op group, log-log, with the identity line
        (on it: predicted exactly) and the median |error| in the title. Returns (figure, compare's rows)."""
        import plotly.graph_objects as go

        _, rows = self.compare(other)
        fig = go.Figure()
        vals = [v for r in rows for v in (r["measured_ms"], r["predicted_ms"]) if v > 0]
        lo, hi = (min(vals), max(vals)) if vals else (1e-3, 1.0)
        fig.add_scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="predicted = measured",
                        line=dict(color="#444", dash="dash"), hoverinfo="skip")
        for lane in sorted({r["lane"] for r in rows}):
            rs = [r for r in rows if r["lane"] == lane]
            fig.add_scatter(x=[r["measured_ms"] for r in rs], y=[r["predicted_ms"] for r in rs], mode="markers",
                            name=self.lane_label(lane), customdata=[[r["group"], r["error"]] for r in rs],
                            marker=dict(line=dict(width=1, color="#222")),
                            hovertemplate="%{customdata[0]}<br>measured %{x:.3f} ms, predicted %{y:.3f} ms "
                                          "(%{customdata[1]:+.0%})<extra></extra>")
        errs = np.array([abs(r["error"]) for r in rows if np.isfinite(r["error"])])
        sub = f"{len(rows)} groups; median |error| {100 * np.median(errs):.0f}%" if len(errs) else "no matched groups"
        fig.update_layout(title=(title or f"predicted ({other.meta.get('title', 'predicted')}) vs measured") +
                          f"<br><sup>{sub}</sup>", xaxis=dict(type="log", title="measured (ms)"),
                          yaxis=dict(type="log", title="predicted (ms)"), height=480)
        return fig, rows

    # ---- picture --------------------------------------------------------------------------------
    def figure(self, title: str | None = None):
        """Plotly timeline: lanes as rows (labelled modelled / measured / emulated), ops as bars with an outline
        and at least MIN_BAR_FRACTION of the axis wide, coloured by kind or by chunk (buttons toggle; the legend
        shows the colouring drawn), hover with the real duration, shape, bytes and FLOPs."""
        import plotly.graph_objects as go

        t0 = self._t0()
        span_ms = max((max((e["end_us"] for e in self.events), default=t0) - t0) / 1e3, 1e-9)
        min_ms = MIN_BAR_FRACTION * span_ms
        fig = go.Figure()
        kinds = sorted({e["kind"] for e in self.events})
        chunks = list(dict.fromkeys(_chunk_label(c) for c in sorted({e.get("chunk") for e in self.events},
                                                                    key=_chunk_key)))
        labels = {lane: self.lane_label(lane) for lane in self.lanes}

        def bars(ev, name, color, visible):
            fig.add_bar(
                y=[labels[e["lane"]] for e in ev], x=[max((e["end_us"] - e["start_us"]) / 1e3, min_ms) for e in ev],
                base=[(e["start_us"] - t0) / 1e3 for e in ev], orientation="h", name=name, visible=visible,
                legendgroup=name, marker=dict(color=color, line=dict(color=outline_color(color), width=1)),
                customdata=[[e["name"], str(e.get("shape", "")), e.get("bytes_in", 0) / 1e3, e.get("flops", 0) / 1e6,
                             f"emulated ({e['emulated']})" if isinstance(e.get("emulated"), str)
                             else "emulated" if e.get("emulated") else "", (e["end_us"] - e["start_us"]) / 1e3,
                             e["kind"], _chunk_label(e.get("chunk"))] for e in ev],
                hovertemplate="%{customdata[0]} %{customdata[4]}<br>%{base:.2f} ms + %{customdata[5]:.3f} ms<br>"
                              "%{customdata[6]}, %{customdata[7]}<br>out %{customdata[1]}, "
                              "in %{customdata[2]:.0f} kB, %{customdata[3]:.1f} MFLOP<extra></extra>")

        for kind in kinds:
            bars([e for e in self.events if e["kind"] == kind], kind, kind_color(kind), True)
        for label in chunks:
            ev = [e for e in self.events if _chunk_label(e.get("chunk")) == label]
            bars(ev, label, chunk_color(ev[0].get("chunk")), False)
        m = self.metrics()
        busy = ", ".join(f"{l} {v['busy_pct']:.0f}%" for l, v in m["lanes"].items())
        head = title_layout(title or self.meta.get("title", "execution trace"),
                            f"makespan {m['makespan_ms']:.1f} ms; busy {busy}; {self.provenance()} times",
                            controls=True)
        fig.update_layout(barmode="overlay", **head, xaxis_title="time (ms)", yaxis=dict(categoryorder="array",
                          categoryarray=[labels[l] for l in reversed(self.lanes)]),
                          legend=dict(orientation="h", y=-0.2, title=dict(text="op kind")),
                          updatemenus=[colour_toggle(len(kinds), len(chunks))],
                          height=240 + head["margin"]["t"] + 30 * len(self.lanes))
        return fig


def write_chrome_json(path, traces: dict) -> Path:
    """Traces {name: Trace} in one Perfetto file, a process per trace (a farm's devices), on one time axis: every
    client aligns its agent's clock to the host's, so runs that overlapped in time overlap in the file. One trace
    keeps its meta as otherData; several keep theirs under otherData["processes"][name]."""
    t0 = min((t._t0() for t in traces.values() if t.events), default=0.0)
    out = []
    for pid, (name, trace) in enumerate(traces.items(), 1):
        out += trace.chrome_events(pid, t0, name)
    other = (dict(next(iter(traces.values())).meta) if len(traces) == 1
             else {"processes": {n: t.meta for n, t in traces.items()}})
    other[CHROME_KEY] = {"t0_us": t0}  # Trace.load puts the events back on their own clock
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}))
    return path


def _from_chrome(doc: dict, path, process: str | None) -> "Trace":
    """edgeprobe's own Chrome JSON back into a Trace: process -> trace, thread label -> lane (its first word),
    cat -> kind, ts/dur (µs from otherData's origin) -> start_us/end_us, args -> the event's fields. Chrome JSON of
    another tool (no process_sort_index, no edgeprobe origin) goes to edgeprobe.foreign's reader."""
    from .errors import EdgeprobeError

    raw = [r for r in doc["traceEvents"] if isinstance(r, dict)]
    other = doc.get("otherData") if isinstance(doc.get("otherData"), dict) else {}
    meta_rows = [r for r in raw if r.get("ph") == "M"]
    ours = CHROME_KEY in other or any(r.get("name") == "process_sort_index" for r in meta_rows)
    if not ours:
        return Trace.load_foreign(path, "chrome-json")
    procs = {r.get("pid"): str(r.get("args", {}).get("name", "")) for r in meta_rows if r.get("name") == "process_name"}
    if process is None and len(procs) > 1:
        raise EdgeprobeError(f"{path}: {len(procs)} processes ({', '.join(procs.values())}); name one (process=...)")
    if process is None:
        pid = next(iter(procs), 1)
    else:
        pid = next((p for p, n in procs.items() if n == process), None)
        if pid is None:
            raise EdgeprobeError(f"{path}: no process {process!r}; it has {', '.join(procs.values())}")
    lanes = {r.get("tid"): str(r.get("args", {}).get("name", "")).split(" ", 1)[0] or "cpu"
             for r in meta_rows if r.get("name") == "thread_name" and r.get("pid") == pid}
    t0 = float(other.get(CHROME_KEY, {}).get("t0_us", 0.0))
    events = []
    for r in raw:
        if r.get("ph") != "X" or r.get("pid") != pid:
            continue
        start = t0 + float(r["ts"])
        e = {"name": r.get("name", ""), "kind": r.get("cat", ""), "lane": lanes.get(r.get("tid"), "cpu"),
             "start_us": start, "end_us": start + float(r.get("dur", 0.0))}
        e.update(r.get("args") or {})
        events.append(e)
    if len(procs) > 1:
        meta = dict(other.get("processes", {}).get(procs.get(pid), {}))
    else:
        meta = {k: v for k, v in other.items() if k != CHROME_KEY}
    meta.setdefault("title", procs.get(pid, str(path)))
    meta["loaded_from"] = str(path)
    return Trace(events, meta)


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


# chunks in order of a qualitative palette (plotly's D3 10): neighbouring chunks never share a hue
CHUNK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
                "#7f7f7f")
NO_CHUNK_COLOR = "#c7c7c7"


def chunk_color(chunk) -> str:
    """A fixed colour per chunk index (events outside any chunk, e.g. flash reads, in light grey)."""
    return CHUNK_COLORS[int(chunk) % len(CHUNK_COLORS)] if isinstance(chunk, (int, np.integer)) and chunk >= 0 \
        else NO_CHUNK_COLOR


def outline_color(color: str) -> str:
    """The fill's hue at 55% brightness: the outline that keeps a short bar visible (never white)."""
    c = color.lstrip("#")
    r, g, b = (int(c[i:i + 2], 16) for i in (0, 2, 4))
    return "#%02x%02x%02x" % tuple(int(v * 0.55) for v in (r, g, b))


def _chunk_key(chunk) -> tuple:
    """Chunks in order, events outside any chunk last."""
    ok = isinstance(chunk, (int, np.integer)) and chunk >= 0
    return (0, int(chunk)) if ok else (1, 0)


def _chunk_label(chunk) -> str:
    return f"chunk {int(chunk)}" if isinstance(chunk, (int, np.integer)) and chunk >= 0 else "no chunk"


def colouring(fig) -> str:
    """Which colouring a timeline of figure()/compare() shows now: "kind" or "chunk" (after its button was pressed)."""
    menus = fig.layout.updatemenus
    if not menus or not fig.data:
        return "kind"
    by_kind = menus[0].buttons[0].args[0]["visible"]
    shown = [t.visible is not False for t in fig.data]
    return "chunk" if shown == [not v for v in by_kind] and shown != list(by_kind) else "kind"


def set_colouring(fig, how: str):
    """Show a timeline of figure()/compare() coloured by "kind" or "chunk", as its buttons do; returns the figure."""
    menus = fig.layout.updatemenus
    if menus:
        i = {"kind": 0, "chunk": 1}[how]
        data, layout = menus[0].buttons[i].args
        for t, v in zip(fig.data, data["visible"]):
            t.visible = v
        fig.update_layout(legend_title_text=layout["legend.title.text"])
        fig.layout.updatemenus[0].active = i
    return fig


TITLE_CHARS, SUBTITLE_CHARS = 70, 95  # wrap widths: ~650 px at plotly's 17 px title and 12 px subtitle fonts
TITLE_LINE_PX, SUBTITLE_LINE_PX, CONTROLS_PX = 24, 17, 34
MODEBAR_PX = 40  # plotly's toolbar sits in the top right corner on hover: the title starts below it


def _wrap(parts: list[str], width: int, sep: str) -> list[str]:
    """Pack parts (words, or clauses of a subtitle) into lines of at most `width` characters where they fit."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines.append(part)
    return lines


def title_layout(title: str, sub: str = "", controls: bool = False) -> dict:
    """update_layout arguments for a title and its subtitle that a narrow figure never cuts (both wrapped: the
    title by words, the subtitle at its "; " clauses) and that leave a row for the colour buttons (`controls`) between
    them and the plot, so the buttons never cover them. Title at the container's top-left; the top margin holds it."""
    lines = _wrap(title.split(" "), TITLE_CHARS, " ")
    subs = _wrap(sub.split("; "), SUBTITLE_CHARS, "; ") if sub else []
    text = "<br>".join(lines + [f"<sup>{s}</sup>" for s in subs])
    top = MODEBAR_PX + TITLE_LINE_PX * len(lines) + SUBTITLE_LINE_PX * len(subs) + (CONTROLS_PX if controls else 0)
    return dict(title=dict(text=text, x=0.0, xref="container", xanchor="left", y=1.0, yref="container",
                           yanchor="top", pad=dict(t=MODEBAR_PX, l=12)), margin=dict(t=top + 8))


def colour_toggle(n_kind: int, n_chunk: int, x: float = 0.0, y: float = 1.0) -> dict:
    """A plotly updatemenus entry of two buttons that show the bars coloured by kind (the first n_kind traces) or
    by chunk (the next n_chunk): the legend lists only the shown colouring. Placed just above the plot, in the row
    title_layout(..., controls=True) leaves below the title."""
    by_kind = [True] * n_kind + [False] * n_chunk
    return dict(type="buttons", direction="right", x=x, y=y, xanchor="left", yanchor="bottom", showactive=True,
                active=0, pad=dict(r=4, t=0, b=6), buttons=[
                    dict(label="colour by kind", method="update",
                         args=[{"visible": by_kind}, {"legend.title.text": "op kind"}]),
                    dict(label="colour by chunk", method="update",
                         args=[{"visible": [not v for v in by_kind]}, {"legend.title.text": "chunk"}])])


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))
