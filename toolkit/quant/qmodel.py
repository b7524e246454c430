"""QuantizedModel: a manifest (JSON) plus content-addressed blobs, runnable by the one forward pass.

On disk, a folder:
  manifest.json   format "edgeprobe-quantized", format_version 1, scheme, model {name, sha256},
                  config (ModelConfig fields), tokenizer (blob id of its JSON), tensors {name: blob id}
                  for the float tensors (embedding, norms), linears {name: record} (a record's `scheme` names
                  its recipe, schemes.py says what each holds; records saved before name it `kind`, still read),
                  head (a q8_0 record, or null), blobs {sha256: {dtype, shape, nbytes, role}}, params, bytes
  blobs/<sha256>  raw little-endian array bytes; verified against the name on load
"""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgeprobe_kernels.linear_records import scheme_of
from edgeprobe_kernels.names import layer_of
from edgeprobe_kernels.q8_0 import QK, matmul_q8_0, quantize_q8_0

from .. import __version__
from ..errors import ManifestError, StatsMismatchError, UnknownSchemeError, UnsupportedModelError
from ..forward import forward, is_router, linear_names, linear_tensor
from ..models import Model, ModelConfig, Tokenizer
from ..models.weights import LazyWeights
from ..profile.outliers import CHANNEL_CLIP_PERCENTILE
from .blobs import BlobStore
from .schemes import MOE_ONLY, NEEDS_PROFILE, SCHEMES, build_float, input_point, record

FORMAT, FORMAT_VERSION = "edgeprobe-quantized", 1


@dataclass
class QuantizedModel:
    scheme: str
    manifest: dict
    store: BlobStore
    counters: Counter = field(default_factory=Counter)

    def __post_init__(self):
        self._runners = {}
        self._model = None
        self._tokenizer = None  # quantize() hands over the model's own: parsing the blob back costs 1.2 s on Gemma 3

    # ---- running ----------------------------------------------------------------------------------
    @property
    def model(self) -> Model:
        """A Model whose float tensors (embedding, norms) come from the blobs; linears go through `linear`."""
        if self._model is None:
            m = self.manifest
            tok = self._tokenizer
            if tok is None and m.get("tokenizer"):
                tok = Tokenizer.from_json(json.loads(self.store.get(m["tokenizer"]).tobytes().decode()))
            loaders = {n: (lambda sha=sha: self.store.get(sha)) for n, sha in m["tensors"].items()}
            self._model = Model(config=ModelConfig(**m["config"]), tokenizer=tok, weights=LazyWeights(loaders, None),
                                source=f"quantized:{self.scheme}", sha256=m["model"]["sha256"],
                                name=m["model"]["name"], meta={"format": FORMAT, "scheme": self.scheme},
                                head=self.head if m.get("head") else None)
        return self._model

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        """y = x @ W^T computed as this scheme computes it; x float32[M, K] -> float32[M, N]."""
        run = self._runners.get(name)
        if run is None:
            rec = self.manifest["linears"][name]
            run = self._runners[name] = SCHEMES[scheme_of(rec)][1](rec, self.store.get, self.counters)
        return run(x)

    def head(self, x: np.ndarray) -> np.ndarray:
        """The LM head as the agent runs it: x float32[M, hidden] -> logits float32[M, vocab] (Q8_0, or float)."""
        hd = self.manifest.get("head")
        if not hd:
            return x @ self.model.output_weight.T
        if "head" not in self._runners:
            self._runners["head"] = (self.store.get(hd["codes"]), self.store.get(hd["scales"]))
        return matmul_q8_0(x, *self._runners["head"])

    def forward(self, tokens, **kw) -> np.ndarray:
        return forward(self.model, tokens, linear=self.linear, **kw)

    # ---- sizes ------------------------------------------------------------------------------------
    def nbytes(self) -> dict:
        by_role = Counter()
        for meta in self.manifest["blobs"].values():
            by_role[meta["role"]] += meta["nbytes"]
        return {"linear_weights": by_role["weight"] + by_role["weight-scales"] + by_role["smooth-scales"],
                "shadow_resident": by_role["shadow-resident"] + by_role["shadow-index"],
                "shadow_flash": by_role["shadow-flash"], "float_tensors": by_role["float"], "head": by_role["head"],
                "total": sum(by_role.values())}

    # ---- persistence ------------------------------------------------------------------------------
    def save(self, folder) -> Path:
        folder = Path(folder)
        self.store.write(folder / "blobs")
        tmp = folder / "manifest.json.tmp"
        tmp.write_text(json.dumps(self.manifest, indent=1))
        tmp.replace(folder / "manifest.json")
        return folder

    @classmethod
    def load(cls, folder, verify: bool = True) -> "QuantizedModel":
        folder = Path(folder)
        path = folder / "manifest.json"
        if not path.exists():
            raise ManifestError(f"{folder} has no manifest.json; it is not a quantized model folder "
                                "(make one with `edgeprobe quantize ... --out DIR`)")
        try:
            m = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path} is not valid JSON ({e}); quantize again") from e
        if m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
            raise ManifestError(f"{path} is not a version-{FORMAT_VERSION} {FORMAT} manifest "
                                f"(format {m.get('format')!r}, version {m.get('format_version')!r}); quantize again")
        if m.get("scheme") not in SCHEMES:
            raise UnknownSchemeError(f"{path} uses scheme {m.get('scheme')!r}, unknown to this edgeprobe")
        return cls(scheme=m["scheme"], manifest=m, store=BlobStore.read(folder / "blobs", m["blobs"], verify))


def schemes_for(config: ModelConfig) -> list[str]:
    """The schemes that apply to a model: MoE models lack the activation profile some need, dense
    models have no experts to give widths to."""
    skip = NEEDS_PROFILE if config.n_experts else MOE_ONLY
    return [s for s in SCHEMES if s not in skip]


def check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise UnknownSchemeError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")


def quantize(model: Model, scheme: str, profile=None, prune_rate: float = 0.85, coverage: float = 0.8,
             alpha: float = 0.5, int8_threshold: float = 6.0, expert_bits: dict | None = None,
             out: Path | str | None = None) -> QuantizedModel:
    """model -> QuantizedModel under `scheme` (see schemes.SCHEMES).

    profile: an OutlierStats of this model (activation clips, hot channels, layer importance, per-channel
    maxima), needed by w8a8, w8a8-shadow, w8a8c-shadow and smoothquant; `calibration_profile` makes one.
    prune_rate applies to w8a8-shadow only: w8a8c-shadow keeps every layer's shadow (its clip is tight).
    expert_bits: for moe-mixed, {expert linear name ("blk.0.ffn_up_exps.3"): 2 | 4 | 8}, e.g.
    `select_expert_bits(...).bits`; experts not named stay at INT4.
    MoE routers (ffn_gate_inp) stay float in every scheme: they are tiny and pick discrete experts.
    out: a folder to write the quantized model into as it is made (QuantizedModel.save's layout, the manifest last):
    each blob goes to disk when made and is held as a memory map, and each float tensor the model had not loaded
    before is released once quantized, so memory holds about one tensor, not the model (issue 43, item 4).
    """
    check_scheme(scheme)
    c = model.config
    if scheme in MOE_ONLY and not c.n_experts:
        raise UnsupportedModelError(f"scheme {scheme!r} sets per-expert bit widths; model {model.name!r} is dense "
                                    "(no experts). Use it with an MoE model such as 'tiny-moe'")
    if scheme in NEEDS_PROFILE and c.n_experts:
        raise UnsupportedModelError(f"scheme {scheme!r} needs activation statistics at every linear's input, which "
                                    "the outlier profiler does not collect inside experts yet; for MoE models use "
                                    "float, llm-int8, q4_0, q4_0-tile or moe-mixed")
    if scheme in NEEDS_PROFILE:
        if profile is None:
            raise ValueError(f"scheme {scheme!r} needs an outlier profile of the model for its activation scales; "
                             "pass profile=calibration_profile(model)")
        if profile.model_sha256 != model.sha256:
            raise StatsMismatchError(f"the profile belongs to model {profile.model_name} "
                                     f"({profile.model_sha256[:12]}), not {model.name} ({model.sha256[:12]})")
    names = linear_names(c)
    ctx = {"alpha": alpha, "int8_threshold": int8_threshold}
    if scheme == "moe-mixed":
        experts = [n for n in names if "_exps." in n]
        bad = sorted(set(expert_bits or {}) - set(experts))
        if bad:
            raise ValueError(f"expert_bits names {bad[:3]} are not expert linears of this model "
                             f"(e.g. {experts[0]!r})")
        ctx["expert_bits"] = {n: 4 for n in experts} | dict(expert_bits or {})
    if profile is not None:
        ctx.update(clips=profile.params["clips"], hot=profile.hot_channels(coverage),
                   clip_percentile_ch=CHANNEL_CLIP_PERCENTILE,
                   clips_ch=profile.clips_at(CHANNEL_CLIP_PERCENTILE) if scheme == "w8a8c-shadow" else None,
                   pruned_layers=set(profile.pruned_layers(prune_rate)), act_max=profile.smoothquant_scales())
        if scheme == "smoothquant":
            w_max = {}
            for n in names:
                col = np.abs(model.linear_weight(n)).max(axis=0)
                p = input_point(n)
                w_max[p] = np.maximum(w_max.get(p, 0), col)
            ctx["w_max"] = w_max
    store = BlobStore(Path(out) / "blobs" if out is not None else None)
    build = SCHEMES[scheme][0]
    release = _releaser(model.weights)
    linears, layer = {}, set()
    for i, n in enumerate(names):
        linears[n] = (build_float if is_router(n) else build)(n, np.asarray(model.linear_weight(n), np.float32), ctx,
                                                               store)
        layer.add(linear_tensor(n))
        if i + 1 == len(names) or layer_of(names[i + 1]) != layer_of(n):  # experts interleave: a layer at a time
            for t in layer:
                release(t)
            layer = set()
    linear_weights = {linear_tensor(n) for n in names}
    # the LM head as llama.cpp runs a Q8_0 output (kernels/q8_0.py); EdgeMoE's bit-width study (moe-mixed) measured
    # its losses with the float head, and its scheme computes what the study measured
    q8_head = scheme not in ("float", "moe-mixed") and c.hidden % QK == 0
    tensors = {}
    for n in model.weights:
        if n in linear_weights or (q8_head and n == "output.weight"):  # an untied head runs as Q8_0 only: its float
            continue                                                    # copy would be 2.1 GB of an 8B model's blobs
        tensors[n] = store.put(np.asarray(model.weights[n], np.float32), "float")
        if n != "token_embd.weight" or "output.weight" in model.weights:  # a tied embedding is the head, next
            release(n)
    head = None
    if q8_head:
        codes, scales = quantize_q8_0(np.asarray(model.output_weight, np.float32))
        release("output.weight" if "output.weight" in model.weights else "token_embd.weight")
        head = record("q8_0", {"codes": store.put(codes, "head"), "scales": store.put(scales, "head")})
    tok = (store.put(np.frombuffer(json.dumps(model.tokenizer.to_json()).encode(), np.uint8), "tokenizer")
           if model.tokenizer is not None else None)  # a toy model built in code has no tokenizer
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "edgeprobe_version": __version__, "scheme": scheme,
        "model": {"name": model.name, "sha256": model.sha256}, "config": dataclasses.asdict(c),
        "tokenizer": tok, "tensors": tensors, "linears": linears, "head": head, "blobs": store.meta,
        "params": {"prune_rate": prune_rate, "coverage": coverage, "alpha": alpha, "int8_threshold": int8_threshold,
                   "expert_bits": ctx.get("expert_bits"),
                   "profile": None if profile is None else {"tokens": profile.tokens,
                                                             "percentile": profile.params["percentile"]}},
    }
    qm = QuantizedModel(scheme=scheme, manifest=manifest, store=store)
    qm._tokenizer = model.tokenizer if tok else None  # what the tokenizer blob holds
    manifest["bytes"] = qm.nbytes()
    if out is not None:
        qm.save(out)
    return qm


def _releaser(weights):
    """release(name): drop a float tensor the quantizer loaded, unless the model held it before (a materialized
    model, a small model's earlier pass); weights without LazyWeights.release (a plain dict) are left alone."""
    if not hasattr(weights, "release"):
        return lambda name: None
    held_before = weights.resident()
    return lambda name: None if name in held_before else weights.release([name])


def calibration_profile(model: Model, ids, tokens: int = 4096, window: int = 512, percentile: float = 99.99,
                        progress: bool = True):
    """OutlierStats on the first `tokens` of `ids` (clips calibrated on the same tokens)."""
    from ..profile.jobs import profile_outliers

    return profile_outliers(model, ids, tokens=tokens, window=window, percentile=percentile,
                            calib_tokens=tokens, progress=progress)
