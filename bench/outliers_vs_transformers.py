"""`edgeprobe profile outliers` against transformers collecting the same per-channel maxima.

Both sides start as a new process on the same Hugging Face folder of SmolLM2-135M (float32 safetensors written once
from the shipped GGUF by transformers, as tests/test_reference.py writes one; kept in $EDGEPROBE_CACHE/hf, else
~/.cache/edgeprobe/hf) and the same tokens (edgeprobe's tokenization of the bundled training corpus, its first
--tokens in --window windows), and are timed wall clock, loading included:
  ours          `edgeprobe profile outliers --model FOLDER --tokens N --window W` (one pass: the calibration keeps
                the entries the outlier statistics count, ClipHistograms keep; it also tokenizes the corpus and
                writes its figures);
  transformers  float32, torch.set_num_threads(2), a forward hook on every nn.Linear keeping the running per-channel
                max |x| of its input (SmoothQuant's get_act_scales), the same windows under torch.no_grad().
Rounds alternate the two (A/B/A/B). Prints tok/s of each, the ratio (ours / transformers), the load average, and the
largest relative difference between the two sides' per-channel maxima at every linear input (they compute the same
float32 activations, up to summation order).

    .venv/bin/python bench/outliers_vs_transformers.py [--tokens 4096] [--window 512] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

# bench/profile.py would shadow the standard library's profile module, which torch imports (through cProfile)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

# transformers' side in its own process: load the folder, hook every Linear, run the windows; writes the maxima
WORKER = textwrap.dedent('''
    import sys, time
    t0 = time.perf_counter()
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    folder, ids_path, window, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    scales = {}

    def hook(name):
        def f(mod, inp, outp):  # SmoothQuant's get_act_scales: running max over tokens of |x| per input channel
            x = inp[0].detach().reshape(-1, inp[0].shape[-1]).abs().amax(dim=0).float()
            scales[name] = torch.maximum(scales[name], x) if name in scales else x
        return f
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(hook(name))
    ids = np.load(ids_path)
    with torch.no_grad():
        for i in range(0, len(ids) - window + 1, window):
            model(torch.tensor(ids[i:i + window], dtype=torch.long)[None])
    wall = time.perf_counter() - t0
    np.savez(out, **{k: v.numpy() for k, v in scales.items()})
    print(wall)
''')

# edgeprobe's hook point of each linear input -> the Linear of the Hugging Face Llama whose input it is
HF_LINEAR = {"attn_in": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attn_out": ("self_attn.o_proj",),
             "ffn_in": ("mlp.gate_proj", "mlp.up_proj"), "ffn_act": ("mlp.down_proj",)}


def hf_folder() -> Path:
    """A Hugging Face folder of SmolLM2-135M, float32, written once from the shipped GGUF by transformers."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgeprobe import models

    root = Path(os.environ.get("EDGEPROBE_CACHE", Path.home() / ".cache" / "edgeprobe")) / "hf" / "smollm2-135m-f32"
    if (root / "model.safetensors").exists() and (root / "config.json").exists():
        return root
    path = models.resolve("smollm2-135m")
    print(f"writing a Hugging Face folder of {path.name} (float32) into {root}: once", flush=True)
    root.mkdir(parents=True, exist_ok=True)
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    # save_pretrained refuses GGUF-loaded models; the head is tied to the embedding
    state = {k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(root / "model.safetensors.part"))
    cfg = m.config.to_dict()
    cfg.pop("quantization_config", None)
    (root / "config.json").write_text(json.dumps(cfg))
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(root)
    (root / "model.safetensors.part").replace(root / "model.safetensors")
    return root


def run_ours(folder: Path, tokens: int, window: int, out: Path) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "edgeprobe", "profile", "outliers", "--model", str(folder), "--tokens",
                    str(tokens), "--window", str(window), "--out", str(out), "--no-progress"], check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def run_transformers(folder: Path, ids_path: Path, window: int, out: Path, script: Path) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, str(script), str(folder), str(ids_path), str(window), str(out)], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "2"})
    return time.perf_counter() - t


def max_rel_diff(ours_npz: Path, hf_npz: Path, n_layers: int) -> tuple[float, str]:
    """The largest |ours - theirs| / theirs over every channel of every linear input, and where."""
    from edgeprobe.profile.outliers import OutlierStats

    st = OutlierStats.load(ours_npz)
    hf = np.load(hf_npz)
    worst, where = 0.0, ""
    for i in range(n_layers):
        for point, linears in HF_LINEAR.items():
            a = st.arrays[f"blk.{i}.{point}"]["chmax"].astype(np.float64)
            for lin in linears:
                b = hf[f"model.layers.{i}.{lin}"].astype(np.float64)
                d = float((np.abs(a - b) / np.maximum(np.abs(b), 1e-30)).max())
                if d > worst:
                    worst, where = d, f"blk.{i}.{point} vs {lin}"
    return worst, where


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="A/B rounds; tok/s printed are their medians")
    args = ap.parse_args()
    from edgeprobe import models
    from edgeprobe.corpus import corpus_path, read_text_file

    folder = hf_folder()
    m = models.load(folder)
    ids = np.asarray(m.tokenizer.encode(read_text_file(corpus_path("train"))))[:args.tokens]
    n = len(ids) // args.window * args.window
    if n == 0:
        sys.exit(f"the corpus has {len(ids)} tokens, fewer than one window of {args.window}")
    ours_s, hf_s, loads = [], [], [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="outliers-vs-hf-") as tmp:
        tmp = Path(tmp)
        ids_path, script = tmp / "ids.npy", tmp / "hf_worker.py"
        np.save(ids_path, ids[:n].astype(np.int64))
        script.write_text(WORKER)
        for r in range(args.rounds):
            print(f"-- round {r + 1}/{args.rounds} (load average {os.getloadavg()[0]:.2f})", flush=True)
            ours_s.append(run_ours(folder, n, args.window, tmp / "ours"))
            hf_s.append(run_transformers(folder, ids_path, args.window, tmp / "hf.npz", script))
            loads.append(os.getloadavg()[0])
            print(f"   ours {ours_s[-1]:.1f} s, transformers {hf_s[-1]:.1f} s", flush=True)
        diff, where = max_rel_diff(tmp / "ours" / "outliers.npz", tmp / "hf.npz", m.config.n_layers)
        summary = json.loads((tmp / "ours" / "summary.json").read_text())
    ours_tps, hf_tps = n / statistics.median(ours_s), n / statistics.median(hf_s)
    print(f"\nprofile outliers on {n} tokens ({n // args.window} windows of {args.window}) of {folder}, wall clock "
          f"with loading, medians of {args.rounds} round(s); load average {', '.join(f'{x:.2f}' for x in loads)} "
          f"(start, after each round)")
    print(f"   edgeprobe profile outliers: {ours_tps:7.1f} tok/s ({statistics.median(ours_s):.1f} s; the "
          f"calibration pass, its kept entries counted, kept layers {summary.get('kept_layers')})")
    print(f"   transformers fp32, 2 threads, hooks on every Linear: {hf_tps:7.1f} tok/s "
          f"({statistics.median(hf_s):.1f} s)")
    print(f"   ratio ours / transformers: {ours_tps / hf_tps:.2f}x; per-channel max |x| of every linear input agree "
          f"within {diff:.2e} relative (largest at {where})")


if __name__ == "__main__":
    main()
