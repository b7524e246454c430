"""Models by configuration (issue 43, items 3 and 5): the real config.json files of tests/data/configs parse to the
dimensions they state, the one template builds each architecture's ops from the config alone, a chunked prefill is
planned on a phone's cost model before any weight is downloaded, and an unknown architecture is named in one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgeprobe import models
from edgeprobe.errors import ModelFormatError, UnsupportedModelError
from edgeprobe.graph import Weights, model_ops
from edgeprobe.models.config import plan_manifest
from edgeprobe.schedule import cost_model, predicted_schedule
from edgeprobe.schedule.predict import plan_of

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "configs"
NAMES = sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").exists())
# template ops of one layer of a prefill (float records, no shadows), counted by hand from each architecture:
# norm, q, k, v, rope q, rope k, attention, o, residual, ffn norm, gate, up, act, down, residual = 15;
# Qwen2 adds 3 bias adds, Qwen3 2 head norms, Gemma 2 norms after attention and FFN; an MoE FFN is one op (12)
OPS_PER_LAYER = {"gemma-2-2b": 17, "llama-3.1-8b": 15, "llama-3.2-1b": 15, "mixtral-8x7b": 12, "phi-3-mini-4k": 15,
                 "qwen2.5-3b": 18, "qwen3-1.7b": 17, "qwen3-30b-a3b": 14,
                 # the papers' models (tests/data/papers): Llama-shaped, InternLM2 too; Qwen1.5 is Qwen2 with biases
                 "llama-3-8b": 15, "llama-3.2-3b": 15, "llama-2-7b": 15, "mistral-7b": 15, "internlm2-1.8b": 15,
                 "qwen1.5-1.8b": 18}
# layers that keep shadow GEMMs under w8a8-shadow, the 15% the pruning keeps (mllm-NPU prunes 85%), worked out by
# hand from each config's layer count: 26 -> 4, 32 -> 5, 16 -> 3, 36 -> 6, 28 -> 5; MoE models are planned float
SHADOW_LAYERS = {"gemma-2-2b": 4, "llama-3.1-8b": 5, "llama-3.2-1b": 3, "mixtral-8x7b": 0, "phi-3-mini-4k": 5,
                 "qwen2.5-3b": 6, "qwen3-1.7b": 5, "qwen3-30b-a3b": 0, "llama-3-8b": 5, "llama-3.2-3b": 5,
                 "llama-2-7b": 5, "mistral-7b": 5, "internlm2-1.8b": 4, "qwen1.5-1.8b": 4}  # 32, 28, 24 layers


def _json(name):
    return json.loads((CONFIGS / name / "config.json").read_text())


def _cli(*argv, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "edgeprobe", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def test_every_architecture_of_the_issue_has_a_stored_config():
    assert {_json(n)["model_type"] for n in NAMES} == {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe",
                                                       "gemma2", "phi3", "internlm2"}
    assert set(NAMES) == set(OPS_PER_LAYER)
    for n in NAMES:
        assert (CONFIGS / n / "SOURCE").read_text().strip(), f"{n} has no SOURCE"


@pytest.mark.parametrize("name", NAMES)
def test_config_parses_to_the_numbers_in_the_json(name):
    j = _json(name)
    m = models.load(CONFIGS / name / "config.json")
    c = m.config
    assert m.meta == {"format": "config"}
    assert (c.hidden, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size) == (
        j["hidden_size"], j["num_hidden_layers"], j["num_attention_heads"], j["num_key_value_heads"], j["vocab_size"])
    assert c.head_dim == j.get("head_dim", j["hidden_size"] // j["num_attention_heads"])
    assert c.ffn == j["intermediate_size"]
    experts = j.get("num_local_experts") or j.get("num_experts") or 0
    assert (c.n_experts, c.n_experts_used) == (experts, j.get("num_experts_per_tok", 0) if experts else 0)
    if experts:
        assert c.expert_ffn == j.get("moe_intermediate_size", j["intermediate_size"])
    assert c.context_length == j["max_position_embeddings"]
    assert c.tie_embeddings == j.get("tie_word_embeddings", j["model_type"] == "gemma2")
    assert c.qk_norm == (j["model_type"] in ("qwen3", "qwen3_moe"))
    assert c.attn_bias == (j["model_type"] == "qwen2")
    windowed = [c.window(i) for i in range(c.n_layers)]
    if j["model_type"] == "gemma2":  # local and global layers alternate, the first local
        assert windowed == [j["sliding_window"], 0] * (c.n_layers // 2)
    elif j["model_type"] in ("phi3", "mistral") and j.get("sliding_window"):
        assert windowed == [j["sliding_window"]] * c.n_layers
    else:
        assert windowed == [0] * c.n_layers


def test_parameter_counts_of_published_models():
    """n_params from the parsed configs against published counts: the Qwen3-1.7B file's own safetensors header
    (1,720,574,976, its SOURCE) and the round sizes the models are named by."""
    n = {name: models.load(CONFIGS / name).config.n_params() for name in NAMES}
    assert n["qwen3-1.7b"] == 1_720_574_976
    assert round(n["llama-3.1-8b"] / 1e9, 2) == 8.03
    assert round(n["llama-3.2-1b"] / 1e9, 2) == 1.24
    assert round(n["mixtral-8x7b"] / 1e9, 1) == 46.7
    assert round(n["qwen3-30b-a3b"] / 1e9, 1) == 30.5
    assert round(n["phi-3-mini-4k"] / 1e9, 2) == 3.82


@pytest.mark.parametrize("name", NAMES)
def test_template_from_the_config_alone(name):
    """The one template's ops of an 8-token prefill: the op count per layer, and every linear's [out, in]."""
    j = _json(name)
    c = models.load(CONFIGS / name).config
    ops = model_ops(Weights(c, shadow=False, floats=True), 8)
    layer0 = [op for op in ops if op["layer"] == 0 and op["kind"] != "embed"]  # the embedding is tagged layer 0
    assert len(layer0) == OPS_PER_LAYER[name]
    assert len([op for op in ops if op["layer"] >= 0]) == 1 + OPS_PER_LAYER[name] * c.n_layers
    h, d = j["hidden_size"], c.head_dim
    q, kv = j["num_attention_heads"] * d, j["num_key_value_heads"] * d
    want = {"attn_q": [q, h], "attn_k": [kv, h], "attn_v": [kv, h], "attn_output": [h, q]}
    if not c.n_experts:
        f = j["intermediate_size"]
        want.update(ffn_gate=[f, h], ffn_up=[f, h], ffn_down=[h, f])
    shapes = {op["name"].split(".", 2)[2]: op["attrs"]["rec"]["shape"] for op in layer0 if op["kind"] == "linear"}
    assert shapes == want
    for op in layer0:
        assert op["shape"][0] == 8
    if c.n_experts:
        (moe,) = [op for op in layer0 if op["kind"] == "moe_ffn"]
        fe = j.get("moe_intermediate_size", j["intermediate_size"])
        assert len(moe["attrs"]["experts"]) == c.n_experts and moe["attrs"]["k"] == j["num_experts_per_tok"]
        assert {p: r["shape"] for p, r in moe["attrs"]["experts"][0].items()} == {
            "gate": [fe, h], "up": [fe, h], "down": [h, fe]}
    (head,) = [op for op in ops if op["kind"] == "lm_head"]
    assert head["shape"] == [1, j["vocab_size"]]


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_planned_from_the_config(name):
    """predicted_schedule, the function behind `edgeprobe schedule`, over the phone's cost model: dense models under
    w8a8-shadow (15% of the layers keep shadow GEMMs), MoE models under float (the quantizer's w8a8 schemes refuse
    MoE), one subgraph per stage, chunk and layer."""
    c = models.load(CONFIGS / name).config
    scheme = "float" if c.n_experts else "w8a8-shadow"
    plan = plan_of(CONFIGS / name, scheme)
    graph, sched = predicted_schedule(plan, 512, 256, "ooo", cost_model("snapdragon-8gen3"))
    assert graph.n_chunks == 2
    stages = {g.stage for g in graph.subgraphs}
    assert stages == ({"qkv", "shadow", "attn", "ffn"} if scheme == "w8a8-shadow" else {"qkv", "attn", "ffn"})
    shadowed = sorted({g.layer for g in graph.subgraphs if g.stage == "shadow"})
    assert shadowed == plan["planned"]["shadow"]
    assert len(shadowed) == SHADOW_LAYERS[name]
    assert sched.makespan_us > 0 and set(sched.slots) == {g.name for g in graph.subgraphs}


def test_every_scheme_plans_from_a_config_at_the_bytes_it_stores():
    from edgeprobe.graph import Weights, model_ops
    from edgeprobe.models.config import PLANNED_SCHEMES

    c = models.load(CONFIGS / "llama-3.2-1b").config
    h, f = c.hidden, c.ffn  # 2048, 8192: multiples of 32, so Q4_0 needs no padding
    per_scheme = {"float": 4 * f * h, "w8a8": f * h, "w8a8-shadow": f * h, "w8a8c-shadow": f * h + 4 * f,
                  "smoothquant": f * h + 4 * h, "llm-int8": f * h + 4 * f, "q4_0": f * h // 32 * 18,
                  "q4_0-tile": f * h // 32 * 18}
    for scheme in PLANNED_SCHEMES:
        if scheme == "moe-mixed":
            with pytest.raises(ModelFormatError, match="moe-mixed.*dense"):
                plan_manifest(c, scheme)
            continue
        plan = plan_manifest(c, scheme)
        assert plan["planned"]["priced_from"].startswith("shapes and bytes")
        (gate,) = [op for op in model_ops(Weights.of(plan), 4)
                   if op["name"] in ("blk.0.ffn_gate", "blk.0.ffn_gate.int8")]
        assert gate["attrs"]["rec"]["kind"] == scheme and gate["cost"][2] == per_scheme[scheme], scheme
        assert gate["cost"][0] == ("int8_linear" if scheme in ("w8a8", "w8a8-shadow", "w8a8c-shadow", "smoothquant",
                                                               "llm-int8") else "linear")
    moe = plan_manifest(models.load(CONFIGS / "mixtral-8x7b").config, "moe-mixed")  # MoE: any scheme, INT4 experts
    assert "INT4" in moe["planned"]["priced_from"]
    with pytest.raises(ModelFormatError, match="cannot be planned from a config alone"):
        plan_manifest(c, "int3")


def test_a_folder_with_only_a_config_loads_without_weights(tmp_path):
    (tmp_path / "config.json").write_bytes((CONFIGS / "qwen3-1.7b" / "config.json").read_bytes())
    m = models.load(tmp_path)
    assert m.meta == {"format": "config"} and m.config.n_layers == 28
    with pytest.raises(ModelFormatError, match="config.json alone .no weights."):
        m.tokenizer.encode("hello")
    with pytest.raises(ModelFormatError, match="this command needs the checkpoint"):
        m.w("token_embd.weight")


def test_an_hf_folder_plans_from_its_config_without_reading_its_weights(tmp_path):
    # a downloaded 8B folder holds 16 GB of safetensors: planning must not read (or hash) them; this one is unreadable
    folder = tmp_path / "qwen3-1.7b"  # a model is named after its folder
    folder.mkdir()
    (folder / "config.json").write_bytes((CONFIGS / "qwen3-1.7b" / "config.json").read_bytes())
    (folder / "model.safetensors").write_bytes(b"\x00" * 7)
    assert plan_of(folder, "w8a8-shadow") == plan_of(CONFIGS / "qwen3-1.7b" / "config.json", "w8a8-shadow")


def test_unknown_architecture_is_named_with_the_supported_ones(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768}))
    with pytest.raises(UnsupportedModelError, match="architecture 'GPT2LMHeadModel' .model_type 'gpt2'. is not "
                                                    "supported; supported: LlamaForCausalLM .llama."):
        models.load(cfg)
    r = _cli("schedule", "--model", str(cfg), "--cost-model", "snapdragon-8gen3", "--prompt-len", "64")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and r.stdout == ""
    for arch in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MistralForCausalLM"):
        assert arch in lines[0]


def test_commands_that_need_weights_say_so_in_one_line():
    cfg = str(CONFIGS / "llama-3.2-1b" / "config.json")
    r = _cli("run", "--model", cfg, "--prompt-len", "16")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"edgeprobe: error: {cfg} is a config.json alone (no weights): `edgeprobe schedule` plans from it; this "
        "command needs the checkpoint (a GGUF file or a folder with *.safetensors)"]


def test_schedule_cli_plans_an_8b_model_from_its_config():
    r = _cli("schedule", "--model", str(CONFIGS / "llama-3.1-8b" / "config.json"), "--cost-model", "snapdragon-8gen3",
             "--prompt-len", "1024", "--chunk", "256", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    plan = plan_of(CONFIGS / "llama-3.1-8b", "w8a8-shadow")
    graph, sched = predicted_schedule(plan, 1024, 256, "ooo", cost_model("snapdragon-8gen3"))
    assert out["makespan_ms"] == sched.makespan_us / 1e3 and out["subgraphs"] == len(graph.subgraphs)
    assert out["cost_model"] == "snapdragon-8gen3" and out["modelled"] is True


def test_generated_qwen3_moe_gguf_runs_end_to_end_as_transformers_does(tmp_path):
    """A 2-layer qwen3moe GGUF with Qwen3-30B-A3B's head shapes (32 query heads, 4 KV heads, head_dim 128, top-8
    routing, expert FFN 768; hidden, experts and vocabulary shrunk), random F16 weights written with the `gguf`
    package, loaded and run through the forward pass; transformers' Qwen3MoeForCausalLM with the same weights gives
    the reference logits."""
    import gguf
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from edgeprobe.forward import forward

    j = _json("qwen3-30b-a3b")
    H, KV, d, k, fe = (j["num_attention_heads"], j["num_key_value_heads"], j["head_dim"], j["num_experts_per_tok"],
                       j["moe_intermediate_size"])
    h, E, L, vocab = 256, 16, 2, 512
    rng = np.random.default_rng(0)
    w = lambda *shape, s=0.05: (rng.standard_normal(shape) * s).astype(np.float16)  # F16 in the file: exact in f32
    t = {"token_embd.weight": w(vocab, h, s=1.0), "output_norm.weight": (1 + w(h)).astype(np.float16),
         "output.weight": w(vocab, h)}
    for i in range(L):
        t.update({f"blk.{i}.attn_norm.weight": 1 + w(h), f"blk.{i}.ffn_norm.weight": 1 + w(h),
                  f"blk.{i}.attn_q.weight": w(H * d, h), f"blk.{i}.attn_k.weight": w(KV * d, h),
                  f"blk.{i}.attn_v.weight": w(KV * d, h), f"blk.{i}.attn_output.weight": w(h, H * d),
                  f"blk.{i}.attn_q_norm.weight": 1 + w(d), f"blk.{i}.attn_k_norm.weight": 1 + w(d),
                  f"blk.{i}.ffn_gate_inp.weight": w(E, h, s=0.5), f"blk.{i}.ffn_gate_exps.weight": w(E, fe, h),
                  f"blk.{i}.ffn_up_exps.weight": w(E, fe, h), f"blk.{i}.ffn_down_exps.weight": w(E, h, fe)})
    path = tmp_path / "qwen3moe-2l.gguf"
    g = gguf.GGUFWriter(str(path), "qwen3moe")
    g.add_block_count(L)
    g.add_context_length(j["max_position_embeddings"])
    g.add_embedding_length(h)
    g.add_feed_forward_length(j["intermediate_size"])
    g.add_head_count(H)
    g.add_head_count_kv(KV)
    g.add_key_length(d)
    g.add_value_length(d)
    g.add_rope_freq_base(j["rope_theta"])
    g.add_layer_norm_rms_eps(j["rms_norm_eps"])
    g.add_expert_count(E)
    g.add_expert_used_count(k)
    g.add_expert_feed_forward_length(fe)
    g.add_tokenizer_model("gpt2")
    g.add_token_list([f"<{i}>" for i in range(vocab)])
    for name, arr in t.items():
        g.add_tensor(name, np.asarray(arr, np.float16))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()

    m = models.load(path, cache_dir=None)
    c = m.config
    assert (c.arch, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.n_experts, c.n_experts_used, c.expert_ffn,
            c.qk_norm) == ("qwen3moe", L, H, KV, d, E, k, fe, True)
    ids = rng.integers(0, vocab, 12)
    ours = forward(m, ids)

    hf_cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=h, intermediate_size=j["intermediate_size"],
                            moe_intermediate_size=fe, num_hidden_layers=L, num_attention_heads=H,
                            num_key_value_heads=KV, head_dim=d, num_experts=E, num_experts_per_tok=k,
                            norm_topk_prob=True, rope_theta=j["rope_theta"], rms_norm_eps=j["rms_norm_eps"],
                            max_position_embeddings=j["max_position_embeddings"], tie_word_embeddings=False)
    ref_model = Qwen3MoeForCausalLM(hf_cfg).eval()
    f32 = lambda a: torch.from_numpy(np.asarray(a, np.float32))
    sd = {"model.embed_tokens.weight": f32(t["token_embd.weight"]), "model.norm.weight": f32(t["output_norm.weight"]),
          "lm_head.weight": f32(t["output.weight"])}
    for i in range(L):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        sd.update({p + "input_layernorm.weight": f32(t[b + "attn_norm.weight"]),
                   p + "post_attention_layernorm.weight": f32(t[b + "ffn_norm.weight"]),
                   p + "self_attn.q_proj.weight": f32(t[b + "attn_q.weight"]),
                   p + "self_attn.k_proj.weight": f32(t[b + "attn_k.weight"]),
                   p + "self_attn.v_proj.weight": f32(t[b + "attn_v.weight"]),
                   p + "self_attn.o_proj.weight": f32(t[b + "attn_output.weight"]),
                   p + "self_attn.q_norm.weight": f32(t[b + "attn_q_norm.weight"]),
                   p + "self_attn.k_norm.weight": f32(t[b + "attn_k_norm.weight"]),
                   p + "mlp.gate.weight": f32(t[b + "ffn_gate_inp.weight"]),
                   p + "mlp.experts.gate_up_proj": f32(np.concatenate([t[b + "ffn_gate_exps.weight"],
                                                                       t[b + "ffn_up_exps.weight"]], axis=1)),
                   p + "mlp.experts.down_proj": f32(t[b + "ffn_down_exps.weight"])})
    missing, unexpected = ref_model.load_state_dict(sd, strict=False)
    assert not unexpected and not [n for n in missing if "rotary" not in n]
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    assert ours.shape == ref.shape == (len(ids), vocab)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert np.abs(ours - ref).max() < 1e-3 * max(1.0, float(np.abs(ref).max()))
