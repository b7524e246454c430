"""The predicted schedule of a model's chunked prefill: the one computation behind `edgeprobe schedule`,
`edgeprobe run --scheduler in-order|ooo` (workflows.prefill_chunked), the demo's predictions and notebook 08."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .graph import ScheduleError, chunk_graph
from .schedulers import schedule


def plan_of(model, scheme: str = "w8a8-shadow") -> dict:
    """What predicted_schedule reads, from a QuantizedModel's manifest (returned as is) or a model known only by its
    configuration — a ModelConfig, a Model (config-only or not: its config), a config.json path or folder (any path
    models.load reads) — planned with `scheme`'s stand-in records (models.plan_manifest: float, w8a8, w8a8-shadow)."""
    from .. import models
    from ..models import ModelConfig
    from ..models.config import plan_manifest

    if isinstance(model, dict) and "config" in model:
        return model
    if isinstance(model, (str, Path)):
        path = Path(model)
        if path.is_dir() and (path / "config.json").is_file():
            path = path / "config.json"  # an HF folder plans from its config: its weights are not read nor hashed
        model = models.load(path)
    cfg = getattr(model, "config", model)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"predicted_schedule needs a QuantizedModel's manifest, a ModelConfig, a Model or a "
                        f"config.json path, not {type(model).__name__}")
    return plan_manifest(cfg, scheme)


def predicted_schedule(manifest, prompt_len: int, chunk: int, scheduler: str, cost, scheme: str = "w8a8-shadow"):
    """A model -> (ChunkGraph, Schedule) over `cost` (a CostModel object).

    manifest: a QuantizedModel's manifest — the graph comes from its records, so the scheme's shadow-outlier GEMMs
    are the layers it keeps (mllm-NPU prunes the outliers of the 85% least important layers), not every layer — or a
    config-only model (see plan_of), planned under `scheme`. A cost model that prices op by op (a FittedCostModel:
    weight bytes and token rows per op) is bound to the graph first."""
    from ..models import ModelConfig

    manifest = plan_of(manifest, scheme)
    graph = chunk_graph(ModelConfig(**manifest["config"]), prompt_len, chunk, manifest=manifest)
    if hasattr(cost, "for_graph"):
        cost = cost.for_graph(graph)
    return graph, schedule(graph, cost, scheduler)


# ---- a phone's prefill and decode from a config alone ---------------------------------------------------------------
# The papers' ways of running a model on a phone SoC (edgeprobe predict --strategy): which lane runs what.
STRATEGIES = {
    "mllm-npu": "mllm-NPU: chunked prefill, int8 linears and norms on the NPU, attention and shadow outliers on the "
                "CPU, subgraphs out of order (§3.2-3.4); decode on the CPU",
    "hetero": "HeteroLLM: layer by layer, every linear's rows cut between GPU and NPU (§4.1) at their bandwidth "
              "together, attention and the rest on the GPU; decode the same",
    "gpu": "everything on the GPU",
    "npu": "everything on the NPU (HMX matmuls, HVX the rest), the LM head's logits on the CPU (the NPU "
           "test-time-scaling paper's decode)",
    "cpu": "everything on the CPU",
}
STRATEGY_ALIASES = {"mllm": "mllm-npu", "heterollm": "hetero", "gpu-only": "gpu", "npu-only": "npu", "cpu-only": "cpu"}
_ONE_LANE = {"gpu": "gpu", "npu": "npu", "cpu": "cpu"}


@dataclass
class Phase:
    """One phase's prediction: its time, the lanes' busy shares, and what bound it (the share of its time bound
    by compute, bandwidth, overhead and flash reads; `bound` is the largest)."""

    ms: float
    lanes: dict            # lane -> % of the phase's time busy
    shares: dict           # compute | bandwidth | overhead | flash -> % of the summed op time
    trace: object = None   # a predicted Trace of it

    @property
    def bound(self) -> str:
        return max(self.shares, key=self.shares.get) if self.shares else "none"


@dataclass
class Prediction:
    """What a phone should give for a model (edgeprobe predict): prefill and decode, from a config alone."""

    model: str
    soc: str
    scheme: str
    strategy: str
    prompt_len: int
    chunk: int
    decode: int
    batch: int
    prefill: Phase
    decode_step: Phase | None
    priced_from: str
    notes: list = field(default_factory=list)

    @property
    def prefill_ms(self) -> float:
        return self.prefill.ms

    @property
    def prefill_tok_s(self) -> float:
        return 1e3 * self.prompt_len / self.prefill.ms

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second of each sequence (one step makes one token of each of `batch` sequences)."""
        return None if self.decode_step is None else 1e3 / self.decode_step.ms

    @property
    def decode_tok_s_batch(self) -> float | None:
        return None if self.decode_step is None else self.batch * 1e3 / self.decode_step.ms

    def to_json(self) -> dict:
        d = self.decode_step
        return {"model": self.model, "soc": self.soc, "scheme": self.scheme, "strategy": self.strategy,
                "prompt_len": self.prompt_len, "chunk": self.chunk, "decode": self.decode, "batch": self.batch,
                "prefill_ms": self.prefill_ms, "prefill_tok_s": self.prefill_tok_s,
                "decode_ms_per_step": None if d is None else d.ms,
                "decode_tok_s": self.decode_tok_s, "decode_tok_s_batch": self.decode_tok_s_batch,
                "lanes": {"prefill": self.prefill.lanes, **({"decode": d.lanes} if d else {})},
                "bound": {"prefill": self.prefill.bound, **({"decode": d.bound} if d else {})},
                "shares": {"prefill": self.prefill.shares, **({"decode": d.shares} if d else {})},
                "priced_from": self.priced_from, "notes": self.notes, "modelled": True}


def _shares(costs) -> dict:
    """% of the summed op time by what bound each op (flash loads counted apart)."""
    tot: dict = {"compute": 0.0, "bandwidth": 0.0, "overhead": 0.0, "flash": 0.0}
    for c, flash_us in costs:
        if c is not None:
            tot[c.bound] += c.us
        tot["flash"] += flash_us
    s = sum(tot.values()) or 1.0
    return {k: round(100.0 * v / s, 1) for k, v in tot.items() if v > 0}


def _lane_of(op: dict, strategy: str, decode: bool) -> str:
    """The lane `strategy` runs a template op on (decode: a step's op). "split" = HeteroLLM's GPU+NPU row cut."""
    kind = op["cost"][0]
    if strategy in _ONE_LANE:
        if strategy == "npu" and op["kind"] == "lm_head" and decode:
            return "cpu"  # the TTS paper samples on the CPU: the logits' matmul runs there
        return _ONE_LANE[strategy]
    if strategy == "hetero":
        return "split" if kind in ("int8_linear", "linear") and op["kind"] in ("linear", "lm_head", "moe_ffn") \
            else "gpu"
    # mllm-npu: decode on the CPU backend; prefill by stage (graph.place.DEFAULT_STAGE_LANES)
    if decode:
        return "cpu"
    from ..graph import DEFAULT_STAGE_LANES

    return DEFAULT_STAGE_LANES[op["stage"]]


def predict(model, soc="snapdragon-8gen3", prompt_len: int = 256, decode: int = 0, batch: int = 1,
            scheme: str = "w8a8-shadow", strategy: str = "mllm-npu", chunk: int = 256, scheduler: str = "ooo",
            expert_hit_rate: float | None = None, experts_in_flash: bool = False,
            ffn_sparsity: float | None = None, ffn_reuse: float = 0.0, sync: str = "fast") -> Prediction:
    """A model's prefill of `prompt_len` tokens and, with `decode` > 0, its decode steps, on a phone SoC, from its
    configuration alone (no weights). model: a config.json / HF folder / GGUF path, a ModelConfig or a Model; soc:
    a SoC's name or file (schedule.soc) or a SocCostModel; strategy: STRATEGIES.

    prefill: mllm-npu runs the chunk graph (chunks of `chunk`) under `scheduler`; the others one chunk of the whole
        prompt, op after op. decode: `batch` sequences decoded together (the TTS paper's Best-of-N), over a context
        of prompt_len + decode / 2 (the mean of the steps), op after op.
    MoE (EdgeMoE): with experts_in_flash, each step reads the routed experts a buffer misses (1 - expert_hit_rate;
        an expert profile's hit rate, e.g. profile.expert_cache) from flash at the SoC's flash bandwidth.
    Dense FFN rows from flash (LLM in a flash): ffn_sparsity = the share of FFN neurons active per token (their
        rows computed and read), ffn_reuse = the share of those already in DRAM (the sliding window's); the rest
        read from flash. sync: "fast" (HeteroLLM §4.2's sleep-then-poll) or "conventional" (the SoC's cost of
        an ordinary synchronisation) wherever work crosses lanes."""
    from ..graph import Weights, model_ops
    from ..models import ModelConfig

    strategy = STRATEGY_ALIASES.get(strategy, strategy)
    if strategy not in STRATEGIES:
        raise ScheduleError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    for what, v in (("prompt length", prompt_len), ("batch", batch)):
        if not isinstance(v, int) or v < 1:
            raise ScheduleError(f"{what} must be a positive whole number, got {v!r}")
    if not isinstance(decode, int) or decode < 0:
        raise ScheduleError(f"decode must be 0 or more tokens, got {decode!r}")
    for what, v in (("expert_hit_rate", expert_hit_rate), ("ffn_sparsity", ffn_sparsity), ("ffn_reuse", ffn_reuse)):
        if v is not None and not 0.0 <= v <= 1.0:
            raise ScheduleError(f"{what} must lie in [0, 1], got {v!r}")
    cost = soc_model(soc)
    if sync not in ("fast", "conventional"):
        raise ScheduleError(f"sync must be 'fast' (HeteroLLM §4.2) or 'conventional', got {sync!r}")
    if sync == "conventional":
        from dataclasses import replace

        cost = replace(cost, sync_us=cost.sync_conventional_us)
    name = getattr(model, "name", None) or "model"
    if isinstance(model, (str, Path)):  # a folder, or a config.json, is named after its folder; a file after itself
        path = Path(model)
        name = path.parent.name if path.name == "config.json" else path.name if path.is_dir() else (
            path.stem if path.suffix == ".gguf" else str(model))
    plan = plan_of(model, scheme)
    cfg = ModelConfig(**plan["config"])
    if prompt_len > cfg.context_length:
        raise ScheduleError(f"prompt length {prompt_len} exceeds the model's context length {cfg.context_length}")
    if experts_in_flash and not cfg.n_experts:
        raise ScheduleError(f"{name} is dense: experts from flash need a mixture-of-experts config")
    if ffn_sparsity is not None and cfg.n_experts:
        raise ScheduleError(f"{name} is a mixture of experts: FFN rows from flash stream dense FFNs (LLM in a flash)")
    notes = [f"{cost.name}: every number from a component measurement or a specification (its file names each)"]
    # ---- prefill
    if strategy == "mllm-npu":
        graph = chunk_graph(cfg, prompt_len, min(chunk, prompt_len), manifest=plan)
        bound = cost.for_graph(graph)
        sched = schedule(graph, bound, scheduler)
        costs = [(bound.op_cost(op, lane), 0.0) for g in graph.subgraphs for lane in (sched.slots[g.name][0],)
                 for op in graph.ops_of()[g.name]]
        prefill = Phase(sched.makespan_us / 1e3, {k: round(v, 1) for k, v in sched.busy().items()}, _shares(costs),
                        sched.to_trace())
        used_chunk = graph.chunk_len
    else:
        ops = model_ops(Weights.of(plan), prompt_len)
        prefill = _sequential(cost, ops, strategy, decode=False, title=f"predicted prefill: {strategy} on {cost.name}")
        used_chunk = prompt_len
    # ---- decode
    step = None
    if decode:
        ctx = prompt_len + decode // 2
        if ctx > cfg.context_length:
            raise ScheduleError(f"prompt {prompt_len} + {decode} decoded tokens exceed the model's context length "
                                f"{cfg.context_length}")
        ops = model_ops(Weights.of(plan), 1, batch=batch, session=True)
        step = _sequential(cost, ops, strategy, decode=True, kv_len=ctx, batch=batch,
                           hit_rate=expert_hit_rate if experts_in_flash else None, ffn_sparsity=ffn_sparsity,
                           ffn_reuse=ffn_reuse, title=f"predicted decode step: {strategy} on {cost.name}")
        if experts_in_flash:
            notes.append(f"experts from flash at {cost.flash_gbs:g} GB/s, buffer hit rate "
                         f"{0.0 if expert_hit_rate is None else expert_hit_rate:.2f}")
        if ffn_sparsity is not None:
            notes.append(f"FFN rows: {100 * ffn_sparsity:.0f}% active, {100 * ffn_reuse:.0f}% of those in DRAM, the "
                         f"rest from flash at {cost.flash_gbs:g} GB/s")
    return Prediction(name, cost.name, scheme, strategy, prompt_len, used_chunk, decode, batch, prefill, step,
                      plan["planned"]["priced_from"] if "planned" in plan else "the quantized model's records",
                      notes)


def soc_model(soc):
    """A SoC's roofline from a name or file (schedule.soc), a SocCostModel, or a cost model fitted from a real trace
    (a FittedCostModel or its .json: its fitted lanes and kinds over its base SoC's roofline)."""
    from . import soc as _soc
    from .cost import FittedCostModel, cost_model

    if isinstance(soc, _soc.SocCostModel):
        return soc
    if isinstance(soc, FittedCostModel):
        return soc.as_soc()
    if str(soc).endswith(".json") and not _soc.is_soc_file(soc):
        m = cost_model(str(soc))
        if isinstance(m, FittedCostModel):
            return m.as_soc()
        raise ScheduleError(f"{soc}: a cost model measured on an agent prices this host's lanes, not a phone's: give "
                            "a SoC (name or file) or a model fitted from a phone's trace (trace import --fit)")
    return _soc.load(soc)


def _expert_bytes(op: dict, batch: int) -> float:
    """An MoE layer's routed experts' weight bytes read a step: with a batch, the distinct experts of `batch` tokens,
    E (1 - (1 - k/E)^batch) on average under uniform routing."""
    a = op["attrs"]
    E, k = len(a["experts"]), a["k"]
    per = op["cost"][2] / max(E, 1)
    return E * (1.0 - (1.0 - k / E) ** batch) * per


def _sequential(cost, ops, strategy, decode, title, kv_len=None, batch=1, hit_rate=None, ffn_sparsity=None,
                ffn_reuse=0.0) -> Phase:
    """Ops run one after another, each on the lane `strategy` gives it (a split: both lanes at once), with one
    sync where consecutive ops change lane. Returns the Phase with its predicted timeline."""
    from ..trace import Trace

    t, prev, events, costs, busy = 0.0, None, [], [], {}
    ffn = ("ffn_gate", "ffn_up", "ffn_down")
    for op in ops:
        lane = _lane_of(op, strategy, decode)
        kv = kv_len if op["kind"] == "attention" and kv_len is not None else None
        wb, flash_us, extra = None, 0.0, {}
        if op["kind"] == "moe_ffn" and decode:
            wb = _expert_bytes(op, batch)
            if hit_rate is not None:
                flash_us = (1.0 - hit_rate) * wb / (cost.flash_gbs * 1e3)
                extra["flash_bytes"] = (1.0 - hit_rate) * wb
        elif ffn_sparsity is not None and decode and op["kind"] == "linear" and op["name"].rsplit(".", 1)[-1] in ffn:
            op = {**op, "cost": [op["cost"][0], op["cost"][1] * ffn_sparsity, op["cost"][2] * ffn_sparsity]}
            if op["name"].endswith("ffn_gate"):  # one bundle read per new neuron: its gate, up and down rows
                bundle = 3 * op["cost"][2]
                flash_us = (1.0 - ffn_reuse) * bundle / (cost.flash_gbs * 1e3)
                extra["flash_bytes"] = (1.0 - ffn_reuse) * bundle
        if lane == "split":
            c = cost.split_cost(op, kv_len=kv) if wb is None else cost.split_cost(
                {**op, "cost": [op["cost"][0], op["cost"][1], wb]}, kv_len=kv)
            lanes_here = ("gpu", "npu")
        else:
            c = cost.op_cost(op, lane, kv, weight_bytes=wb)
            lanes_here = (lane,)
        if prev is not None and prev != lanes_here:
            t += cost.sync_us
        d = c.us + flash_us
        for ln in lanes_here:
            events.append({"name": op["name"], "kind": op["kind"], "lane": ln, "layer": op["layer"],
                           "chunk": op["chunk"], "group": op["group"], "start_us": t, "end_us": t + d,
                           "bytes_in": c.nbytes, "bytes_out": 0, "flops": c.flops, "emulated": False,
                           "modelled": True, "predicted": True, "bound": c.bound, "shape": list(op["shape"]),
                           **extra})
            busy[ln] = busy.get(ln, 0.0) + d
        costs.append((c, flash_us))
        t += d
        prev = lanes_here
    span = max(t, 1e-9)
    trace = Trace(events, {"title": title, "modelled": True, "predicted": True, "cost_model": cost.name,
                           "profile": cost.name})
    return Phase(t / 1e3, {k: round(100.0 * v / span, 1) for k, v in sorted(busy.items())}, _shares(costs), trace)
