"""OutlierStats: where the activation outliers are (mllm-NPU §3.3, Fig. 10-12; LLM.int8()).

Outlier rule. Each linear input tensor (hook points attn_in, attn_out, ffn_in, ffn_act of every
layer) gets a per-tensor symmetric int8 clip value c from calibration: c = the `percentile`-th
percentile (default 99.99) of |x| over the calibration tokens, so int8 scale s = c / 127 and
|x| > c is an outlier (mllm-NPU eq. 1: it goes to the CPU's float "shadow" GEMM). LLM.int8()'s
fixed threshold |x| > 6.0 is counted alongside as a second view.

Per channel, streamed: running max |x|, outlier counts (both views), a histogram of |x| / c in
octaves from 1/4 up; per tensor: tokens by number of outlier channels, channels with an outlier
per window. Memory is constant in the number of tokens.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from edgeprobe_kernels.activation_stats import (
    N_RATIO_BINS,
    RATIO_EDGES,
    keep_above,
    log2_bin_edges,
    log2_histogram,
    outlier_update,
    replay_outliers,
)
from edgeprobe_kernels.names import FFN_ACT_HOOK, LINEAR_HOOKS, layer_of
from edgeprobe_kernels.threads import beside

from ..models import Model
from ..models.config import memory_limit
from .base import Profile
from .runner import run

TENSOR_POINTS = LINEAR_HOOKS  # the hook points that are linears' inputs (kernels/names.py)
LLM_INT8_THRESHOLD = 6.0
# w8a8c-shadow's activation clip: with per-channel weight scales the int8 part tolerates a tight clip, and the
# values above it go to the float shadow GEMM: under 1% of them on held-out text. Held-out ppl vs float (8 x 256):
# SmolLM2 p99.99 1.045x, p99.9 1.025x, p99.1 1.006x, p99.0 1.002x; Gemma 3 p99.1 1.012x, p99.0 1.019x (1.02% in float)
CHANNEL_CLIP_PERCENTILE = 99.1


def tensor_names(model: Model) -> list[str]:
    """The linears' input points profiled, layer by layer; an MoE layer has no ffn_act (each expert has its own
    down projection's input, inside moe_ffn), so its FFN is profiled at ffn_in, the router's and experts' input."""
    moe = bool(model.config.n_experts)
    return [f"blk.{i}.{p}" for i in range(model.config.n_layers) for p in TENSOR_POINTS
            if not (moe and p == FFN_ACT_HOOK)]


def _percentile_from_hist(hist: np.ndarray, q: float) -> float:
    """q-th percentile (0-100) of the values binned by log2_histogram, log-interpolated in its bin."""
    edges = log2_bin_edges()
    cum = np.cumsum(hist)
    target = q / 100.0 * cum[-1]
    b = int(np.searchsorted(cum, target, side="left"))
    lo, hi = edges[b], edges[b + 1]
    before = cum[b - 1] if b else 0
    frac = (target - before) / max(hist[b], 1)
    if lo <= 0 or not np.isfinite(hi):
        return float(lo)
    return float(lo * (hi / lo) ** frac)


def calibrate_clips(model: Model, ids, percentile: float = 99.99, window: int = 512,
                    max_tokens: int | None = 16384, progress: bool = True) -> dict[str, float]:
    """Per-tensor clip values: the `percentile` of |x| at every linear input over `ids`.

    Streams a log-linear histogram per tensor (32 bins per octave), so the result is within ~1% of
    the exact percentile and memory stays constant. Returns {"blk.{i}.{point}": clip}.
    """
    return calibrate_clips_at(model, ids, [percentile], window, max_tokens, progress)[float(percentile)]


def calibrate_clips_at(model: Model, ids, percentiles, window: int = 512, max_tokens: int | None = 16384,
                       progress: bool = True, runner=None) -> dict[float, dict[str, float]]:
    """calibrate_clips at several percentiles from one pass: {percentile: {"blk.{i}.{point}": clip}}.

    runner: how the pass runs (default runner.run, in this process; profile.cluster.RayRunner shards it)."""
    percentiles = [float(p) for p in percentiles]
    bad = [p for p in percentiles if not 0 < p < 100]
    if bad:
        raise ValueError(f"percentile must be in (0, 100), got {bad[0]}")
    hists = (runner or run)(model, ids, ClipHistograms.for_model(model), window=window, max_tokens=max_tokens,
                            progress=progress, desc="calibrate")
    return hists.clips_at(percentiles)


# A calibration pass that keeps what the outlier pass would count (ClipHistograms.for_model(keep=...)) keeps every
# |x| >= a quarter of the first window's clip: ~1.2% of SmolLM2's entries, 8 bytes each (~10 MB per 1,000 tokens).
# Its counts stand for the outlier pass while the final clip is >= half the first window's (0.90x at least on
# SmolLM2's 1,024 training tokens); past KEEP_BYTES (or an eighth of the memory limit), or below that, the outlier
# pass runs as before.
KEEP_MARGIN = 4.0
KEEP_BYTES = 256 << 20


class ClipHistograms(Profile):
    """The calibration pass as a profile: |x| at every linear input in log-linear bins (32 per octave,
    kernels/activation_stats.log2_histogram), so shards of it merge exactly like any profile.

    keep (a percentile, with `fixed`): also keep what OutlierStats at that percentile would count of these same
    windows, so that OutlierStats.replay gives the outlier pass's statistics without running it: per tensor the
    running max |x| and the count beyond `fixed` (they need no clip), and each call's entries with |x| >= its
    first window's percentile / KEEP_MARGIN (`kept`, not saved or merged: a pass's own, dropped past KEEP_BYTES)."""

    KIND: ClassVar[str] = "clip-histograms"
    FIELDS: ClassVar[dict] = {"hist": "sum"}  # hist int64[8192] per tensor
    # a pass's own, never saved or merged (not dataclass fields): name -> {"t": kept from, "chmax", "count_fixed",
    # "calls": [(rows, idx int32, |x| float32)]}, or None (not keeping, or dropped past the budget)
    kept: ClassVar[dict | None] = None
    keep_at: ClassVar[float] = 99.99
    keep_fixed: ClassVar[float] = LLM_INT8_THRESHOLD
    keep_budget: ClassVar[int] = KEEP_BYTES
    kept_bytes: ClassVar[int] = 0

    @classmethod
    def for_model(cls, model: Model, keep: float | None = None,
                  fixed: float = LLM_INT8_THRESHOLD) -> "ClipHistograms":
        h = cls(model_name=model.name, model_sha256=model.sha256, params={"names": tensor_names(model)})
        if keep is not None:
            limit = memory_limit()[0]
            h.kept, h.keep_at, h.keep_fixed = {}, float(keep), float(fixed)
            h.keep_budget = KEEP_BYTES if limit is None else min(KEEP_BYTES, limit // 8)
        return h

    def hooks(self, model: Model) -> dict:
        self._check_model(model)

        def observe(name, x):
            def count():
                hist = self.arrays.setdefault(name, {"hist": np.zeros(8192, np.int64)})["hist"]
                log2_histogram(x, hist)
                if self.kept is not None:
                    self._keep(name, x, hist)
            beside(count)  # beside the next linear's GEMM (x is only read from here on)
        return {n: observe for n in self.params["names"]}

    def _keep(self, name: str, x: np.ndarray, hist: np.ndarray) -> None:
        k = self.kept.get(name)
        if k is None:  # the first window: its own percentile (hist holds it alone) sets the bar
            C = x.shape[1]
            k = self.kept[name] = {"t": _percentile_from_hist(hist, self.keep_at) / KEEP_MARGIN, "calls": [],
                                   "chmax": np.zeros(C, np.float32), "count_fixed": np.zeros(C, np.int64)}
        idx, vals = keep_above(x, k["t"], self.keep_fixed, k["chmax"], k["count_fixed"])
        k["calls"].append((x.shape[0], idx, vals))
        self.kept_bytes += idx.nbytes + vals.nbytes
        if self.kept_bytes > self.keep_budget:
            self.kept = None  # too many to keep: the outlier pass runs

    def replayable(self, clips: dict[str, float]) -> bool:
        """Whether `kept` holds every entry OutlierStats with these clips counts (|x| >= clip / 2: hist's lowest
        bin) for every tensor: OutlierStats.replay then gives the outlier pass's state exactly."""
        kept = self.kept
        return kept is not None and set(kept) == set(self.params["names"]) \
            and all(kept[n]["t"] <= 0.5 * float(clips[n]) for n in kept)

    def clips_at(self, percentiles) -> dict[float, dict[str, float]]:
        """{percentile: {tensor: the percentile of |x|}}, log-interpolated inside its bin."""
        return {float(p): {n: _percentile_from_hist(self.arrays[n]["hist"], float(p)) for n in self.params["names"]}
                for p in percentiles}


class OutlierStats(Profile):
    """Per-channel outlier statistics of every linear input. Build with `OutlierStats.for_model`."""

    KIND: ClassVar[str] = "outliers"
    POINTS: ClassVar[tuple] = TENSOR_POINTS  # the hook points profiled in each layer (figures draw one series each)
    # field: how shards combine. chmax float32[C]; count, count_fixed int64[C]; hist int64[C, bins];
    # tok_hist int64[C+1] tokens by number of outlier channels; win_channels int64[1] sum over windows
    # of channels with an outlier in that window.
    FIELDS: ClassVar[dict] = {"chmax": "max", "count": "sum", "count_fixed": "sum", "hist": "sum", "tok_hist": "sum",
              "win_channels": "sum"}

    @classmethod
    def for_model(cls, model: Model, clips: dict[str, float], percentile: float = 99.99,
                  fixed: float = LLM_INT8_THRESHOLD, clips_at: dict | None = None) -> "OutlierStats":
        """clips_at: {percentile: clips} calibrated beside `clips` (e.g. CHANNEL_CLIP_PERCENTILE for w8a8c-shadow)."""
        names = tensor_names(model)
        missing = [n for n in names if n not in clips]
        if missing:
            raise ValueError(f"clips lack {len(missing)} tensors (e.g. {missing[0]}); use calibrate_clips(model, ids)")
        params = {"clips": {n: float(clips[n]) for n in names}, "percentile": float(percentile),
                  "fixed_threshold": float(fixed), "ratio_edges": RATIO_EDGES.tolist(),
                  "clips_at": {f"{float(p):g}": {n: float(c[n]) for n in names} for p, c in (clips_at or {}).items()}}
        return cls(model_name=model.name, model_sha256=model.sha256, params=params)

    def clips_at(self, percentile: float) -> dict[str, float]:
        """Per-tensor clips at another percentile of the same calibration (ValueError if not calibrated)."""
        if float(percentile) == self.params["percentile"]:
            return self.params["clips"]
        got = self.params.get("clips_at", {}).get(f"{float(percentile):g}")
        if got is None:
            have = [self.params["percentile"]] + [float(p) for p in self.params.get("clips_at", {})]
            raise ValueError(f"this outlier profile has clips at percentiles {have}, not {percentile:g}; profile the "
                             f"model again with this edgeprobe (calibration_profile calibrates {percentile:g} too)")
        return got

    def replay(self, hists: ClipHistograms, chunks: list) -> None:
        """What a pass over `chunks` (the windows the calibration `hists` kept entries of, in order) adds, from those
        entries instead of a forward pass: the same state bit for bit (tests/test_profile.py). Refused (ValueError)
        unless hists.replayable(these clips)."""
        clips = self.params["clips"]
        if not hists.replayable(clips):
            raise ValueError("the calibration kept too few entries for these clips; run the outlier pass")
        shape = [len(chunks), sum(len(c) for c in chunks)]
        if any([len(k["calls"]), sum(r for r, _, _ in k["calls"])] != shape for k in hists.kept.values()):
            raise ValueError(f"the calibration kept entries of other windows than these {len(chunks)} "
                             f"({shape[1]} tokens); replay the windows it ran")
        for chunk in chunks:
            self.begin_window(chunk)
            self.end_window(len(chunk))
        for name, k in hists.kept.items():
            C = len(k["chmax"])
            st = self._state(name, C)
            np.maximum(st["chmax"], k["chmax"], out=st["chmax"])
            st["count_fixed"] += k["count_fixed"]
            for rows, idx, vals in k["calls"]:
                any_out = np.zeros(C, dtype=bool)
                replay_outliers(idx, vals, rows, C, clips[name], st["count"], st["hist"], st["tok_hist"], any_out)
                st["win_channels"] += int(any_out.sum())

    def _state(self, name: str, C: int) -> dict:
        st = self.arrays.get(name)
        if st is None:
            st = self.arrays[name] = {
                "chmax": np.zeros(C, np.float32), "count": np.zeros(C, np.int64),
                "count_fixed": np.zeros(C, np.int64), "hist": np.zeros((C, N_RATIO_BINS), np.int64),
                "tok_hist": np.zeros(C + 1, np.int64), "win_channels": np.zeros(1, np.int64)}
        return st

    def hooks(self, model: Model) -> dict:
        self._check_model(model)
        clips, fixed = self.params["clips"], self.params["fixed_threshold"]

        def observe(name, x):
            def count():
                st = self._state(name, x.shape[1])
                any_out = np.zeros(x.shape[1], dtype=bool)
                outlier_update(np.ascontiguousarray(x, dtype=np.float32), clips[name], fixed, st["chmax"],
                               st["count"], st["count_fixed"], st["hist"], st["tok_hist"], any_out)
                st["win_channels"] += int(any_out.sum())
            beside(count)  # beside the next linear's GEMM (x is only read from here on)
        return {n: observe for n in clips}

    # ---- derived: Fig. 10 ----------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.params["clips"])

    def _layers(self) -> int:
        return 1 + max(layer_of(n) for n in self.names)

    @property
    def points(self) -> tuple:
        """The POINTS this profile holds: all four for a dense model, no ffn_act for an MoE one (tensor_names)."""
        held = {n.split(".", 2)[2] for n in self.names}
        return tuple(p for p in self.POINTS if p in held)

    def channels_per_layer(self) -> dict[str, np.ndarray]:
        """Fig. 10: outlier channels per layer, float64[layers] for each point.

        Keys: "{point}_per_token" (mean channels with |x| > clip per token), "{point}_per_window"
        (mean distinct channels with an outlier per window = one inference), and "{point}_pct_window"
        (the same as % of the tensor's channels); "pct_window" averages the points (four; three in an MoE).
        """
        L, out = self._layers(), {}
        for p in self.points:
            tok, win, pct = np.zeros(L), np.zeros(L), np.zeros(L)
            for i in range(L):
                st = self.arrays.get(f"blk.{i}.{p}")
                if st is None:
                    continue
                C = len(st["chmax"])
                th = st["tok_hist"]
                tok[i] = (np.arange(C + 1) * th).sum() / max(th.sum(), 1)
                win[i] = st["win_channels"][0] / max(self.windows, 1)
                pct[i] = 100.0 * win[i] / C
            out[f"{p}_per_token"], out[f"{p}_per_window"], out[f"{p}_pct_window"] = tok, win, pct
        out["pct_window"] = np.mean([out[f"{p}_pct_window"] for p in self.points], axis=0)
        return out

    # ---- derived: Fig. 11 ----------------------------------------------------------------------
    def channel_share(self, names: list[str] | None = None, fixed: bool = False) -> np.ndarray:
        """Fig. 11: cumulative share of outliers by channel rank, float64[channels] in [0, 1].

        Channels of the given tensors (default all) are pooled and sorted by outlier count.
        """
        key = "count_fixed" if fixed else "count"
        counts = np.concatenate([self.arrays[n][key] for n in (names or self.names) if n in self.arrays])
        counts = np.sort(counts)[::-1].astype(np.float64)
        total = counts.sum()
        return np.cumsum(counts) / total if total else np.zeros_like(counts)

    def share_channels(self, share: float = 0.8, names: list[str] | None = None) -> float:
        """% of channels that produce `share` of all outliers (paper: < 3% produce > 80%)."""
        cum = self.channel_share(names)
        if not len(cum) or cum[-1] == 0:
            return float("nan")
        return 100.0 * (int(np.searchsorted(cum, share - 1e-12)) + 1) / len(cum)

    def hot_channels(self, coverage: float = 0.8) -> dict[str, np.ndarray]:
        """Per tensor, the fewest channels whose outliers cover `coverage` of the tensor's outliers.

        mllm-NPU keeps only these channels' weight rows in memory for the shadow GEMM.
        """
        hot = {}
        for n in self.names:
            c = self.arrays[n]["count"] if n in self.arrays else np.zeros(0)
            total = c.sum()
            if not total:
                hot[n] = np.zeros(0, dtype=np.int64)
                continue
            order = np.argsort(-c, kind="stable")
            k = int(np.searchsorted(np.cumsum(c[order]) / total, coverage - 1e-12)) + 1
            hot[n] = np.sort(order[:k])
        return hot

    # ---- derived: Fig. 12 ----------------------------------------------------------------------
    def importance(self) -> dict[str, float]:
        """Per tensor: max |x| / clip (mllm-NPU §3.3: larger = wider spread = larger int8 error)."""
        return {n: float(self.arrays[n]["chmax"].max() / self.params["clips"][n])
                for n in self.names if n in self.arrays}

    def layer_importance(self) -> np.ndarray:
        """Fig. 12: float64[layers], the largest importance of the layer's tensors."""
        imp, out = self.importance(), np.zeros(self._layers())
        for n, v in imp.items():
            i = layer_of(n)
            out[i] = max(out[i], v)
        return out

    def pruned_layers(self, prune_rate: float = 0.85) -> list[int]:
        """The `prune_rate` least important layers, whose outliers mllm-NPU drops (default 85%)."""
        if not 0 <= prune_rate <= 1:
            raise ValueError(f"prune_rate must be in [0, 1], got {prune_rate}")
        imp = self.layer_importance()
        k = int(np.floor(prune_rate * len(imp)))
        return sorted(np.argsort(imp, kind="stable")[:k].tolist())

    def pruned_tensors(self, prune_rate: float = 0.85) -> list[str]:
        """The same rule per tensor: the `prune_rate` least important linear inputs."""
        imp = self.importance()
        names = sorted(imp, key=lambda n: imp[n])
        return sorted(names[:int(np.floor(prune_rate * len(names)))])

    def smoothquant_scales(self) -> dict[str, np.ndarray]:
        """Per tensor name: float32[channels] max |x| per input channel (SmoothQuant's act scale s_j)."""
        return {n: self.arrays[n]["chmax"].copy() for n in self.names if n in self.arrays}

    def summary(self, coverage: float = 0.8, prune_rate: float = 0.85) -> dict:
        cpl = self.channels_per_layer()
        hot = self.hot_channels(coverage)
        n_hot = sum(len(v) for v in hot.values())
        n_all = sum(len(self.arrays[n]["chmax"]) for n in self.names if n in self.arrays)
        total = sum(int(self.arrays[n]["count"].sum()) for n in self.names if n in self.arrays)
        values = self.tokens * n_all
        return {
            "kind": self.KIND, "model": self.model_name, "tokens": self.tokens, "windows": self.windows,
            "percentile": self.params["percentile"],
            "outlier_fraction_of_values": total / values if values else 0.0,
            "fig10_outlier_channels_per_window_mean": float(np.mean([cpl[f"{p}_per_window"] for p in self.points])),
            "fig10_outlier_channels_pct_mean": float(cpl["pct_window"].mean()),
            "fig10_outlier_channels_pct_max_layer": float(cpl["pct_window"].max()),
            "fig10_outlier_channels_per_token_mean": float(np.mean([cpl[f"{p}_per_token"] for p in self.points])),
            "fig11_pct_channels_for_80pct_outliers": self.share_channels(0.8),
            "fig11_pct_channels_for_80pct_outliers_llm_int8": _share_pct(self.channel_share(fixed=True), 0.8),
            "hot_channels_coverage": coverage, "hot_channels": n_hot, "hot_channels_pct": 100.0 * n_hot / max(n_all, 1),
            "fig12_layer_importance": [round(v, 3) for v in self.layer_importance().tolist()],
            "prune_rate": prune_rate, "pruned_layers": self.pruned_layers(prune_rate),
            "kept_layers": sorted(set(range(self._layers())) - set(self.pruned_layers(prune_rate))),
        }

    def figure(self, kind: str = "channels"):
        from . import figures

        return figures.outlier_figure(self, kind)


def _share_pct(cum: np.ndarray, share: float) -> float:
    if not len(cum) or cum[-1] == 0:
        return float("nan")
    return 100.0 * (int(np.searchsorted(cum, share - 1e-12)) + 1) / len(cum)
