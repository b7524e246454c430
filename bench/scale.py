"""Scale measured, not guessed: outlier profiles of generated checkpoints at real model shapes.

For each model shape: a GGUF checkpoint with that shape's exact tensors (Llama-3.2-1B, Qwen2.5-3B, Llama-3.1-8B,
Mixtral-8x7B; `--layers N` keeps the first N blocks) and random weights (normal x 0.02, norms 1.0) quantized to Q8_0
or Q4_0 by the `gguf` package, written into a temporary directory (never kept). A fresh process loads it with
edgeprobe's loader and profiles outliers layer-major on `--tokens` tokens of the built-in corpus (its calibration pass
too, as `profile outliers --order layer` runs it), with EDGEPROBE_CACHE pointed at a temporary folder. Reported: peak
RSS of that process (its own VmHWM), disk the cache grew by, forward tokens/s (the calibration pass and the outlier
pass both count), and a roofline measured in the same run: BLAS float32 GFLOP/s on a 512-token window through the
FFN's up projection, and the checkpoint's read rate from disk (page cache dropped). bound tok/s = BLAS FLOP/s / (2 x
parameters of the layers run; a MoE's routed experts only); the embedding lookup and LM head cost no FLOPs here.

The vocabulary is SmolLM2's BPE padded with unused pieces to the shape's vocab size (cut to its first pieces and the
merges among them for a smaller one, Mixtral's 32000), so the corpus tokenizes.

    .venv/bin/python bench/scale.py [--models llama-3.2-1b,qwen2.5-3b,llama-3.1-8b] [--layers N] [--tokens 4096]
                                    [--qtype q8_0|q4_0]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from timing import best_of
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Shape:
    """A published model's shape (its config.json), enough to write every tensor of it."""

    arch: str  # GGUF architecture
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    rope_theta: float
    rms_eps: float
    context: int
    rope_factor: float = 0.0  # Llama 3's "llama3" RoPE scaling factor (0: none)
    attn_bias: bool = False
    experts: int = 0       # Mixtral: stacked experts of `ffn` each, a router, `experts_used` routed per token
    experts_used: int = 0

    def layer_params(self, active: bool = False) -> int:
        """Parameters of one block; with active=True those a token computes with (its routed experts only)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = q + 2 * kv if self.attn_bias else 0
        ffn = 3 * self.hidden * self.ffn
        if self.experts:
            ffn = ffn * (self.experts_used if active else self.experts) + self.hidden * self.experts
        return self.hidden * (q + 2 * kv) + q * self.hidden + ffn + 2 * self.hidden + bias


SHAPES = {
    "llama-3.2-1b": Shape("llama", 16, 2048, 8192, 32, 8, 64, 128256, True, 500000.0, 1e-5, 131072, 32.0),
    "qwen2.5-3b": Shape("qwen2", 36, 2048, 11008, 16, 2, 128, 151936, True, 1000000.0, 1e-6, 32768, attn_bias=True),
    "llama-3.1-8b": Shape("llama", 32, 4096, 14336, 32, 8, 128, 128256, False, 500000.0, 1e-5, 131072, 8.0),
    # Mixtral-8x7B-v0.1's config.json: 8 experts of 14336, 2 routed, vocab 32000, no RoPE scaling
    "mixtral-8x7b": Shape("llama", 32, 4096, 14336, 32, 8, 128, 32000, False, 1000000.0, 1e-5, 32768,
                          experts=8, experts_used=2),
}
QTYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}

CHILD = """
import json, resource, sys, time
import numpy as np
from edgeprobe import models
from edgeprobe.corpus import read_corpus
from edgeprobe.profile.jobs import profile_outliers
t0 = time.perf_counter()
m = models.load(sys.argv[1])
ids = m.tokenizer.encode(read_corpus("train"))
t1 = time.perf_counter()
st = profile_outliers(m, ids, tokens=int(sys.argv[2]), window=512, progress=True, order="layer")  # both passes
t2 = time.perf_counter()
finite = all(np.isfinite(a).all() for d in st.arrays.values() for a in d.values() if a.dtype.kind == "f")
# ru_maxrss keeps the parent's peak across fork and exec (the checkpoint writer's): VmHWM is this process's own
ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
def vm(key):
    try:
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":")) / 1024
    except (OSError, StopIteration):
        return float("nan")
hwm = vm("VmHWM")
hwm = ru if hwm != hwm else hwm
out = {"tokens": st.tokens, "corpus_tokens": len(ids), "load_s": t1 - t0, "profile_s": t2 - t1,
       "finite": bool(finite), "maxrss_mb": hwm, "ru_maxrss_mb": ru}
if len(sys.argv) > 3:  # then quantize with that profile into a folder, as prepare.prepared does
    from pathlib import Path
    from edgeprobe.quant import quantize
    scheme, folder = sys.argv[3], Path(sys.argv[4])
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here: the quantization's own peak
    base = vm("VmRSS")
    t3 = time.perf_counter()
    qm = quantize(m, scheme, st, out=folder)
    out.update(quant_scheme=scheme, quant_s=time.perf_counter() - t3, quant_rss_mb=vm("VmHWM"),
               quant_rss_before_mb=base, quant_bytes=qm.nbytes(), quant_disk=sum(
                   p.stat().st_size for p in folder.rglob("*") if p.is_file()))
print(json.dumps(out))
"""


def _rope_factors(s: Shape) -> np.ndarray:
    """float32[head_dim / 2]: llama.cpp's rope_freqs.weight for Llama 3's scaling (convert_hf_to_gguf.py's formula,
    low/high frequency factors 1 and 4 over an original context of 8192)."""
    old, low, high = 8192, 1.0, 4.0
    out = []
    for i in range(0, s.head_dim, 2):
        wavelen = 2 * math.pi * s.rope_theta ** (i / s.head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(s.rope_factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / s.rope_factor + smooth))
    return np.asarray(out, np.float32)


def tensors(s: Shape, layers: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """GGUF name -> (shape [out, in], quantized?), in llama.cpp's order; 1-D tensors stay float32."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = {"token_embd.weight": ((s.vocab, h), True)}
    if s.rope_factor:
        out["rope_freqs.weight"] = ((s.head_dim // 2,), False)
    for i in range(layers):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": ((h,), False), b + "attn_q.weight": ((q, h), True),
                    b + "attn_k.weight": ((kv, h), True), b + "attn_v.weight": ((kv, h), True)})
        if s.attn_bias:
            out.update({b + "attn_q.bias": ((q,), False), b + "attn_k.bias": ((kv,), False),
                        b + "attn_v.bias": ((kv,), False)})
        out.update({b + "attn_output.weight": ((h, q), True), b + "ffn_norm.weight": ((h,), False)})
        if s.experts:  # llama.cpp's stacked experts [E, out, in]; its router stays float32 here
            E = s.experts
            out.update({b + "ffn_gate_inp.weight": ((E, h), False), b + "ffn_gate_exps.weight": ((E, s.ffn, h), True),
                        b + "ffn_up_exps.weight": ((E, s.ffn, h), True),
                        b + "ffn_down_exps.weight": ((E, h, s.ffn), True)})
        else:
            out.update({b + "ffn_gate.weight": ((s.ffn, h), True), b + "ffn_up.weight": ((s.ffn, h), True),
                        b + "ffn_down.weight": ((h, s.ffn), True)})
    out["output_norm.weight"] = ((h,), False)
    if not s.tied:
        out["output.weight"] = ((s.vocab, h), True)
    return out


def _vocab(n: int) -> tuple[list[str], list[str], list[int], str]:
    """SmolLM2's BPE pieces and merges, padded to `n` pieces that no merge produces (so they never appear), or cut to
    its first `n` pieces."""
    from edgeprobe import models
    from edgeprobe.models.gguf_writer import _pre_tokenizer_name
    from edgeprobe.models.gguf_writer import _vocab as bpe_vocab

    tok = models.load("smollm2-135m").tokenizer
    tokens, merges, types = bpe_vocab(tok)
    if n < len(tokens):  # a smaller vocabulary (Mixtral's 32000): the first n pieces and the merges among them
        tokens, types = tokens[:n], types[:n]
        kept = set(tokens)
        merges = [m for m in merges if (ab := m.split(" "))[0] in kept and ab[1] in kept and "".join(ab) in kept]
    pad = n - len(tokens)
    return tokens + [f"<|unused_{i}|>" for i in range(pad)], merges, types + [1] * pad, _pre_tokenizer_name(tok)


def write_checkpoint(s: Shape, layers: int, qtype, path: Path, seed: int = 0) -> int:
    """Write the shape's first `layers` blocks to `path` as GGUF, tensor by tensor (never the whole model in memory).
    Returns the file's size in bytes."""
    from edgeprobe.models.gguf_writer import add_bpe_tokenizer, add_llama_keys

    w = gguf.GGUFWriter(str(path), arch=s.arch)
    w.add_name(f"generated {s.arch} {s.hidden}x{layers}")
    add_llama_keys(w, context=s.context, hidden=s.hidden, n_layers=layers, ffn=s.ffn, heads=s.heads,
                   kv_heads=s.kv_heads, head_dim=s.head_dim, rope_theta=s.rope_theta, rms_eps=s.rms_eps,
                   vocab=s.vocab)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.experts_used)
    w.add_file_type({"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype.name])
    add_bpe_tokenizer(w, *_vocab(s.vocab))
    specs = tensors(s, layers)
    for name, (shape, quant) in specs.items():
        if quant:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    total = sum(int(np.prod(shape)) for shape, _ in specs.values())
    with tqdm(total=total, desc=f"write {path.name}", unit="par", unit_scale=True, leave=False) as bar:
        for name, (shape, quant) in specs.items():
            if name == "rope_freqs.weight":
                arr = _rope_factors(s)
            elif name.endswith("norm.weight"):
                arr = np.ones(shape, np.float32)  # RMSNorm gains of 1: activations stay at the embedding's scale
            else:
                arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            w.write_tensor_data(gguf.quants.quantize(arr, qtype) if quant else arr)
            bar.update(arr.size)
    w.fout[0].flush()
    os.fsync(w.fout[0].fileno())
    w.close()
    return path.stat().st_size


def disk_read_mb_s(path: Path) -> float:
    """MB/s reading `path` once after dropping its pages from the page cache (posix_fadvise DONTNEED)."""
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(1 << 24)
        t, n = time.perf_counter(), 0
        while k := f.readinto(buf):
            n += k
        return n / (time.perf_counter() - t) / 1e6


def blas_gflops(s: Shape) -> float:
    """float32 GEMM rate on one window through the FFN's up projection: [512, hidden] x [hidden, ffn]."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((512, s.hidden), dtype=np.float32)
    w = rng.standard_normal((s.ffn, s.hidden), dtype=np.float32)
    return 2 * 512 * s.hidden * s.ffn / best_of(lambda: a @ w.T, 5, warmup=True) / 1e9


def du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure(name: str, layers: int, tokens: int, qtype, quantize: str | None = None) -> dict:
    s = SHAPES[name]
    with tempfile.TemporaryDirectory(prefix="edgeprobe-scale-") as tmp:
        ckpt, cache = Path(tmp) / f"{name}-{layers}l-{qtype.name.lower()}.gguf", Path(tmp) / "cache"
        t = time.perf_counter()
        size = write_checkpoint(s, layers, qtype, ckpt)
        write_s = time.perf_counter() - t
        read = disk_read_mb_s(ckpt)
        gflops = blas_gflops(s)
        env = {**os.environ, "EDGEPROBE_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
        extra_args = [quantize, str(Path(tmp) / "quantized")] if quantize else []
        r = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), str(tokens), *extra_args], env=env,
                           stdout=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise SystemExit(f"bench/scale.py: profiling {name} failed (exit {r.returncode}); its error is above")
        child = json.loads(r.stdout.strip().splitlines()[-1])
        npy = list(cache.rglob("*.npy"))
        extra, npy_bytes = du(cache), sum(p.stat().st_size for p in npy)
    params_run = layers * s.layer_params(active=True)  # the FLOPs: a MoE token runs its routed experts only
    # the calibration pass reads min(8192, tokens) tokens (profile_outliers' calib_tokens), then the outlier pass
    fwd_tokens = child["tokens"] + min(8192, child["tokens"])
    tok_s = fwd_tokens / child["profile_s"]
    bound = gflops * 1e9 / (2 * params_run)
    return {"model": name, "qtype": qtype.name, "hidden": s.hidden, "ffn": s.ffn, "vocab": s.vocab,
            "layers": layers, "depth": s.layers, "params_run": params_run,
            "params_file": layers * s.layer_params() + s.vocab * s.hidden * (1 if s.tied else 2), "ckpt_bytes": size,
            "extra_bytes": extra, "npy_files": len(npy), "npy_bytes": npy_bytes, "write_s": write_s,
            "disk_mb_s": read, "blas_gflops": gflops, "tok_s": tok_s, "bound_tok_s": bound, "ratio": tok_s / bound,
            "calib_order": "layer",
            **child}


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<13s} {'q':<5s} {'hidden/ffn/vocab':>18s} {'layers':>7s} {'params':>7s} {'ckpt':>9s} "
          f"{'extra disk':>10s} {'of ckpt':>7s} {'peak RSS':>9s} {'tok/s':>7s} {'bound':>7s} {'ratio':>6s} "
          f"{'BLAS GF/s':>9s} {'disk MB/s':>9s}")
    for r in rows:
        shape = f"{r['hidden']}/{r['ffn']}/{r['vocab']}"
        print(f"{r['model']:<13s} {r['qtype'].lower():<5s} {shape:>18s} {r['layers']:>3d}/{r['depth']:<3d} "
              f"{r['params_file'] / 1e9:6.2f}B {_mb(r['ckpt_bytes']):>9s} {_mb(r['extra_bytes']):>10s} "
              f"{r['extra_bytes'] / r['ckpt_bytes']:7.0%} {r['maxrss_mb']:6.0f} MB {r['tok_s']:7.1f} "
              f"{r['bound_tok_s']:7.1f} {r['ratio']:6.0%} {r['blas_gflops']:9.1f} {r['disk_mb_s']:9.0f}")
    print("params: in the file (embedding included); bound = BLAS FLOP/s / (2 x params of the layers run, a MoE's "
          "routed experts only); tok/s "
          "counts both forward passes (calibration, then the layer-major outlier pass); extra disk: what "
          "EDGEPROBE_CACHE grew by (config and tokenizer; float32 .npy only for a model under "
          "$EDGEPROBE_NPY_CACHE_MAX_MB)")
    quantized = [r for r in rows if r.get("quant_scheme")]
    if quantized:
        print(f"{'model':<13s} {'layers':>7s} {'scheme':<12s} {'written':>9s} {'of ckpt':>7s} {'float blobs':>11s} "
              f"{'RSS before':>10s} {'peak RSS':>9s} {'seconds':>8s}")
        for r in quantized:
            b = r["quant_bytes"]
            print(f"{r['model']:<13s} {r['layers']:>3d}/{r['depth']:<3d} {r['quant_scheme']:<12s} "
                  f"{_mb(r['quant_disk']):>9s} {r['quant_disk'] / r['ckpt_bytes']:7.0%} {_mb(b['float_tensors']):>11s} "
                  f"{r['quant_rss_before_mb']:7.0f} MB {r['quant_rss_mb']:6.0f} MB {r['quant_s']:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.error = lambda msg: sys.exit(f"bench/scale.py: {msg}")  # one line, not the usage block
    ap.add_argument("--models", default="llama-3.2-1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--layers", type=int, help="blocks to keep (default: each model's real depth)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--qtype", default="q8_0", choices=sorted(QTYPES))
    ap.add_argument("--quantize", metavar="SCHEME", help="then quantize each model with its profile into a "
                    "folder (e.g. w8a8-shadow): the quantizer's peak RSS, seconds and bytes written")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        ap.error(f"unknown model {unknown[0] if unknown else args.models!r}; known: {', '.join(SHAPES)}")
    if args.layers is not None and not 1 <= args.layers <= min(SHAPES[n].layers for n in names):
        ap.error(f"--layers must be in 1..{min(SHAPES[n].layers for n in names)} for {', '.join(names)}, "
                 f"got {args.layers}")
    if args.tokens < 512:
        ap.error(f"--tokens must be at least one window of 512, got {args.tokens}")
    from edgeprobe.models.gguf_loader import SUPPORTED_ARCHS

    rows = []
    for n in names:
        if SHAPES[n].arch not in SUPPORTED_ARCHS:
            print(f"{n}: architecture {SHAPES[n].arch} not supported yet by edgeprobe's GGUF loader; skipped")
            continue
        rows.append(measure(n, args.layers or SHAPES[n].layers, args.tokens, QTYPES[args.qtype], args.quantize))
        print(json.dumps(rows[-1]), file=sys.stderr)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
