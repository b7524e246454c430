"""A phone planned from a config alone (edgeprobe.schedule.soc, .predict): the SoC files' rooflines, each workload
the papers measure, and the CLI. Numbers are exact where both sides compute the same thing (an op's roofline from
its FLOPs, bytes and the file's rates), bounds where the comparison is independent (a decode step against its
weights' bytes over the bandwidth, counted here from the config)."""
import json
import math
from pathlib import Path

import pytest

from edgeprobe.cli import main
from edgeprobe.schedule import ScheduleError, cost_model, soc
from edgeprobe.schedule.predict import STRATEGIES, predict

CONFIGS = Path(__file__).parent / "data" / "configs"
L8 = CONFIGS / "llama-3.1-8b" / "config.json"
L1 = CONFIGS / "llama-3.2-1b" / "config.json"
MIXTRAL = CONFIGS / "mixtral-8x7b" / "config.json"


def test_every_soc_file_loads_with_a_source_for_every_number(tmp_path):
    assert soc.available() == ["snapdragon-8elite", "snapdragon-8gen2", "snapdragon-8gen3"]
    for name in soc.available():
        m = soc.load(name)
        assert set(m.lanes) == {"cpu", "gpu", "npu"} and m.together_gbs > max(l.bandwidth_gbs for l in m.lanes.values())
        assert all(v["source"].strip() for v in m.sources.values())
        assert {"lanes.npu.compute.int8", "lanes.npu.stage_rows", "together_bandwidth", "flash_read",
                "sync_us"} <= set(m.sources)
    assert cost_model("snapdragon-8gen3") is cost_model("snapdragon-8gen3") and isinstance(
        cost_model("snapdragon-8gen3"), soc.SocCostModel)  # the name kept: the contract, now the roofline
    doc = json.loads((soc.FOLDER / "snapdragon-8gen3.json").read_text())
    del doc["lanes"]["gpu"]["bandwidth"]["source"]
    bad = tmp_path / "phone.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ScheduleError, match="lanes.gpu.bandwidth: every number needs"):
        soc.load(bad)
    with pytest.raises(ScheduleError, match="unknown SoC 'snapdragon-9'; choose one of snapdragon-8elite"):
        soc.load("snapdragon-9")


def _linear(rows, k, n, wbytes, kind="int8_linear"):
    return {"name": "x", "kind": "linear", "shape": [rows, n], "attrs": {"rec": {"shape": [n, k]}},
            "cost": [kind, 2 * rows * k * n, wbytes], "lane": "npu"}


def test_an_op_costs_its_fixed_time_plus_the_larger_of_compute_and_memory():
    m = soc.load("snapdragon-8gen3")
    npu = m.lane("npu")
    op = _linear(256, 2048, 2048, 2048 * 2048)
    c = m.op_cost(op, "npu")
    assert c.compute_us == pytest.approx(2 * 256 * 2048 * 2048 / (npu.rates["int8"] * 1e3), rel=1e-12)
    act = 256 * (2048 + 2048) * 2  # FP16 activations in and out
    assert c.memory_us == pytest.approx((2048 * 2048 + act) / (npu.bandwidth_gbs * 1e3), rel=1e-12)
    assert c.us == pytest.approx(npu.op_us + max(c.compute_us, c.memory_us)) and c.bound == "compute"
    gemv = m.op_cost(_linear(1, 2048, 2048, 2048 * 2048), "cpu")
    assert gemv.bound == "bandwidth"  # a decode GEMV streams its weights
    # the NPU pads M to its pre-built lengths and K, N to 32-wide tiles: M = 1 and M = 32 compute alike (the TTS
    # paper's idle matrix unit), M = 33 as 64
    one, full, more = (m.op_cost(_linear(r, 2048, 2048, 0), "npu").compute_us for r in (1, 32, 33))
    assert one == full and more == pytest.approx(2 * full)
    odd = m.op_cost(_linear(32, 2050, 2048, 0), "npu").compute_us  # K = 2050 computes as 2080
    assert odd == pytest.approx(2 * 32 * 2080 * 2048 / (npu.rates["int8"] * 1e3), rel=1e-12)


def _weight_bytes_q4(cfg: dict) -> int:
    """A dense Llama's linear weights in Q4_0 and its Q8_0 LM head, counted from config.json (not the template)."""
    h, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    q4 = lambda n, k: n * (k // 32) * 18
    per_layer = q4(q, h) + 2 * q4(kv, h) + q4(h, q) + 2 * q4(f, h) + q4(h, f)
    head = cfg["vocab_size"] * h * 34 // 32
    return L * per_layer + head


@pytest.mark.parametrize("strategy, lane_bw", [("gpu", "gpu"), ("cpu", "cpu"), ("hetero", "together")])
def test_a_decode_step_streams_the_weights_at_the_bandwidth_of_the_lanes_it_uses(strategy, lane_bw):
    m = soc.load("snapdragon-8gen3")
    bw = m.together_gbs if lane_bw == "together" else m.lane(lane_bw).bandwidth_gbs
    floor_ms = _weight_bytes_q4(json.loads(L8.read_text())) / (bw * 1e6)
    p = predict(L8, m, 256, decode=64, scheme="q4_0", strategy=strategy)
    assert p.decode_step.bound == "bandwidth"
    assert floor_ms <= p.decode_step.ms <= 1.2 * floor_ms  # + activations, KV cache, dispatch and syncs
    assert p.decode_tok_s == pytest.approx(1e3 / p.decode_step.ms)


def test_heterollms_decode_gains_from_two_lanes_bandwidth_and_schemes_are_priced_apart():
    gpu, both = (predict(L8, "snapdragon-8gen3", 256, 64, scheme="q4_0", strategy=s).decode_tok_s
                 for s in ("gpu", "hetero"))
    assert 1.2 < both / gpu < 59.1 / 43.3 + 0.01  # HeteroLLM §5.3: 43.3 -> 59.1 GB/s
    t = {s: predict(L8, "snapdragon-8gen3", 256, scheme=s).prefill_ms for s in ("float", "w8a8", "w8a8-shadow")}
    assert t["float"] > t["w8a8-shadow"] >= t["w8a8"]  # float at the fp16 rate; shadows add CPU work and sums
    q4 = predict(L8, "snapdragon-8gen3", 256, scheme="q4_0", strategy="npu")
    assert q4.priced_from == "shapes and bytes" and q4.prefill.lanes == {"npu": 100.0}


def test_batch_n_decode_on_the_npu_costs_little_more_than_one_until_the_logits_grow():
    one, eight = (predict(L1, "snapdragon-8elite", 512, 128, batch=b, scheme="q4_0-tile", strategy="npu")
                  for b in (1, 8))
    npu = lambda p: sum(e["end_us"] - e["start_us"] for e in p.decode_step.trace.events if e["lane"] == "npu")
    cpu = lambda p: sum(e["end_us"] - e["start_us"] for e in p.decode_step.trace.events if e["lane"] == "cpu")
    assert npu(eight) < 1.25 * npu(one)  # M = 1 and M = 8 fill the same 32-row HMX tiles; the KV cache grows
    assert cpu(eight) > 4 * cpu(one)  # the LM head's logits on the CPU grow with the batch (TTS §7.2.2)
    assert eight.decode_tok_s_batch > 3 * one.decode_tok_s_batch and eight.batch == 8


def test_experts_from_flash_cost_their_misses_and_ffn_rows_their_new_neurons():
    m = soc.load("snapdragon-8gen3")
    run = lambda **kw: predict(MIXTRAL, m, 64, decode=16, scheme="moe-mixed", strategy="cpu", **kw).decode_step
    hit, miss, half = run(experts_in_flash=True, expert_hit_rate=1.0), run(experts_in_flash=True,
                                                                            expert_hit_rate=0.0), \
        run(experts_in_flash=True, expert_hit_rate=0.5)
    cfg = json.loads(MIXTRAL.read_text())
    h, f, L, k = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_experts_per_tok"]
    expert = 3 * ((f * h * 4 + 7) // 8) + 4 * (2 * f + h)  # INT4 codes + a float32 scale per output channel
    assert miss.ms - hit.ms == pytest.approx(L * k * expert / (m.flash_gbs * 1e6), rel=1e-9)
    assert half.ms == pytest.approx((hit.ms + miss.ms) / 2, rel=1e-9) and miss.bound == "flash"
    dense = lambda **kw: predict(L8, m, 64, decode=16, scheme="q4_0", strategy="cpu", **kw).decode_step.ms
    assert dense(ffn_sparsity=0.1, ffn_reuse=1.0) < dense(ffn_sparsity=0.1, ffn_reuse=0.5) < dense()
    with pytest.raises(ScheduleError, match="dense: experts from flash"):
        predict(L8, m, 64, decode=4, experts_in_flash=True)


def test_schedule_and_predict_price_a_chunked_prefill_alike(capsys):
    p = predict(L8, "snapdragon-8gen3", 1024, scheme="w8a8-shadow", strategy="mllm-npu", chunk=256)
    assert main(["schedule", "--model", str(L8), "--prompt-len", "1024", "--chunk", "256", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["cost_model"] == "snapdragon-8gen3" and out["makespan_ms"] == pytest.approx(p.prefill_ms, rel=1e-12)


def test_predict_cli_gives_the_json_fields_and_refuses_bad_input_in_one_line(capsys, tmp_path):
    assert main(["predict", "--model", str(L8), "--soc", "snapdragon-8gen3", "--prompt-len", "256", "--decode", "32",
                 "--batch", "4", "--scheme", "q4_0", "--strategy", "hetero", "--trace", str(tmp_path / "t.json"),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("prefill_ms", "prefill_tok_s", "decode_tok_s", "decode_tok_s_batch", "lanes", "bound", "shares"):
        assert key in out, key
    assert out["decode_tok_s_batch"] == pytest.approx(4 * out["decode_tok_s"]) and out["strategy"] == "hetero"
    assert out["bound"]["decode"] == "bandwidth" and set(out["lanes"]["decode"]) == {"gpu", "npu"}
    from edgeprobe.trace import Trace

    assert {e["lane"] for e in Trace.load(tmp_path / "t.json", process="decode step").events} == {"gpu", "npu"}
    assert set(STRATEGIES) == {"mllm-npu", "hetero", "gpu", "npu", "cpu"}
    for args, words in ((["--soc", "snapdragon-9"], "unknown SoC"), (["--strategy", "tpu"], "unknown strategy"),
                        (["--batch", "0"], "batch must be a positive"), (["--decode", "-1"], "decode must be 0"),
                        (["--expert-hit-rate", "2"], "expert_hit_rate must lie in"),
                        (["--scheme", "int3"], "cannot be planned")):
        rc = main(["predict", "--model", str(L1), "--prompt-len", "64", *args])
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and line.startswith("edgeprobe: error: ") and words in line, (args, line)
    assert not math.isnan(out["prefill_ms"])


def test_a_model_fitted_from_a_real_trace_is_the_same_roofline_with_its_lanes_refined(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_trace import LFM2, LFM2_CONFIG

    from edgeprobe.foreign import load_foreign
    from edgeprobe.foreign.align import align
    from edgeprobe.foreign.fit import fit
    from edgeprobe.graph import Weights, model_ops
    from edgeprobe.models import ModelConfig
    from edgeprobe.models.config import plan_manifest
    from edgeprobe.schedule.cost import fitted_time_us

    m = fit(align(load_foreign(LFM2), LFM2_CONFIG), name="lfm2-v79", base="snapdragon-8elite")
    assert m.held_out["median_rel_error"] < 0.41  # the fit of least relative error (was 41% by least squares)
    m.to_json(tmp_path / "fitted.json")
    cfg = ModelConfig(**LFM2_CONFIG)
    named = soc.load("snapdragon-8elite")
    for as_given in (m, tmp_path / "fitted.json"):
        p = predict(cfg, as_given, 256, decode=32, batch=2, scheme="q4_0", strategy="npu")
        assert p.soc == "lfm2-v79" and p.decode_tok_s > 0 and p.prefill_tok_s > 0
    refined = m.as_soc()
    ops = model_ops(Weights.of(plan_manifest(cfg, "q4_0")), 2)
    lin = next(o for o in ops if o["cost"][0] == "linear" and o["name"].endswith("ffn_gate"))
    f = m.fits["npu"]["linear"]
    assert f["flops_range"][0] <= lin["cost"][1] <= f["flops_range"][1]
    assert refined.op_cost(lin, "npu").us == fitted_time_us(f, lin["cost"][1], lin["cost"][2], 2)  # the trace's fit
    assert refined.op_cost(lin, "gpu") == named.op_cost(lin, "gpu")  # a lane it did not see: the named roofline
    wide = model_ops(Weights.of(plan_manifest(cfg, "q4_0")), 256)  # 128x the FLOPs it saw: the roofline again
    big = next(o for o in wide if o["name"].endswith("ffn_gate"))
    assert refined.op_cost(big, "npu") == named.op_cost(big, "npu")
    with pytest.raises(ScheduleError, match="needs a SoC base"):
        fit(align(load_foreign(LFM2), LFM2_CONFIG), base=None).as_soc()
