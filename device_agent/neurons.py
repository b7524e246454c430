"""FFN neurons streamed from flash (LLM in a flash §3): the `ffn_flash` op and its DRAM window.

Each layer's FFN lives on flash as one bundle float16[ffn, 3, hidden]: neuron j's gate row, up row and
down column side by side (row-column bundling: one read per neuron). Per decode step a low-rank predictor
p = sigmoid((x A) B + b) picks the neurons likely active (p > cutoff); those not already in DRAM are read
from the bundle file; the neurons used in the last `window` tokens stay resident in a preallocated matrix
(delete = move the last rows into the holes, insert = append). Modes: "sparse" (that), "dense" (every
neuron read from flash every step: dense loading without enough DRAM).
"""
from __future__ import annotations

import numpy as np

from edgeprobe_kernels.llama_ops import swiglu_act
from edgeprobe_kernels.neurons import predicted_mask

from .ops.registry import OpError, _arr


class NeuronWindow:
    """Neurons of one layer resident in DRAM: mat float32[3, capacity, hidden] (gate rows, up rows, down
    columns), slots 0..n-1 in use — contiguous, so one GEMM covers them; slot_of[neuron] (-1: on flash
    only), neuron_of[slot], last[slot] = the step that last used it."""

    def __init__(self, ffn: int, hidden: int, window: int):
        self.window = window
        self.mat = np.empty((3, ffn, hidden), np.float32)
        self.slot_of = np.full(ffn, -1, np.int64)
        self.neuron_of = np.empty(ffn, np.int64)
        self.last = np.empty(ffn, np.int64)
        self.n = 0
        self.step = 0

    def update(self, active: np.ndarray, read_rows) -> dict:
        """One step: mark `active` used, drop neurons unused for `window` steps, load the missing ones."""
        self.step += 1
        slots = self.slot_of[active]
        have = slots >= 0
        self.last[slots[have]] = self.step
        stale = np.nonzero(self.last[:self.n] <= self.step - self.window)[0]
        evicted = len(stale)
        if evicted:  # move the last live rows into the holes (one gather, no shifting)
            keep_n = self.n - evicted
            holes = stale[stale < keep_n]
            tail = np.arange(keep_n, self.n)
            movers = tail[~np.isin(tail, stale)]
            self.slot_of[self.neuron_of[stale]] = -1
            self.mat[:, holes] = self.mat[:, movers]
            self.neuron_of[holes] = self.neuron_of[movers]
            self.last[holes] = self.last[movers]
            self.slot_of[self.neuron_of[holes]] = holes
            self.n = keep_n
        new = active[self.slot_of[active] < 0]
        if len(new):
            rows = read_rows(new)
            s = np.arange(self.n, self.n + len(new))
            self.mat[:, s] = rows.transpose(1, 0, 2)
            self.neuron_of[s] = new
            self.last[s] = self.step
            self.slot_of[new] = s
            self.n += len(new)
        return {"loaded": int(len(new)), "evicted": int(evicted), "resident": int(self.n)}


def op_ffn_flash(inp, attrs, ctx):
    """inputs: x float32[T, hidden] (after ffn_norm), predictor A float32[hidden, r], B float32[r, ffn],
    b float32[ffn]. attrs: bundle (sha of float16[ffn, 3, hidden]), ffn_layer, cutoff, window, mode."""
    x, A, B, b = (_arr(a, n, d) for a, n, d in zip(inp, ("x", "A", "B", "b"), (2, 2, 2, 1)))
    if ctx.session is None:
        raise OpError("no_session", "ffn_flash keeps its neuron window in a decode session; run it in one")
    mode, layer = attrs.get("mode", "sparse"), int(attrs["ffn_layer"])
    ffn, hidden = B.shape[1], x.shape[1]
    read = lambda rows: ctx.read_rows(attrs["bundle"], rows)  # traced on the io lane
    if mode == "dense":
        W = read(np.arange(ffn)).astype(np.float32)
        act = swiglu_act(x @ W[:, 0].T, x @ W[:, 1].T)
        out = act @ W[:, 2]
        stats = {"loaded": ffn, "evicted": ffn, "resident": 0, "active": ffn}
    elif mode == "sparse":
        active = np.nonzero(predicted_mask(x, A, B, b, float(attrs["cutoff"])).any(axis=0))[0]  # a prompt: the union
        wins = ctx.session.extras.setdefault("neurons", {})
        win = wins.get(layer)
        if win is None:
            win = wins[layer] = NeuronWindow(ffn, hidden, int(attrs.get("window", 5)))
        stats = {**win.update(active, read), "active": len(active)}
        n = win.n
        use = np.zeros(n, np.float32)  # resident but not predicted for this step: computed, then masked
        use[win.slot_of[active]] = 1.0
        act = swiglu_act(x @ win.mat[0, :n].T, x @ win.mat[1, :n].T) * use
        out = act @ win.mat[2, :n]
    else:
        raise OpError("bad_attrs", f"ffn_flash mode must be 'sparse' or 'dense', got {str(mode)[:20]!r}")
    for k, v in stats.items():
        ctx.counters[f"neurons_{k}"] = ctx.counters.get(f"neurons_{k}", 0) + v
    return out
