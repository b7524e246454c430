"""Train `tiny-moe`: a small Mixtral-style MoE decoder on the bundled corpus, on the CPU, deterministically.

No pretrained MoE ships inside a package here and nothing may be downloaded, so edgeprobe trains its
own real MoE checkpoint for the EdgeMoE experiments (PAPERS.md §3). PyTorch is used by this script
only; the toolkit reads the result with numpy.

    pip install torch==2.13.0 && python datasets/moe/train_tiny_moe.py        # ~15 min on 2 cores

Writes datasets/moe/tiny-moe/: model.safetensors (bf16, Hugging Face Mixtral layout), config.json,
tokenizer.json, tokenizer_config.json, training_log.jsonl and metrics.json (held-out loss of the
saved bf16 weights, per-layer expert load balance and routing entropy).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "corpus"
EOS = "<|endoftext|>"

ARCH = dict(vocab_size=4096, hidden_size=256, intermediate_size=256, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=8,
            num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512)


def train_tokenizer(vocab: int) -> Tokenizer:
    """Byte-level BPE with digits split one by one (llama.cpp's "smollm" pre-tokenizer, so a GGUF copy
    round-trips), trained on the training split only."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(CORPUS / "train.txt")], trainer)
    return tok


class RMSNorm(torch.nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, cos, sin):
    """Hugging Face's "halves" rotation: pairs (i, i + d/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        h, d = a["hidden_size"], a["head_dim"]
        self.nh, self.nkv, self.d = a["num_attention_heads"], a["num_key_value_heads"], d
        self.E, self.k, f = a["num_local_experts"], a["num_experts_per_tok"], a["intermediate_size"]
        self.ln1, self.ln2 = RMSNorm(h, a["rms_norm_eps"]), RMSNorm(h, a["rms_norm_eps"])
        self.q = torch.nn.Linear(h, self.nh * d, bias=False)
        self.kp = torch.nn.Linear(h, self.nkv * d, bias=False)
        self.v = torch.nn.Linear(h, self.nkv * d, bias=False)
        self.o = torch.nn.Linear(self.nh * d, h, bias=False)
        self.gate = torch.nn.Linear(h, self.E, bias=False)
        std = 0.02
        self.w1 = torch.nn.Parameter(torch.randn(self.E, f, h) * std)   # gate_proj of each expert
        self.w3 = torch.nn.Parameter(torch.randn(self.E, f, h) * std)   # up_proj
        self.w2 = torch.nn.Parameter(torch.randn(self.E, h, f) * std)   # down_proj

    def moe(self, x):
        """x: [N, h] -> (y [N, h], router probs [N, E], chosen experts [N, k]); Mixtral's routing."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        for e in range(self.E):
            rows, slot = torch.where(idx == e)
            if rows.numel() == 0:
                continue
            xe = x[rows]
            he = F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)
            y.index_add_(0, rows, (he @ self.w2[e].T) * w[rows, slot, None])
        return y, probs, idx

    def forward(self, x, cos, sin):
        B, T, h = x.shape
        a = self.ln1(x)
        q = self.q(a).view(B, T, self.nh, self.d).transpose(1, 2)
        k = self.kp(a).view(B, T, self.nkv, self.d).transpose(1, 2)
        v = self.v(a).view(B, T, self.nkv, self.d).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(att.transpose(1, 2).reshape(B, T, -1))
        y, probs, idx = self.moe(self.ln2(x).reshape(B * T, h))
        return x + y.view(B, T, h), probs, idx


class TinyMoE(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = a
        self.embed = torch.nn.Embedding(a["vocab_size"], a["hidden_size"])
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = torch.nn.ModuleList(Block(a) for _ in range(a["num_hidden_layers"]))
        self.norm = RMSNorm(a["hidden_size"], a["rms_norm_eps"])
        d = a["head_dim"]
        inv = 1.0 / (a["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.arange(a["max_position_embeddings"], dtype=torch.float64)[:, None] * inv[None]
        emb = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, ids):
        T = ids.shape[1]
        x = self.embed(ids)
        cos, sin = self.cos[:T], self.sin[:T]
        routing = []
        for blk in self.blocks:
            x, probs, idx = blk(x, cos, sin)
            routing.append((probs, idx))
        return self.norm(x) @ self.embed.weight.T, routing  # tied LM head


def aux_loss(routing, E, k):
    """Switch-Transformer load-balancing loss (Fedus et al. 2021, eq. 4), averaged over layers."""
    total = 0.0
    for probs, idx in routing:
        frac = F.one_hot(idx, E).float().sum((0, 1)) / (idx.shape[0] * k)
        total = total + E * (frac * probs.mean(0)).sum()
    return total / len(routing)


def batches(ids: np.ndarray, seq: int, batch: int, seed: int):
    """Endless random windows of seq+1 tokens from a fixed-seed generator."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(ids) - seq - 1, size=batch)
        yield torch.from_numpy(np.stack([ids[s:s + seq + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def evaluate(model, ids: np.ndarray, seq: int, E: int):
    """Mean next-token loss over non-overlapping windows, and routing statistics per layer."""
    model.eval()
    nll, n = 0.0, 0
    L = model.a["num_hidden_layers"]
    load = np.zeros((L, E))
    ent = np.zeros(L)
    for s in range(0, len(ids) - seq - 1, seq):
        x = torch.from_numpy(ids[s:s + seq + 1].astype(np.int64))[None]
        logits, routing = model(x[:, :-1])
        nll += F.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
        n += seq
        for l, (probs, idx) in enumerate(routing):
            load[l] += np.bincount(idx.reshape(-1).numpy(), minlength=E)
            ent[l] += -(probs * probs.clamp_min(1e-12).log()).sum(-1).sum().item()
    model.train()
    share = load / load.sum(1, keepdims=True)
    return {"loss": nll / n, "tokens": n,
            "expert_share": share.round(4).tolist(),
            "load_max_over_mean": (share.max(1) * E).round(3).tolist(),
            "load_entropy_bits": (-(share * np.log2(share.clip(1e-12))).sum(1)).round(3).tolist(),
            "router_entropy_bits": (ent / n / math.log(2)).round(3).tolist()}


def to_hf(model) -> dict:
    """Parameters under Hugging Face Mixtral names (block_sparse_moe.experts.{j}.w1/w2/w3), bf16."""
    sd = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    for i, b in enumerate(model.blocks):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": b.ln1.weight, p + "post_attention_layernorm.weight": b.ln2.weight,
                   p + "self_attn.q_proj.weight": b.q.weight, p + "self_attn.k_proj.weight": b.kp.weight,
                   p + "self_attn.v_proj.weight": b.v.weight, p + "self_attn.o_proj.weight": b.o.weight,
                   p + "block_sparse_moe.gate.weight": b.gate.weight})
        for e in range(b.E):
            q = f"{p}block_sparse_moe.experts.{e}."
            sd.update({q + "w1.weight": b.w1[e], q + "w2.weight": b.w2[e], q + "w3.weight": b.w3[e]})
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--aux", type=float, default=0.02, help="load-balancing loss coefficient (Mixtral: 0.02)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=HERE / "tiny-moe")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    args.out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(ARCH["vocab_size"])
    encode = lambda split: np.asarray(tok.encode((CORPUS / f"{split}.txt").read_text("utf-8")).ids, np.int32)
    train_ids, held_ids = encode("train"), encode("heldout")
    print(f"tokenizer: {tok.get_vocab_size()} tokens; train {len(train_ids)} / heldout {len(held_ids)} tokens")

    a = dict(ARCH)
    model = TinyMoE(a)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm)
        * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))
    E, k = a["num_local_experts"], a["num_experts_per_tok"]
    log = open(args.out / "training_log.jsonl", "w")
    t0 = time.time()
    data = batches(train_ids, args.seq, args.batch, args.seed)
    for step in range(1, args.steps + 1):
        x = next(data)
        logits, routing = model(x[:, :-1])
        lm = F.cross_entropy(logits.reshape(-1, a["vocab_size"]), x[:, 1:].reshape(-1))
        bal = aux_loss(routing, E, k)
        opt.zero_grad(set_to_none=True)
        (lm + args.aux * bal).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == 1:
            rec = {"step": step, "loss": round(lm.item(), 4), "aux": round(bal.item(), 4),
                   "lr": round(sched.get_last_lr()[0], 6), "elapsed_s": round(time.time() - t0, 1)}
            if step % 100 == 0 or step == args.steps:
                ev = evaluate(model, held_ids[:8192], args.seq, E)
                rec["heldout_loss_8k"] = round(ev["loss"], 4)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(rec, flush=True)
    train_s = time.time() - t0

    # Round to the saved precision first, so the recorded held-out loss is that of the committed file.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ev = evaluate(model, held_ids, args.seq, E)
    save_file(to_hf(model), str(args.out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(args.out / "tokenizer.json"))
    eos_id = tok.token_to_id(EOS)
    (args.out / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": False, "eos_token": EOS, "model_max_length": a["max_position_embeddings"],
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1) + "\n")
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **a,
              "hidden_act": "silu", "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": eos_id,
              "router_aux_loss_coef": args.aux, "output_router_logits": False, "sliding_window": None,
              "attention_dropout": 0.0, "initializer_range": 0.02, "torch_dtype": "bfloat16",
              "_name_or_path": "edgeprobe/tiny-moe"}
    (args.out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    metrics = {"heldout": {"loss": round(ev["loss"], 5), "perplexity": round(math.exp(ev["loss"]), 3),
                           "tokens": ev["tokens"], "window": args.seq},
               "routing": {k2: ev[k2] for k2 in ("expert_share", "load_max_over_mean", "load_entropy_bits",
                                                 "router_entropy_bits")},
               "training": {**vars(args), "out": None, "train_tokens": int(len(train_ids)),
                            "tokens_seen": args.steps * args.batch * args.seq, "seconds": round(train_s, 1),
                            "torch": torch.__version__, "threads": torch.get_num_threads()},
               "n_params": sum(p.numel() for p in model.parameters())}
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(json.dumps({"heldout": metrics["heldout"], "routing": metrics["routing"]}, indent=1))


if __name__ == "__main__":
    main()
