"""Live controls for a notebook: change the chunk length, scheduler, outlier prune rate or scheme, re-run the
prefill on the agent and redraw the timeline in place (a plotly FigureWidget whose traces are swapped).

    ex = TimelineExplorer(dev, model, prompt, calib)   # calib: OutlierStats (calibration_profile) for w8a8*
    ex                                                 # the panel; its Run button re-runs on the agent
    ex.set(chunk=64, scheduler="in-order"); ex.run()   # the same from code (returns the RunResult)

Schedulers: "layer" is the layer-by-layer plan (mllm-NPU without chunks), "in-order" and "ooo" lay out the
chunk graph of mllm-NPU §3.2 by §3.4's schedulers. The prune rate is §3.3's fraction of layers whose
outliers the shadow GEMMs drop (w8a8-shadow only).
"""
from __future__ import annotations

import html
import time

import numpy as np

SCHEDULERS = ("ooo", "in-order", "layer")
SCHEMES = ("w8a8-shadow", "w8a8", "q4_0-tile", "float")
CHUNKS = (16, 32, 64, 128, 256, 512)


class DeviceClosedError(RuntimeError):
    """The panel's device was closed and cannot be reopened from the panel."""


def _sentence(e: BaseException) -> str:
    """What the panel shows for a failed run: a sentence saying what to do, never a raw ZeroMQ error."""
    import zmq

    from .client import AgentLostError

    if isinstance(e, zmq.ZMQError):
        return (f"The connection to the agent is gone ({e.strerror}). Run the cell that opens the device again, "
                "then press Run.")
    if isinstance(e, AgentLostError):
        return f"The agent stopped answering: {e} Press Run to try again, or reopen the device."
    return str(e).strip() or type(e).__name__


def _widgets():
    try:
        import ipywidgets as W
        import plotly.graph_objects as go

        go.FigureWidget  # noqa: B018  (plotly needs anywidget for it; fail here, not at the first redraw)
    except ImportError as e:
        raise ImportError("the timeline explorer needs ipywidgets, plotly and anywidget: "
                          "pip install 'edgeprobe[notebook]'") from e
    return W, go


class TimelineExplorer:
    """A panel of controls over one prompt and one agent. Quantized models are cached per (scheme, prune rate),
    so going back to a setting only re-runs; uploads are content-addressed, so only changed blobs travel."""

    def __init__(self, dev, model, prompt, calib=None, chunk: int | None = None, scheduler: str = "ooo",
                 scheme: str = "w8a8-shadow", prune_rate: float = 0.85, cost_model="this-host-emulated",
                 check_host: bool = True, run: bool = True, width: int = 940, *, profile=None):
        W, go = _widgets()
        cost_model = cost_model if profile is None else profile  # profile: cost_model's old name
        self.dev, self.model, self.calib, self.cost_model, self.check_host = dev, model, calib, cost_model, check_host
        self.prompt = np.asarray(prompt, np.int32).reshape(-1)
        if len(self.prompt) < min(CHUNKS):
            raise ValueError(f"the prompt has {len(self.prompt)} tokens; give at least {min(CHUNKS)} to chunk it")
        chunks = [c for c in CHUNKS if c <= len(self.prompt)]
        self._qms: dict = {}
        self.result = self.error = None  # the last run's RunResult, or the exception it raised
        self.history: list[dict] = []  # one row per run: the settings and what was measured
        style = {"description_width": "initial"}
        self.controls = {
            "chunk": W.Dropdown(options=chunks, value=max(chunks), description="chunk length", style=style),
            "scheduler": W.Dropdown(options=SCHEDULERS, description="scheduler", style=style),
            "prune_rate": W.FloatSlider(value=0.85, min=0.0, max=1.0, step=0.05, description="outlier prune rate",
                                        continuous_update=False, readout_format=".2f", style=style),
            "scheme": W.Dropdown(options=SCHEMES, description="scheme", style=style),
        }
        # the constructor's choices go through set(), so a value not offered is named, not a traitlets error
        self.set(scheduler=scheduler, scheme=scheme, prune_rate=prune_rate, **({"chunk": chunk} if chunk else {}))
        # never shrunk by a long status line beside it (that cut the label to "Run on the ag…")
        self.button = W.Button(description="Run on the agent", button_style="primary", icon="play",
                               layout=W.Layout(width="auto", min_width="max-content", flex="0 0 auto"))
        self.status = W.HTML(layout=W.Layout(flex="1 1 auto"))
        self.notice = ""  # a sentence about the device, shown before the next run's numbers
        self.width = width
        self.figure = go.FigureWidget(layout=dict(height=360, width=width, title="press Run", xaxis_title="time (ms)"))
        self.button.on_click(lambda _b: self.run(raise_errors=False))
        self.controls["scheme"].observe(lambda _c: self._sync(), names="value")
        self.controls["scheduler"].observe(lambda _c: self._sync(), names="value")
        self._sync()
        self.panel = W.VBox([W.HBox(list(self.controls.values())[:2]), W.HBox(list(self.controls.values())[2:]),
                             W.HBox([self.button, self.status]), self.figure])
        if run:
            self.run(raise_errors=False)

    # ---- settings -------------------------------------------------------------------------------
    def set(self, **kw) -> "TimelineExplorer":
        """Change controls from code, e.g. set(chunk=64, scheduler="in-order"); unknown names or values raise."""
        for k, v in kw.items():
            if k not in self.controls:
                raise ValueError(f"unknown control {k!r}; the controls are {', '.join(self.controls)}")
            w = self.controls[k]
            opts = getattr(w, "options", None)
            if opts is not None and v not in opts:
                raise ValueError(f"{k}={v!r} is not offered here; choose one of {list(opts)}")
            if opts is None and not w.min <= v <= w.max:
                raise ValueError(f"{k}={v!r} is outside [{w.min}, {w.max}]")
            w.value = v
        return self

    @property
    def settings(self) -> dict:
        return {k: w.value for k, w in self.controls.items()}

    def _sync(self) -> None:
        """Grey out what the current setting ignores, so a control never looks like it did something it did not."""
        s = self.settings
        self.controls["prune_rate"].disabled = s["scheme"] != "w8a8-shadow"
        self.controls["chunk"].disabled = s["scheduler"] == "layer"

    def _quantized(self, scheme: str, prune_rate: float):
        from .quant import quantize

        key = (scheme, round(prune_rate, 4) if scheme == "w8a8-shadow" else None)
        if key not in self._qms:
            if scheme in ("w8a8", "w8a8-shadow") and self.calib is None:
                raise ValueError(f"{scheme} needs a calibration profile: "
                                 "TimelineExplorer(..., calib=calibration_profile(...))")
            kw = {"prune_rate": prune_rate} if scheme == "w8a8-shadow" else {}
            prof = self.calib if scheme in ("w8a8", "w8a8-shadow") else None
            self._qms[key] = quantize(self.model, scheme, prof, **kw)
        return self._qms[key]

    # ---- run and redraw -------------------------------------------------------------------------
    def run(self, raise_errors: bool = True):
        """Quantize (cached), run the prefill on the agent under the current settings, swap the figure's traces.
        A failure is shown in the panel; from the Run button (raise_errors=False) it is not raised but returned as
        None, so it cannot break the notebook's widget event loop."""
        from .trace import colouring, cosine, set_colouring

        s = self.settings
        self.button.disabled = True
        self.status.value = f"<i>running {html.escape(self.describe(s))} on the agent…</i>"
        t0 = time.perf_counter()
        self.error = None
        try:
            qm = self._quantized(s["scheme"], s["prune_rate"])
            dev = self._device()
            if s["scheduler"] == "layer":
                res = dev.prefill(qm, self.prompt, progress=False)
            else:
                res = dev.prefill_chunked(qm, self.prompt, chunk=s["chunk"], scheduler=s["scheduler"],
                                          cost_model=self.cost_model, progress=False)
        except Exception as e:  # noqa: BLE001  (the panel must survive a bad setting or a lost agent)
            self.status.value = f"<b style='color:#b00'>{html.escape(_sentence(e))}</b>"
            self.button.disabled = False
            self.error = e
            if raise_errors:
                raise
            return None
        m = res.trace.metrics()
        row = {**s, "makespan_ms": m["makespan_ms"], "wall_s": time.perf_counter() - t0,
               **{f"{lane}_busy_pct": v["busy_pct"] for lane, v in m["lanes"].items()},
               **{f"{lane}_bubble_ms": v["bubble_ms"] for lane, v in m["lanes"].items()}}
        pred = res.trace.meta.get("predicted_makespan_ms") or self._predict_layer(qm, s)
        if pred:  # the prediction's error beside the measurement, so a 2x miss is never silent
            row["predicted_makespan_ms"] = pred
            row["predicted_over_measured"] = pred / row["makespan_ms"]
        row["flash_read_mb"] = m.get("flash_read_bytes", 0) / 1e6  # a cold run's first reads: not in the prediction
        if self.check_host:
            row["cosine_vs_host"] = cosine(res.logits[0], qm.forward(self.prompt, logits="last"))
        self.result = res
        self.history.append(row)
        new = res.trace.figure(f"{self.model.name} prefill, {len(self.prompt)} tokens · {self.describe(s)}")
        new.update_layout(width=self.width)  # plotly's widget default (700 px) leaves a third of the output empty
        set_colouring(new, colouring(self.figure))  # a re-run keeps the colouring (kind or chunk) the reader chose
        with self.figure.batch_update():  # one message to the browser: the old bars go, the new ones come
            self.figure.data = ()
            self.figure.add_traces(list(new.data))
            self.figure.layout = new.layout
        bits = [f"makespan <b>{row['makespan_ms']:.0f} ms</b>"]
        if "predicted_makespan_ms" in row:
            name = getattr(self.cost_model, "name", self.cost_model)
            bits.append(f"predicted {row['predicted_makespan_ms']:.0f} ms = <b>{row['predicted_over_measured']:.2f}× "
                        f"measured</b> ({html.escape(str(name))})")
        if row["flash_read_mb"] > 0.5:
            bits.append(f"cold: {row['flash_read_mb']:.0f} MB first read from flash, not predicted")
        bits += [f"{lane} busy {v['busy_pct']:.0f}%" for lane, v in m["lanes"].items()]
        if "cosine_vs_host" in row:
            bits.append(f"cosine vs host {row['cosine_vs_host']:.5f}")
        self.status.value = (f"<i>{html.escape(self.notice)}</i><br>" if self.notice else "") + " · ".join(bits) + \
            f" <span style='color:#888'>(run {len(self.history)}, {row['wall_s']:.1f} s)</span>"
        self.notice = ""
        self.button.disabled = False
        return res

    @property
    def profile(self):
        """cost_model's old name, kept for code written against it."""
        return self.cost_model

    def snapshot(self):
        """The panel's timeline as a plain plotly Figure: what an exported page (no widget JavaScript) can show."""
        import plotly.graph_objects as go

        return go.Figure(self.figure)

    def _predict_layer(self, qm, s: dict):
        """The layer-by-layer plan's predicted makespan (ms): its ops as one chunk, in order, on the panel's cost
        model; None where the cost model cannot price it."""
        if s["scheduler"] != "layer":
            return None
        from .models import ModelConfig
        from .schedule import ScheduleError, chunk_graph, cost_model, schedule

        try:
            n = len(self.prompt)
            graph = chunk_graph(ModelConfig(**qm.manifest["config"]), n, n, manifest=qm.manifest)
            return schedule(graph, cost_model(self.cost_model), "in-order").makespan_us / 1e3
        except (ScheduleError, ValueError, KeyError):
            return None

    def _device(self):
        """The device to run on: the one given, or, once a later cell closed it (notebook 05's last cell does), a
        new one the panel opens like it and owns: a local agent again (its store keeps the uploaded blobs), or the
        same URL. An SSH device is not redeployed from a button press."""
        if not getattr(self.dev, "closed", False):
            return self.dev
        old = self.dev
        if getattr(old, "local_options", None) is not None:
            self.dev = type(old).local(**old.local_options, say=lambda m: None)
            self.notice = "The notebook's device was closed, so the panel started its own local agent."
        elif getattr(old, "tunnel", None) is None and getattr(old, "url", None):
            self.dev = type(old).connect(old.url)
            self.notice = f"The notebook's device was closed, so the panel reconnected to {old.url}."
        else:
            raise DeviceClosedError("The device was closed by a later cell; open it again (Device.ssh(...)) and make a "
                                    "new TimelineExplorer with it.")
        self.owns_device = True
        return self.dev

    def close(self) -> None:
        """Stop the agent the panel opened itself (a device passed in stays the caller's to close)."""
        if getattr(self, "owns_device", False):
            self.dev.close()

    @staticmethod
    def describe(s: dict) -> str:
        """A one-line name of a setting, e.g. "w8a8-shadow (prune 0.85), ooo, chunk 256"."""
        prune = f" (prune {s['prune_rate']:.2f})" if s["scheme"] == "w8a8-shadow" else ""
        parts = [s["scheme"] + prune, s["scheduler"]]
        if s["scheduler"] != "layer":
            parts.append(f"chunk {s['chunk']}")
        return ", ".join(parts)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.panel)
