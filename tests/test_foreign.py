"""Readers of real phone traces (tests/data/foreign: excerpts quoted from public threads), their alignment to the model
template and the cost model fitted from them. Numbers are hand-computed from the fixtures' own lines."""
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgeprobe.errors import EdgeprobeError
from edgeprobe.foreign import ForeignTraceError, detect_format, load_foreign
from edgeprobe.foreign.align import align
from edgeprobe.foreign.fit import FittedCostModel, fit, fit_line, fit_samples, held_out, load_cost_model
from edgeprobe.schedule import ScheduleError
from edgeprobe.schedule.cost import _build_fitted

DATA = Path(__file__).parent / "data" / "foreign"
HEX = DATA / "llamacpp_hexagon" / "issue18139_mul_mat.log"
README = DATA / "llamacpp_hexagon" / "readme_stderr.log"
LFM2 = DATA / "chrome_json" / "lfm2_hexagon_v79.json"
CONFIGS = Path(__file__).parent / "data" / "configs"
# LFM2-1.2B's numbers as its source document gives them (SOURCE.md); its attention layers have Q/K norms
LFM2_CONFIG = dict(arch="lfm2", n_layers=16, hidden=2048, ffn=8192, n_heads=32, n_kv_heads=8, head_dim=64,
                   vocab_size=65536, qk_norm=True)


def _one_line_error(exc, path, where):
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and where in msg and "expected" in msg
    assert isinstance(exc.value, EdgeprobeError)


# ---- llama.cpp Hexagon per-op lines ------------------------------------------------------------
def test_hexagon_log_events_and_times_as_printed():
    t = load_foreign(HEX)
    assert t.meta["source"]["format"] == "llamacpp-hexagon-op" and detect_format(HEX) == "llamacpp-hexagon-op"
    assert len(t.events) == 4 and t.lanes == ["npu"]
    totals = [5053, 4972, 4960, 4957]
    starts = np.cumsum([0] + totals[:-1])
    assert [e["start_us"] for e in t.events] == list(map(float, starts))
    assert [e["end_us"] for e in t.events] == [float(s + d) for s, d in zip(starts, totals)]
    e = t.events[0]
    assert (e["kind"], e["name"], e["inputs"]) == ("MUL_MAT", "q_proj", ["leaf_0", "leaf_1"])
    assert e["input_shapes"] == [[4096, 4096, 1, 1], [4096, 64, 1, 1]] and e["shape"] == [4096, 64, 1, 1]
    assert (e["quant_us"], e["compute_us"], e["vtcm_us"], e["call_us"]) == (56, 4925, 68, 11)
    assert e["cycles"] == 10672609 and e["mhz"] == 10672609 / 4925  # the clock the line implies
    assert e["flops"] == 2 * 4096 * 4096 * 64
    assert all(x["measured"] is True and x["emulated"] is False for x in t.events)
    assert t.meta["skipped_lines"] == 4  # the fixture's quoting header
    assert t.metrics()["lanes"]["npu"]["ops"] == 4


def test_hexagon_mixed_log_skips_and_counts_other_lines(tmp_path):
    prof = [l for l in HEX.read_text().splitlines() if not l.startswith("#")]
    other = [l for l in README.read_text().splitlines() if not l.startswith("#")]
    mixed = tmp_path / "mixed.log"
    mixed.write_text("\n".join(other[:3] + prof[:2] + other[3:] + prof[2:]) + "\n")
    t = load_foreign(mixed)
    assert len(t.events) == 4 and t.meta["skipped_lines"] == len(other) == 7
    assert [e["line"] for e in t.events] == [4, 5, 10, 11]


def test_hexagon_truncated_and_unknown_records(tmp_path):
    lines = HEX.read_text().splitlines()
    cut = tmp_path / "truncated.log"
    cut.write_text("\n".join(lines[:-1] + [lines[-1][:lines[-1].index("(quant") + 9]]))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(cut, format="llamacpp-hexagon-op")
    _one_line_error(exc, cut, f"line {len(lines)}")
    odd = tmp_path / "unknown.log"
    odd.write_text("\n".join(lines[:5] + [lines[5].replace(" pkts ", " packets ")]))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(odd, format="llamacpp-hexagon-op")
    _one_line_error(exc, odd, "line 6")


def test_hexagon_log_without_profile_lines_is_an_error():
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(README, format="llamacpp-hexagon-op")
    _one_line_error(exc, README, "whole file")
    assert "among 10 lines" in str(exc.value)


# ---- Chrome trace JSON ----------------------------------------------------------------------------
def test_chrome_json_events_lanes_and_times():
    t = load_foreign(LFM2)
    assert detect_format(LFM2) == "chrome-json" and t.meta["source"]["format"] == "chrome-json"
    assert len(t.events) == 46 and t.meta["skipped_events"] == 6 and t.lanes == ["npu"]
    assert t.meta["threads"]["1/0"] == "HMX (matrix)"
    first, last = t.events[0], t.events[-1]
    assert (first["kind"], first["start_us"], first["end_us"], first["layer"]) == ("SCALE", 0.0, 14.0, 0)
    assert first["mhz"] == 30572 / 14
    assert (last["name"], last["start_us"], last["end_us"]) == ("MUL_MAT+ADD ffn_down", 2619.0, 2819.0)
    assert last["layer"] == 2
    gate = next(e for e in t.events if e["name"] == "MUL_MAT+MUL_MAT ffn_gate")
    assert gate["kind"] == "MUL_MAT+MUL_MAT" and gate["input_shapes"] == [[2048, 8192], [2048, 2], [2048, 8192]]
    assert gate["dtypes"] == ["q4_0", "f32", "q4_0"] and gate["tensors"] == "ffn_gate"
    swiglu = next(e for e in t.events if e["kind"] == "SWIGLU")
    assert swiglu["layer"] == 0  # from the ggml tensor name "ffn_gate-0"
    assert sum(e["end_us"] - e["start_us"] for e in t.events) == 2819.0
    assert all(e["measured"] is True and e["emulated"] is False for e in t.events)


def test_chrome_json_bad_inputs(tmp_path):
    bad = tmp_path / "cut.json"
    bad.write_text(LFM2.read_text()[:5000])
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(bad, format="chrome-json")
    _one_line_error(exc, bad, "column")
    other = tmp_path / "config.json"
    other.write_text(json.dumps(LFM2_CONFIG))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(other, format="chrome-json")
    _one_line_error(exc, other, "document")
    doc = json.loads(LFM2.read_text())
    del doc["traceEvents"][4]["dur"]
    nodur = tmp_path / "nodur.json"
    nodur.write_text(json.dumps(doc))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(nodur)
    _one_line_error(exc, nodur, "traceEvents[4]")
    with pytest.raises(ForeignTraceError) as exc:
        detect_format(other)
    _one_line_error(exc, other, "whole file")
    with pytest.raises(ForeignTraceError):
        load_foreign(LFM2, format="qnn-csv")


def test_imported_trace_writes_perfetto(tmp_path):
    out = load_foreign(LFM2).to_chrome_json(tmp_path / "trace.json")
    ev = json.loads(out.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in ev) == 46


# ---- alignment --------------------------------------------------------------------------------------
def test_alignment_share_and_unmatched_ops():
    a = align(load_foreign(LFM2), LFM2_CONFIG)
    matched = {0: [5, 4, 395, 18, 209], 1: [3, 3, 381, 12, 218], 2: [3, 84, 6, 16, 4, 4, 173, 60, 4, 391, 16, 200]}
    assert a.total_us == 2819.0 and a.matched_us == sum(map(sum, matched.values()))
    assert a.share == a.matched_us / 2819.0
    ev = a.trace.events
    gate = next(e for e in ev if e["name"] == "MUL_MAT+MUL_MAT ffn_gate")
    assert gate["template_ops"] == ["blk.0.ffn_gate", "blk.0.ffn_up"] and gate["group"] == "c0.l0.ffn"
    qkv = next(e for e in ev if e["kind"] == "MUL_MAT+MUL_MAT+MUL_MAT")
    assert qkv["template_ops"] == ["blk.2.attn_q", "blk.2.attn_k", "blk.2.attn_v"]
    assert [e["template_ops"] for e in ev if e["kind"] == "ROPE"] == [["blk.2.rope_q"], ["blk.2.rope_k"]]
    conv = [e for e in ev if e["kind"] == "SSM_CONV"]
    assert len(conv) == 2 and all("unmatched" in e and "template_ops" not in e for e in conv)
    assert sum(1 for e in ev if "unmatched" in e) + sum(map(len, matched.values())) == 46
    assert a.by_kind["SSM_CONV"]["unmatched_us"] == 42.0


def test_alignment_checks_weight_shapes():
    a = align(load_foreign(LFM2), {**LFM2_CONFIG, "ffn": 4096})
    gate = next(e for e in a.trace.events if e["name"] == "MUL_MAT+MUL_MAT ffn_gate")
    assert "template_ops" not in gate and "2048:8192" in gate["unmatched"]


# ---- fitted cost model --------------------------------------------------------------------------------
def _lawson_hanson(A, y):
    """Independent NNLS (Lawson & Hanson's active-set method) of min |A x - y|, x >= 0."""
    n = A.shape[1]
    x, passive = np.zeros(n), np.zeros(n, bool)
    for _ in range(50):
        w = A.T @ (y - A @ x)
        if passive.all() or w[~passive].max() <= 1e-12 * np.abs(A.T @ y).max():
            return x
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def _ref_fit(xs, ys, bs=None):
    """Independent fit of us = a + b * flops + c * bytes, a, b, c >= 0 (Lawson-Hanson), least squares of the
    relative error (each row over its us). The documented tie rule: bytes exactly proportional to FLOPs (one M) ->
    FLOPs dropped below 16 FLOP per byte (memory-bound), else bytes. Returns (a, b, c)."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    bs = np.zeros_like(xs) if bs is None else np.asarray(bs, float)
    cols = [np.ones_like(xs), xs, bs]
    keep = [True, True, bool(bs.any())]
    if bs.any() and np.linalg.matrix_rank(np.stack([xs / xs.max(), bs / bs.max()], 1)) < 2:
        keep[1 if xs.sum() < 16 * bs.sum() else 2] = False
    if len(set(zip(xs, bs))) < 2:  # one size: the rate (or bandwidth) alone, through the origin
        keep[0] = False
    idx = [i for i in range(3) if keep[i]]
    A = np.stack([cols[i] / cols[i].max() for i in idx], 1) / ys[:, None]
    sol = _lawson_hanson(A, np.ones_like(ys))
    out = [0.0, 0.0, 0.0]
    for i, v in zip(idx, sol):
        out[i] = v / cols[i].max()
    return tuple(out)


def _ref_pred(c, s):
    return c[0] + c[1] * s["flops"] + c[2] * s.get("bytes", 0)


def test_fit_held_out_error_recomputed_independently(tmp_path):
    a = align(load_foreign(LFM2), LFM2_CONFIG)
    m = fit(a, name="lfm2-sm8750")
    samples = a.samples()
    train = [s for s in samples if s["layer"] in (0, 2)]
    test = [s for s in samples if s["layer"] == 1]
    errs = []
    for s in test:
        same = [t for t in train if t["kind"] == s["kind"]]
        c = _ref_fit([t["flops"] for t in same], [t["us"] for t in same], [t["bytes"] for t in same])
        errs.append(abs(_ref_pred(c, s) - s["us"]) / s["us"])
    h = m.held_out
    assert h["n_predicted"] == len(test) == 5 and h["n_unseen_kind"] == 0
    assert h["median_rel_error"] == pytest.approx(np.median(errs), rel=1e-9)
    assert h["time_weighted_rel_error"] == pytest.approx(np.average(errs, weights=[s["us"] for s in test]), rel=1e-9)
    lin = [s for s in samples if s["kind"] == "linear"]
    ra, rb, rc = _ref_fit([s["flops"] for s in lin], [s["us"] for s in lin], [s["bytes"] for s in lin])
    f = m.fits["npu"]["linear"]
    # one M (2 rows) in the whole trace: bytes ∝ FLOPs, one regime, priced by FLOPs
    assert f["regime"] == "one: every op has M = 2" and "below" not in f and f["us_per_byte"] == rc == 0
    assert f["fixed_us"] == pytest.approx(ra, rel=1e-9) and f["us_per_flop"] == pytest.approx(rb, rel=1e-9)
    op = next(o for o in a.ops if o["name"] == "blk.5.ffn_down")
    assert m.op_time_us(op, "npu") == pytest.approx(ra + rb * op["cost"][1], rel=1e-12)
    path = tmp_path / "lfm2.json"
    m.to_json(path)
    assert json.loads(path.read_text())["version"] == 2
    again = load_cost_model(path)
    assert again == m and isinstance(again, FittedCostModel)


def _synthetic(kernels=True):
    """Ops of known cost: M < 3 a GEMV (5 µs + bytes / 50 B/µs), M >= 3 a GEMM (30 µs + 1 µs/MFLOP + 1 µs/kB);
    weights of 1 or 4 bytes each, so bytes and FLOPs are not proportional within a regime."""
    out = []
    for i, (k, n) in enumerate([(64, 128), (128, 128), (256, 64), (512, 256)]):
        for bpw in (1, 4):
            for m in (1, 2, 3, 8, 16):
                fl, by = 2 * m * k * n, bpw * k * n
                us = 5 + by / 50 if m < 3 else 30 + fl * 1e-6 + by * 1e-3
                out.append({"lane": "gpu", "kind": "linear", "flops": fl, "bytes": by, "rows": m, "us": us,
                            "kernel": ("gemv" if m < 3 else "gemm") if kernels else None, "name": f"w{i}.{bpw}",
                            "layer": 0})
    return out


def test_fit_recovers_known_coefficients_in_both_regimes():
    s = _synthetic()
    f = fit_line([x["flops"] for x in s], [x["us"] for x in s], [x["bytes"] for x in s], [x["rows"] for x in s],
                 [x["kernel"] for x in s], [x["name"] for x in s])
    assert f["regime"] == "two: M < 3 and M >= 3 (gemv / gemm)" and f["below"]["rows_lt"] == 3
    assert (f["fixed_us"], f["us_per_flop"], f["us_per_byte"]) == pytest.approx((30, 1e-6, 1e-3), rel=1e-9)
    b = f["below"]
    assert (b["fixed_us"], b["us_per_flop"], b["us_per_byte"]) == pytest.approx((5, 0, 0.02), rel=1e-9, abs=1e-15)
    assert b["bandwidth_gbs"] == pytest.approx(0.05, rel=1e-9) and f["fit_median_rel_error"] < 1e-9
    assert (b["rows_range"], f["rows_range"], b["kernels"], f["kernels"]) == ([1, 2], [3, 16], ["gemv"], ["gemm"])
    # without kernel names the threshold is found from the times alone (it halves the squared error)
    g = fit_line([x["flops"] for x in s], [x["us"] for x in s], [x["bytes"] for x in s], [x["rows"] for x in s])
    assert g["below"]["rows_lt"] == 3 and g["us_per_byte"] == pytest.approx(1e-3, rel=1e-9)
    # one law for every M, one kernel: one regime, said so; the bytes term still recovered
    one = [{**x, "us": 7 + x["flops"] * 2e-6 + x["bytes"] * 5e-3, "kernel": "gemm"} for x in s]
    h = fit_line([x["flops"] for x in one], [x["us"] for x in one], [x["bytes"] for x in one],
                 [x["rows"] for x in one], [x["kernel"] for x in one], [x["name"] for x in one])
    assert "below" not in h and h["regime"] == "one: no M threshold separates the kernels an op runs"
    assert (h["fixed_us"], h["us_per_flop"], h["us_per_byte"]) == pytest.approx((7, 2e-6, 5e-3), rel=1e-9)
    # too few ops below every threshold: one regime
    few = [x for x in s if x["rows"] != 2][:-12]
    assert "below" not in fit_line([x["flops"] for x in few], [x["us"] for x in few], [x["bytes"] for x in few],
                                   [1 if x["rows"] == 1 and i < 2 else 8 for i, x in enumerate(few)])
    # held out on the synthetic ops: exact
    h2 = held_out([{**x, "layer": i % 2} for i, x in enumerate(s)])
    assert h2["max_rel_error"] == pytest.approx(0, abs=1e-9)


def test_fitted_model_priced_per_regime_and_bytes_and_version_1_files_load(tmp_path):
    s = _synthetic()
    m = _build_fitted("syn", fit_samples(s), None, "synthetic", 0.0, {}, {}, {})
    op = lambda m_, fl, by: {"cost": ["linear", fl, by], "shape": [m_, 64], "lane": "gpu"}
    assert m.op_time_us(op(1, 2 * 64 * 64, 4096)) == pytest.approx(5 + 4096 / 50, rel=1e-9)
    assert m.op_time_us(op(32, 2 * 32 * 64 * 64, 4096)) == pytest.approx(30 + 2 * 32 * 4096e-6 + 4.096, rel=1e-9)
    v1 = tmp_path / "v1.json"  # a file written before the bytes term: FLOPs only
    v1.write_text(json.dumps({"format": "edgeprobe-fitted-cost-model", "version": 1, "name": "old", "source": "x",
                              "fits": {"npu": {"linear": {"fixed_us": 10.0, "us_per_flop": 1e-6, "rate_gflops": 1000.0,
                                                          "n": 3, "sizes": 2}}}, "base": "snapdragon-8gen3",
                              "sync_us": 100.0, "launch_us": {}, "held_out": {}, "trace_source": {}}))
    old = load_cost_model(v1)
    assert old.op_time_us({"cost": ["int8_linear", 4e6, 1e6], "shape": [1, 8], "lane": "npu"}) == 14.0
    assert old.rate("npu", "linear") == pytest.approx(1000.0)


def test_fitted_model_prices_schedules_and_rejects_other_json(tmp_path):
    from edgeprobe.models import ModelConfig
    from edgeprobe.models.config import plan_manifest
    from edgeprobe.schedule.graph import chunk_graph
    from edgeprobe.schedule.predict import predicted_schedule
    from edgeprobe.schedule.schedulers import schedule

    m = fit(align(load_foreign(LFM2), LFM2_CONFIG))
    assert set(m.fits) == {"npu"}
    g = chunk_graph(ModelConfig(**LFM2_CONFIG), 128, 64)
    sg = {x.name: x for x in g.subgraphs}
    # a lane the trace lacks (cpu) by the named base's roofline: its launch, the ops' FLOPs at the lane's FP32 rate
    # (element-wise work too: the file gives the CPU no vector rate), against the weights at its bandwidth
    assert sg["c0.l1.shadow"].costs == [("elementwise", 131072), ("float_sparse", 2097152), ("float_sparse", 524288),
                                        ("float_sparse", 524288)]
    from edgeprobe.schedule import cost_model

    cpu = cost_model("snapdragon-8gen3").lane("cpu")
    want = cpu.launch_us + 4 * cpu.op_us + max((131072 + 3145728) / (cpu.rate("fp32") * 1e3),
                                               sg["c0.l1.shadow"].weight_bytes / (cpu.bandwidth_gbs * 1e3))
    assert m.time_us(sg["c0.l1.shadow"]) == pytest.approx(want, rel=1e-12)
    # the fitted lane: one norm by the elementwise fit, three int8 linears by the linear fit (no bytes term in it)
    e, f = m.fits["npu"]["elementwise"], m.fits["npu"]["linear"]
    assert f["us_per_byte"] == 0 and "below" not in f
    assert sg["c0.l1.qkv"].costs == [("elementwise", 131072), ("int8_linear", 536870912), ("int8_linear", 134217728),
                                     ("int8_linear", 134217728)]
    assert m.time_us(sg["c0.l1.qkv"]) == pytest.approx(
        e["fixed_us"] + e["us_per_flop"] * 131072 + 3 * f["fixed_us"] + f["us_per_flop"] * 805306368, rel=1e-12)
    assert len(schedule(g, m, "ooo").slots) == len(g.subgraphs)
    # a config-only model: predicted_schedule plans it (float stand-ins) and prices each op of the graph
    lin = fit_samples([{**x, "lane": "npu"} for x in _synthetic()])["npu"]["linear"]
    fits = {"npu": {"linear": lin, "elementwise": {"fixed_us": 1.0, "us_per_flop": 1e-3}}}  # a version-1 fit beside
    syn = _build_fitted("syn", fits, "snapdragon-8gen3", "synthetic", 100.0, {}, {}, {})
    cfg = ModelConfig(**LFM2_CONFIG)
    graph, plan = predicted_schedule(cfg, 128, 64, "ooo", syn, scheme="float")
    assert [x.costs for x in graph.subgraphs] == [x.costs for x in chunk_graph(
        cfg, 128, 64, manifest=plan_manifest(cfg, "float")).subgraphs]
    # a slot of the npu lane, op by op at 64 rows: a norm (1 µs + 1 µs/kFLOP) and q, k, v in the GEMM regime
    # (30 µs + 1 µs/MFLOP + 1 µs/kB of weights)
    ops = graph.ops_of()
    assert [o["cost"] for o in ops["c0.l1.qkv"]] == [["elementwise", 131072, 0], ["linear", 536870912, 16777216],
                                                     ["linear", 134217728, 4194304], ["linear", 134217728, 4194304]]
    assert {o["shape"][0] for o in ops["c0.l1.qkv"]} == {64}
    _, s, e = plan.slots["c0.l1.qkv"]
    assert e - s == pytest.approx(1 + 131.072 + 3 * 30 + 805306368e-6 + 25165824e-3, rel=1e-9)
    head = next(o for o in graph.ops if o["name"] == "lm_head")  # 1 row: the GEMV regime, by its weight bytes
    assert head["shape"][0] == 1 and syn.op_time_us(head, "npu") == pytest.approx(5 + head["cost"][2] / 50, rel=1e-9)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "edgeprobe-fitted-cost-model", "version": 99}))
    with pytest.raises(ScheduleError) as exc:  # what `edgeprobe schedule` reports in one line
        load_cost_model(other)
    _one_line_error(exc, other, "document")


def test_fit_from_a_benchmark_log_without_layers():
    m = fit(load_foreign(HEX), base=None)
    us, flops = [5053, 4972, 4960, 4957], 2 * 4096 * 4096 * 64
    # one size: a rate alone, of least relative error: sum(1/u) / sum(1/u^2) (even-indexed ops train)
    rel_mean = lambda v: np.sum(1 / np.asarray(v, float)) / np.sum(1 / np.asarray(v, float) ** 2)
    b = rel_mean([us[0], us[2]]) / flops
    errs = [abs(b * flops - u) / u for u in (us[1], us[3])]
    assert m.held_out["median_rel_error"] == pytest.approx(np.median(errs), rel=1e-12)
    assert m.fits["npu"]["MUL_MAT"]["us_per_flop"] == pytest.approx(rel_mean(us) / flops, rel=1e-12)
    assert m.fits["npu"]["MUL_MAT"]["regime"] == "one: every op has M = 64"
    assert fit_line([1.0, 2.0], [3.0, 5.0])["fixed_us"] == pytest.approx(1.0)


def _cli(argv, capsys) -> tuple[int, str, str]:
    from edgeprobe.cli import main

    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_import_bad_input_is_one_line_naming_file_line_and_format(tmp_path, capsys):
    lines = HEX.read_text().splitlines()
    cut = tmp_path / "truncated.log"
    cut.write_text("\n".join(lines[:-1] + [lines[-1][:120]]) + "\n")  # a log cut mid-line (the process killed)
    rc, out, err = _cli(["trace", "import", str(cut), "--out", str(tmp_path / "o1")], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert str(cut) in err and f"line {len(lines)}:" in err and "expected llama.cpp Hexagon per-op profile" in err
    other = tmp_path / "config.json"
    other.write_text(json.dumps(LFM2_CONFIG))
    rc, out, err = _cli(["trace", "import", str(other), "--out", str(tmp_path / "o2")], capsys)
    assert rc == 2 and err.count("\n") == 1 and str(other) in err and "whole file" in err
    assert "expected one of: llamacpp-hexagon-op, llamacpp-hexagon-profile-op, chrome-json" in err
    rc, out, err = _cli(["trace", "import", str(other), "--format", "chrome-json", "--out", str(tmp_path / "o3")],
                        capsys)
    assert rc == 2 and err.count("\n") == 1 and f"{other}: document:" in err and "Chrome trace-event JSON" in err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()  # nothing written for a bad file


def test_cli_import_mixed_log_reports_the_lines_skipped(tmp_path, capsys):
    prof = [l for l in HEX.read_text().splitlines() if not l.startswith("#")]
    other = [l for l in README.read_text().splitlines() if not l.startswith("#")]
    mixed = tmp_path / "mixed.log"
    mixed.write_text("\n".join([other[0], prof[0], other[1], other[2], prof[1], prof[2]] + other[3:] + prof[3:]))
    rc, out, _ = _cli(["trace", "import", str(mixed), "--out", str(tmp_path / "o"), "--json"], capsys)
    s = json.loads(out)
    assert rc == 0 and (s["events"], s["skipped"], s["format"]) == (4, 7, "llamacpp-hexagon-op")
    rc, out, _ = _cli(["trace", "import", str(mixed), "--out", str(tmp_path / "o")], capsys)
    assert rc == 0 and "read 4 events" in out and "7 records skipped" in out


def test_chrome_json_bad_records_name_their_index(tmp_path):
    doc = json.loads(LFM2.read_text())
    nph = json.loads(json.dumps(doc))
    del nph["traceEvents"][7]["ph"]
    p = tmp_path / "noph.json"
    p.write_text(json.dumps(nph))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(p, format="chrome-json")
    _one_line_error(exc, p, "traceEvents[7]")
    lone = {"traceEvents": doc["traceEvents"][:4] + [{"ph": "E", "pid": 1, "tid": 1, "ts": 5.0}]}
    p = tmp_path / "lone_end.json"
    p.write_text(json.dumps(lone))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(p)
    _one_line_error(exc, p, "traceEvents[4]")
    p = tmp_path / "numbers.json"
    p.write_text("[1, 2, 3]")
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(p, format="chrome-json")
    _one_line_error(exc, p, "document[0]")
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(tmp_path / "absent.json")
    _one_line_error(exc, tmp_path / "absent.json", "file")


def test_edgeprobe_own_traces_are_not_imported_as_measured(tmp_path):
    from edgeprobe.trace import Trace

    t = load_foreign(LFM2)
    chrome = t.to_chrome_json(tmp_path / "ours.json")
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(chrome)
    _one_line_error(exc, chrome, "document")
    assert "edgeprobe wrote" in str(exc.value)
    assert len(Trace.load(chrome).events) == 46  # what opens it instead
    saved = t.save(tmp_path / "saved.json")
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(saved)
    _one_line_error(exc, saved, "whole file")
    assert "edgeprobe wrote" in str(exc.value)


PROF2 = DATA / "llamacpp_hexagon" / "profile_op_level2.log"
PROF3 = DATA / "llamacpp_hexagon" / "profile_op_level3.log"


def test_hexagon_profile_op_lines_of_today_read_as_printed():
    t = load_foreign(PROF2)
    assert detect_format(PROF2) == t.meta["source"]["format"] == "llamacpp-hexagon-profile-op"
    assert [e["name"] for e in t.events] == ["attn_norm-0", "Qcur-0", "Kcur-0", "Vcur-0", "ffn_gate-0", "ffn_up-0"]
    assert [b["n_ops"] for b in t.meta["batches"]] == [4, 2] and [e["batch"] for e in t.events] == [0, 0, 0, 0, 1, 1]
    q = t.events[1]
    assert (q["kind"], q["inputs"], q["dtypes"], q["kernel"]) == (
        "MUL_MAT", ["blk.0.attn_q.weight", "attn_norm-0"], ["q4_0", "f32", "f32"], "hmx-tiled vtcm 4194304")
    assert q["input_shapes"] == [[2048, 2048], [2048, 64]] and q["shape"] == [2048, 64] and q["layer"] == 0
    assert q["flops"] == 2 * 2048 * 2048 * 64 and q["pmu"] == [2000 + k for k in range(8)]
    # times from each line's start cycle (its low 32 bits unwrapped against the batch's 64-bit start) over its mhz
    line = PROF2.read_text().splitlines()[q["line"] - 1]
    start, mhz = int(line.split(" start ")[1].split()[0]), float(line.split(" mhz ")[1].split()[0])
    base = t.meta["batches"][0]["start_cycles"]
    assert q["start_us"] == ((base >> 32 << 32) + start - base) / mhz and q["end_us"] - q["start_us"] == 176
    assert t.events[0]["kind"] == "RMS_NORM+MUL" and t.events[0]["kernel"] == "----"
    assert all(a["end_us"] <= b["start_us"] for a, b in zip(t.events, t.events[1:]))  # one op at a time


def test_hexagon_level_3_trace_events_pair_on_hvx_and_hmx_threads():
    t = load_foreign(PROF3)
    hmx = [e for e in t.events if e["lane"] == "hmx"]
    hvx = [e for e in t.events if e["lane"] == "hvx"]
    assert len(hmx) == 5 and len(hvx) == 4 and t.meta["unpaired_trace_events"] == 0
    assert t.meta["batches"][0]["evt_cnt"] == [2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 6]
    mm = {e["name"]: e for e in t.events if e["lane"] == "npu"}
    for e in hmx:  # each HMX computation inside the matmul it belongs to
        op = [o for o in mm.values() if o["batch"] == e["batch"] and o["start_us"] <= e["start_us"] <= o["end_us"]]
        assert len(op) == 1 and op[0]["kind"] == "MUL_MAT" and e["end_us"] <= op[0]["end_us"]


def test_a_profile_op_line_of_today_imports_and_aligns():
    from edgeprobe.foreign.align import align

    a = align(load_foreign(PROF2), CONFIGS / "llama-3.2-1b")
    assert a.share == 1.0
    assert [e["template_ops"] for e in a.trace.events] == [["blk.0.attn_norm"], ["blk.0.attn_q"], ["blk.0.attn_k"],
                                                           ["blk.0.attn_v"], ["blk.0.ffn_gate"], ["blk.0.ffn_up"]]


def test_hexagon_profile_op_mixed_stderr_and_wrong_lines(tmp_path):
    prof = PROF2.read_text().splitlines()
    other = [l for l in README.read_text().splitlines() if not l.startswith("#")]
    mixed = tmp_path / "mixed.log"
    mixed.write_text("\n".join(other[:3] + ["0.01.576.635 D " + prof[0]] + prof[1:4] + other[3:] + prof[4:]) + "\n")
    t = load_foreign(mixed)  # a log timestamp before `ggml-hex:` is allowed
    assert len(t.events) == 6 and t.meta["skipped_lines"] == len(other)
    for name, lines, where, what in (
            ("cut", prof[:2] + [prof[2][:prof[2].index("|usec") + 8]], "line 3", "truncated or unknown"),
            ("short", prof[:4] + prof[5:], "line 5", "batch 0 announced 4 ops and 3 followed"),
            ("orphan", prof[1:], "line 1", "outside a batch"),
            ("evt", prof[:2] + ["ggml-hex: HTP0 trace-evt HMX_COMP: thread 10 info 1 begin 5"], "line 3",
             "trace-evt record unknown")):
        bad = tmp_path / f"{name}.log"
        bad.write_text("\n".join(lines) + "\n")
        with pytest.raises(ForeignTraceError) as exc:
            load_foreign(bad, format="llamacpp-hexagon-profile-op")
        _one_line_error(exc, bad, where)
        assert what in str(exc.value)
    old = tmp_path / "old.log"  # the older form, given to today's reader: named, not misread
    old.write_text(HEX.read_text())
    with pytest.raises(ForeignTraceError, match="no profile-op line of an op"):
        load_foreign(old, format="llamacpp-hexagon-profile-op")


# ---- llama.cpp OpenCL cl_profiling.csv (Adreno) ---------------------------------------------------------------
OPENCL = DATA / "llamacpp_opencl" / "eagle_adreno_cl_profiling.csv"
# the EAGLE draft layer of the fixture, shapes read from its output sizes (SOURCE.md): one Llama-3-8B-shaped layer
EAGLE_CONFIG = dict(arch="llama", n_layers=1, hidden=4096, ffn=14336, n_heads=32, n_kv_heads=8, head_dim=128,
                    vocab_size=128256)


def _csv_rows():
    return [l.split(",") for l in OPENCL.read_text().splitlines()[1:]]


def test_opencl_csv_events_and_times_as_written():
    t = load_foreign(OPENCL)
    rows = _csv_rows()
    assert detect_format(OPENCL) == "llamacpp-opencl-csv" and t.meta["source"]["format"] == "llamacpp-opencl-csv"
    assert len(t.events) == len(rows) == 118 and t.lanes == ["gpu"]
    ends = np.cumsum([float(r[2]) * 1e3 for r in rows])
    assert [e["end_us"] for e in t.events] == pytest.approx(list(ends), rel=1e-12)
    assert [e["start_us"] for e in t.events][1:] == pytest.approx(list(ends[:-1]), rel=1e-12)
    q = t.events[4]
    assert (q["name"], q["kernel"], q["kind"], q["layer"]) == ("Qcur-0", "kernel_mul_mat_Ab_Bi_8x4", "MUL_MAT", 0)
    assert q["shape"] == [4096, 2, 1, 1] and q["rows"] == 2 and q["global_size"] == [1, 1024, 32]
    rope = t.events[5]
    assert (rope["kind"], rope["shape"], rope["rows"]) == ("ROPE", [128, 32, 2, 1], 2)  # [head_dim, heads, tokens]
    kinds = {e["kernel"]: e["kind"] for e in t.events}
    assert kinds["kernel_gemv_noshuffle"] == kinds["mul_mm_f16_f32_kq"] == "MUL_MAT"
    assert (kinds["kernel_transpose_32_16"], kinds["kernel_rms_norm_mul"]) == ("TRANSPOSE", "RMS_NORM+MUL")
    assert t.events[0]["layer"] == -1 and next(e for e in t.events if e["name"].startswith("cache_k_l0"))["layer"] == 0
    assert all(e["measured"] is True and e["emulated"] is False for e in t.events)


def test_opencl_csv_alignment_rows_per_pass_and_held_out():
    a = align(load_foreign(OPENCL), EAGLE_CONFIG)
    ev = a.trace.events
    # four passes; each matched linear priced by the template over the rows the kernel's output says it ran
    passes = [e for e in ev if e.get("template_ops") == ["blk.0.attn_q"]]
    assert [e["pass"] for e in passes] == [0, 1, 2, 3] and [e["rows"] for e in passes] == [2, 33, 1, 4]
    flops = [s["flops"] for s in a.samples() if s["template_ops"] == ["blk.0.attn_q"]]
    assert flops == [2 * 4096 * 4096 * r for r in (2, 33, 1, 4)]
    down = [s for s in a.samples() if s["template_ops"] == ["blk.0.ffn_down"]]
    assert [s["flops"] for s in down] == [2 * 14336 * 4096 * r for r in (1, 1, 1, 4)]  # last-layer rows cut to 1
    un = {e["kind"] for e in ev if "unmatched" in e}
    assert {"TRANSPOSE", "SET_ROWS", "SOFT_MAX"} <= un and "SWIGLU" not in un
    assert next(e for e in ev if e["name"] == "inp_embd_fc_out")["unmatched"] == "no layer of the model"
    head = [s for s in a.samples() if s["template_ops"] == ["lm_head"]]  # llama.cpp's result_output
    assert [s["flops"] for s in head] == [2 * 4096 * 128256] * 3
    # the template's LM head takes the last row; the draft model's fourth pass asks logits for all 4
    four = [e for e in ev if e["name"] == "result_output" and e["kind"] == "MUL_MAT"][3]
    assert four["unmatched"] == "the template computes lm_head on 1 rows, the trace on 4"
    rows = _csv_rows()
    assert a.total_us == pytest.approx(sum(float(r[2]) * 1e3 for r in rows), rel=1e-12)
    matched = sum(float(r[2]) * 1e3 for r, e in zip(rows, ev) if e.get("template_ops"))
    assert a.matched_us == pytest.approx(matched, rel=1e-12)
    m = fit(a, name="adreno")
    # the trace's kernels: a matmul runs kernel_gemv_noshuffle at 1 row and kernel_mul_mat_Ab_Bi_8x4 at 2 and more
    # (the LM head keeps Ab_Bi at 1 row); elementwise kernels do not change with rows
    samples = a.samples()
    lin = m.fits["gpu"]["linear"]
    assert lin["regime"] == "two: M < 2 and M >= 2 (kernel_gemv_noshuffle / kernel_mul_mat_Ab_Bi_8x4)"
    assert lin["below"]["kernels"] == ["kernel_gemv_noshuffle", "kernel_mul_mat_Ab_Bi_8x4"]
    assert "below" not in m.fits["gpu"]["elementwise"]
    train = [s for s in samples if s["pass"] in (0, 2)]
    errs, w = [], []
    for s in (s for s in samples if s["pass"] in (1, 3)):
        gemv = s["kind"] == "linear" and s["rows"] < 2
        same = [x for x in train if x["kind"] == s["kind"] and (s["kind"] != "linear" or (x["rows"] < 2) == gemv)]
        c = _ref_fit([x["flops"] for x in same], [x["us"] for x in same], [x["bytes"] for x in same])
        errs.append(abs(_ref_pred(c, s) - s["us"]) / s["us"])
        w.append(s["us"])
    assert m.held_out["split"].startswith("one layer") and m.held_out["n_predicted"] == len(errs) == 23
    assert m.held_out["median_rel_error"] == pytest.approx(np.median(errs), rel=1e-9)
    assert m.held_out["time_weighted_rel_error"] == pytest.approx(np.average(errs, weights=w), rel=1e-9)
    # 1-row matmuls are priced by their weight bytes (the GEMV streams them), not their FLOPs
    assert lin["below"]["us_per_flop"] == 0 and lin["below"]["bandwidth_gbs"] > 0


def test_opencl_csv_bad_input(tmp_path):
    lines = OPENCL.read_text().splitlines()
    cut = tmp_path / "cut.csv"
    cut.write_text("\n".join(lines[:10] + [lines[10][:30]]))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(cut)
    _one_line_error(exc, cut, "line 11")
    odd = tmp_path / "odd.csv"
    odd.write_text("\n".join(lines[:5] + ["ggml_opencl: flushing profiling events"] + lines[5:8]))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(odd)
    _one_line_error(exc, odd, "line 6")
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(lines[:3] + [lines[3].replace("0.465920", "fast")]))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(bad)
    _one_line_error(exc, bad, "line 4")
    nohead = tmp_path / "nohead.csv"
    nohead.write_text("\n".join(lines[1:]))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(nohead, format="llamacpp-opencl-csv")
    _one_line_error(exc, nohead, "line 1")
    only = tmp_path / "header.csv"
    only.write_text(lines[0] + "\n")
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(only)
    _one_line_error(exc, only, "whole file")


def test_cli_imports_the_opencl_csv_by_its_header(tmp_path, capsys):
    rc, out, _ = _cli(["trace", "import", str(OPENCL), "--out", str(tmp_path / "o"), "--json"], capsys)
    s = json.loads(out)
    assert rc == 0 and (s["format"], s["events"], s["lanes"]) == ("llamacpp-opencl-csv", 118, ["gpu"])
    assert json.loads((tmp_path / "o" / "trace.json").read_text())["traceEvents"]


# ---- ExecuTorch ETDump -------------------------------------------------------------------------
# The file ExecuTorch's runtime wrote for its devtools tutorial (executorch_etdump/SOURCE.md). Expected numbers come
# from the file's bytes at offsets read off a hex dump, not from the reader's flatbuffer walk.
ETDP = DATA / "executorch_etdump" / "devtools_tutorial.etdp"
ETDUMP = "executorch-etdump"
# (byte offset of a ProfileEvent's start_time, its end_time follows) -> its name, from `xxd` of the fixture
RAW = {0xB8: "Method::execute", 0xE0: "OPERATOR_CALL", 0x108: "native_call_addmm.out"}


def test_etdump_events_runs_and_lanes():
    t = load_foreign(ETDP)
    assert detect_format(ETDP) == ETDUMP and t.meta["source"] == {"tool": "ExecuTorch ETDump", "format": ETDUMP,
                                                                "version": 0}
    assert t.meta["runs"] == [{"name": "Default", "bundled_input_index": -1},
                              {"name": "Execute", "bundled_input_index": -1}]
    assert len(t.events) == 31 and t.lanes == ["cpu"] and t.meta["skipped_events"] == 0
    assert [e["name"] for e in t.events if e["run"] == 0] == ["Method::init", "Program::load_method"]
    kernels = [e for e in t.events if e["kind"] != "runtime"]
    # the tutorial's CNN, instruction by instruction: conv-relu-pool twice, then three linear layers
    assert [e["kind"] for e in kernels] == ["convolution", "relu", "max_pool2d_with_indices"] * 2 + [
        "permute_copy", "addmm", "relu"] * 2 + ["permute_copy", "addmm"]
    assert [e["instruction_id"] for e in kernels] == list(range(14)) and {e["chain_index"] for e in kernels} == {0}
    assert sum(e["name"] == "OPERATOR_CALL" for e in t.events) == 14
    assert all(e["measured"] is True and e["emulated"] is False for e in t.events)


def test_etdump_ticks_to_us_checked_against_the_bytes():
    data = ETDP.read_bytes()
    t = load_foreign(ETDP)
    t0 = t.meta["time"]["origin_ticks"]
    assert t0 == min(e["start_ticks"] for e in t.events)
    for off, name in RAW.items():
        start, end = struct.unpack_from("<QQ", data, off)
        e = next(e for e in t.events if e["start_ticks"] == start)
        assert (e["name"], e["end_ticks"]) == (name, end)
        assert (e["start_us"], e["end_us"]) == ((start - t0) / 1e3, (end - t0) / 1e3)  # ns ticks -> µs
    execute = next(e for e in t.events if e["name"] == "Method::execute")
    assert execute["end_us"] - execute["start_us"] == (2324134 - 425313) / 1e3  # 0x2376a6 - 0x067d61 ns
    inner = [e for e in t.events if e["run"] == 1 and e is not execute]
    assert all(execute["start_us"] <= e["start_us"] <= e["end_us"] <= execute["end_us"] for e in inner)


# ExecuTorch's reader in its own process: importing executorch loads its torch ops and dialects, kept out of the suite's
_EXECUTORCH_READS = """
import json, sys
from executorch.devtools.etdump.serialize import deserialize_from_etdump_flatcc
et = deserialize_from_etdump_flatcc(open(sys.argv[1], "rb").read())
runs = [{"name": r.name, "bundled_input_index": r.bundled_input_index} for r in et.run_data]
events = [(r, k, pe.name, pe.start_time, pe.end_time, pe.chain_index, pe.instruction_id,
           pe.delegate_debug_id_str or (pe.delegate_debug_id_int if pe.delegate_debug_id_int != -1 else None))
          for r, run in enumerate(et.run_data) for k, pe in enumerate(ev.profile_event for ev in run.events)
          if pe is not None]
print(json.dumps({"version": et.version, "runs": runs, "events": events}))
"""


def test_etdump_reads_as_executorchs_own_deserializer():
    """ExecuTorch's own reader (executorch 1.5.1's deserialize_from_etdump_flatcc: its flatc and its schema, a test-only
    reference installed by the test setup) finds the fixture's runs and profile events as edgeprobe's reader does,
    field for field."""
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _EXECUTORCH_READS, str(ETDP)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    et = json.loads(r.stdout.strip().splitlines()[-1])
    t = load_foreign(ETDP)
    assert et["version"] == t.meta["source"]["version"] == 0 and et["runs"] == t.meta["runs"]
    ours = [[e["run"], e["record"], e["name"], e["start_ticks"], e["end_ticks"], e["chain_index"], e["instruction_id"],
             e.get("delegate_debug_id")] for e in t.events]
    assert len(et["events"]) == 31 and ours == et["events"]


def test_etdump_writes_perfetto_and_imports_through_the_cli(tmp_path, capsys):
    from edgeprobe.cli import main

    rc = main(["trace", "import", str(ETDP), "--out", str(tmp_path / "o"), "--json"])
    s = json.loads(capsys.readouterr()[0])
    assert rc == 0 and (s["format"], s["events"], s["lanes"]) == (ETDUMP, 31, ["cpu"])
    ev = json.loads((tmp_path / "o" / "trace.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in ev) == 31


def _minimal_etdump(version: int) -> bytes:
    # a size-prefixed flatbuffer of one ETDump table holding only `version`: root offset, "ED00", vtable, table
    body = struct.pack("<I4sHHHxxiI", 16, b"ED00", 6, 8, 4, 8, version)
    return struct.pack("<I", len(body)) + body


def test_etdump_bad_input(tmp_path):
    other = tmp_path / "v1.etdp"
    other.write_bytes(_minimal_etdump(1))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(other)
    _one_line_error(exc, other, "ETDump.version")
    assert "schema version 1, not 0" in str(exc.value)
    empty = tmp_path / "v0.etdp"
    empty.write_bytes(_minimal_etdump(0))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(empty)
    _one_line_error(exc, empty, "run_data")
    data = ETDP.read_bytes()
    cut = tmp_path / "truncated.etdp"
    cut.write_bytes(data[:1500])
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(cut, format=ETDUMP)
    _one_line_error(exc, cut, "byte 0")
    assert "truncated" in str(exc.value)
    relabelled = tmp_path / "relabelled.etdp"  # a cut file whose size prefix was made to agree: offsets run past
    relabelled.write_bytes(struct.pack("<I", 1496) + data[4:1500])
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(relabelled, format=ETDUMP)
    _one_line_error(exc, relabelled, "byte ")
    assert "past the end" in str(exc.value)
    text = tmp_path / "not.etdp"
    text.write_text("ggml-hex: HTP0 hwinfo\n")
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(text, format=ETDUMP)
    _one_line_error(exc, text, "bytes 4-12")
