"""HeteroLLM's GPU–NPU tensor partitioning (§4.1, §4.3), on a modelled device: the solver and its baselines.

A prefill matmul x[M, K] @ W[K, N] on a phone SoC. The NPU runs only pre-built static graphs, so its
time is *stage-shaped*: M is padded to the next pre-built sequence length (or split into several, the
"pipe"). The GPU runs any shape at a fixed FLOP rate. Strategies for one matmul:
    gpu        all on the GPU
    npu-pad    all on the NPU, M padded to the next pre-built length (baseline "padding")
    pipe       all on the NPU as several pre-built lengths, largest first (baseline "pipe", multi-sequence)
    seq-cut    the NPU runs a sum of pre-built lengths <= M (multi-sequence cutting when more than one), the
               GPU the remaining rows, in parallel
    row-cut    the weight's output columns N split: the NPU's share (aligned) at the padded M, the GPU's at
               the exact M, in parallel — HeteroLLM's "hybrid" when M is not itself pre-built
The solver picks, per matmul shape, the strategy and split minimizing max(T_gpu, T_npu) + T_sync, where
while both run each lane goes slower by its slowdown (HeteroLLM §3 notes the two share memory bandwidth; on
this host they share the CPU cores too) — 1.0 on the modelled phone, measured on an agent.

Alignment: sequence splits are multiples of SEQ_ALIGN = 32 (the paper's); row splits are multiples of
ROW_ALIGN = 64 — the paper aligns rows to 256, which does not divide SmolLM2's 576-wide projections; 64
divides every SmolLM2 and Qwen1.5 dimension and is a multiple of HMX's 32-wide tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

from .graph import ScheduleError

SEQ_ALIGN = 32
ROW_ALIGN = 64
PREBUILT = (32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class HeteroCostModel:
    """npu_gops: int8 GEMM rate of the NPU on a pre-built graph; gpu_gflops: the GPU's fixed rate;
    launch_us per kernel; sync_us per GPU-NPU hand-off. Named ones are modelled; measure.measure_linears
    fits one to an agent (modelled=False)."""

    name: str
    npu_gops: float
    gpu_gflops: float
    npu_launch_us: float = 50.0
    gpu_launch_us: float = 30.0
    sync_us: float = 100.0
    prebuilt: tuple = PREBUILT
    source: str = ""
    modelled: bool = True
    slowdown_npu: float = 1.0  # time factor when the GPU runs at the same time (shared cores / memory bandwidth)
    slowdown_gpu: float = 1.0


def from_soc(soc) -> HeteroCostModel:
    """The solver's view of a SoC roofline (schedule.soc): the NPU's int8 rate and the GPU's, their launch costs,
    the SoC's sync (HeteroLLM §4.2's fast sync) and the NPU's pre-built lengths."""
    npu, gpu = soc.lane("npu"), soc.lane("gpu")
    return HeteroCostModel(soc.name, npu_gops=npu.rate("int8"), gpu_gflops=gpu.rate("fp16"),
                           npu_launch_us=npu.launch_us, gpu_launch_us=gpu.op_us, sync_us=soc.sync_us,
                           prebuilt=npu.stage_rows or PREBUILT, source=soc.source)


def _snapdragon():
    from .soc import load

    return from_soc(load("snapdragon-8gen3"))


# Snapdragon 8 Gen 3 as its roofline (schedule/soc/snapdragon-8gen3.json) gives it
SNAPDRAGON_HETERO = _snapdragon()
HETERO_COST_MODELS = {m.name: m for m in (SNAPDRAGON_HETERO,)}


@dataclass(frozen=True)
class Choice:
    strategy: str
    time_us: float
    npu_rows: int = 0        # sequence rows on the NPU (seq-cut), or M (row-cut)
    npu_cols: int = 0        # output columns on the NPU (row-cut)
    npu_parts: tuple = ()    # pre-built lengths the NPU runs
    padded_rows: int = 0     # rows of padding the NPU computes for nothing


def _npu_us(p: HeteroCostModel, m: int, k: int, n: int) -> float:
    return p.npu_launch_us + 2.0 * m * k * n / (p.npu_gops * 1e3)


def _gpu_us(p: HeteroCostModel, m: int, k: int, n: int) -> float:
    return 0.0 if m == 0 or n == 0 else p.gpu_launch_us + 2.0 * m * k * n / (p.gpu_gflops * 1e3)


def _side_by_side(p: HeteroCostModel, t_npu: float, t_gpu: float) -> float:
    """Time for NPU work t_npu and GPU work t_gpu (each alone) started together: while both run each goes
    at 1/slowdown of its speed, then the one left runs alone. max(t_npu, t_gpu) when slowdowns are 1."""
    a, b = t_npu * p.slowdown_npu, t_gpu * p.slowdown_gpu
    if a <= b:  # the NPU finishes first; the GPU did a / slowdown_gpu of its work meanwhile
        return a + (t_gpu - a / p.slowdown_gpu)
    return b + (t_npu - b / p.slowdown_npu)


def pad_to_prebuilt(p: HeteroCostModel, m: int) -> int:
    for L in p.prebuilt:
        if L >= m:
            return L
    return -(-m // p.prebuilt[-1]) * p.prebuilt[-1]  # beyond the largest graph: several of it


def pipe_parts(p: HeteroCostModel, m: int) -> tuple:
    """Pre-built lengths covering m, largest first; the remainder padded to the smallest length >= it."""
    parts, left = [], m
    for L in sorted(p.prebuilt, reverse=True):
        while left >= L:
            parts.append(L)
            left -= L
    if left:
        parts.append(pad_to_prebuilt(p, left))
    return tuple(parts)


def candidates(p: HeteroCostModel, m: int, k: int, n: int) -> list[Choice]:
    """Every strategy's best variant for one matmul x[m, k] @ W[k, n]."""
    if m < 1 or k < 1 or n < 1:
        raise ScheduleError(f"matmul shape must be positive, got M={m}, K={k}, N={n}")
    out = [Choice("gpu", _gpu_us(p, m, k, n))]
    mp = pad_to_prebuilt(p, m)
    padded = (mp,) if mp in p.prebuilt else (p.prebuilt[-1],) * (mp // p.prebuilt[-1])  # the graphs the NPU runs
    out.append(Choice("npu-pad", sum(_npu_us(p, L, k, n) for L in padded), m, n, padded, mp - m))
    parts = pipe_parts(p, m)
    out.append(Choice("pipe", sum(_npu_us(p, L, k, n) for L in parts), m, n, parts, sum(parts) - m))
    # seq-cut: the NPU takes full pre-built lengths (greedy from the largest) up to m, the GPU the rest
    best = None
    full, left = [], m
    for L in sorted(p.prebuilt, reverse=True):
        while left >= L:
            full.append(L)
            left -= L
    for j in range(1, len(full) + 1):
        npu_rows = sum(full[:j])
        if npu_rows % SEQ_ALIGN:
            continue
        t = _side_by_side(p, sum(_npu_us(p, L, k, n) for L in full[:j]), _gpu_us(p, m - npu_rows, k, n)) + p.sync_us
        if best is None or t < best.time_us:
            best = Choice("seq-cut", t, npu_rows, n, tuple(full[:j]), 0)
    if best is not None:
        out.append(best)
    # row-cut: NPU's column share (aligned) at padded m, GPU's share at exact m
    best = None
    for n_npu in range(ROW_ALIGN, n, ROW_ALIGN):
        t_npu = sum(_npu_us(p, L, k, n_npu) for L in padded)
        t = _side_by_side(p, t_npu, _gpu_us(p, m, k, n - n_npu)) + p.sync_us
        if best is None or t < best.time_us:
            best = Choice("row-cut", t, m, n_npu, padded, mp - m)
    if best is not None:
        out.append(best)
    return out


def solve(p: HeteroCostModel, m: int, k: int, n: int) -> Choice:
    """The fastest strategy for one matmul (ties: the simpler strategy, in candidates' order)."""
    return min(candidates(p, m, k, n), key=lambda c: c.time_us)


def model_matmuls(config) -> list[tuple[str, int, int]]:
    """(name, K, N) of one layer's prefill matmuls (x @ W with W [K, N])."""
    h, q, kv = config.hidden, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return [("attn_q", h, q), ("attn_k", h, kv), ("attn_v", h, kv), ("attn_output", q, h),
            ("ffn_gate", h, config.ffn), ("ffn_up", h, config.ffn), ("ffn_down", config.ffn, h)]


STRATEGIES = ("solver", "gpu", "npu-pad", "pipe", "seq-cut", "row-cut")


def choices_for(config, prompt_len: int, p: HeteroCostModel = SNAPDRAGON_HETERO, strategy: str = "solver") -> dict:
    """{matmul name: Choice} for one prompt length: the solver's pick per shape, or one fixed strategy
    (a baseline; seq-cut / row-cut fall back to the solver's pick where the shape cannot be cut so)."""
    if strategy not in STRATEGIES:
        raise ScheduleError(f"unknown partition strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if prompt_len < 1:
        raise ScheduleError(f"prompt length must be positive, got {prompt_len}")
    out = {}
    for name, k, n in model_matmuls(config):
        cands = {c.strategy: c for c in candidates(p, prompt_len, k, n)}
        best = min(cands.values(), key=lambda c: c.time_us)
        out[name] = best if strategy == "solver" else cands.get(strategy, best)
    return out


DECODE_PREBUILT = (1, 2, 4, 8, 16)


def decode_choices(config, batch: int, p: HeteroCostModel = SNAPDRAGON_HETERO, strategy: str = "solver") -> dict:
    """{matmul: Choice} for decode steps of `batch` sequences (M = batch rows): the NPU has graphs built for
    the decode batch sizes, so decode splits are row cuts (output channels) or one lane alone — HeteroLLM
    uses the two processors' memory bandwidth together."""
    import dataclasses

    return choices_for(config, batch, dataclasses.replace(p, prebuilt=tuple(sorted(set(DECODE_PREBUILT + p.prebuilt)))),
                       strategy)


def compare_strategies(config, prompt_len: int, p: HeteroCostModel = SNAPDRAGON_HETERO) -> dict:
    """Prefill matmul time (all layers) under the solver and under each fixed strategy, and the solver's
    choice per matmul — at one prompt length."""
    if prompt_len < 1:
        raise ScheduleError(f"prompt length must be positive, got {prompt_len}")
    totals: dict = {}
    choices = {}
    for name, k, n in model_matmuls(config):
        cands = {c.strategy: c for c in candidates(p, prompt_len, k, n)}
        best = min(cands.values(), key=lambda c: c.time_us)
        choices[name] = best
        for s, c in cands.items():
            totals[s] = totals.get(s, 0.0) + c.time_us * config.n_layers
        totals["solver"] = totals.get("solver", 0.0) + best.time_us * config.n_layers
    # "profile" is the field's first name (saved results read it); "cost_model" says the same
    return {"prompt_len": prompt_len, "cost_model": p.name, "profile": p.name, "modelled": p.modelled,
            "total_ms": {s: t / 1e3 for s, t in totals.items()},
            "speedup_vs_padding": totals["npu-pad"] / totals["solver"],
            "speedup_vs_pipe": totals["pipe"] / totals["solver"],
            "choices": {n: c.__dict__ for n, c in choices.items()}}


# the old names, kept for code written against them ("profile" now means a corpus statistic only)
HeteroProfile = HeteroCostModel
HETERO_PROFILES = HETERO_COST_MODELS
