"""The QNN HTP optrace reader (qnn-profile-viewer's Chrome JSON, ts/dur in HTP cycles) on a real excerpt
(tests/data/foreign/qnn_optrace/SOURCE.md). Expected numbers are the fixture's own ts/dur and the clock its run trace
states, divided by hand."""
import json
import shutil
from pathlib import Path

import pytest

from edgeprobe.errors import EdgeprobeError
from edgeprobe.foreign import ForeignTraceError, detect_format, load_foreign
from edgeprobe.foreign.align import align
from edgeprobe.foreign.fit import fit
from edgeprobe.trace import Trace

DATA = Path(__file__).parent / "data" / "foreign" / "qnn_optrace"
OPTRACE = DATA / "ovl_pos_s256_chain8_chrometrace.json"
RUNTRACE = DATA / "ovl_pos_s256_chain8_chrometrace_runtrace.json"
MHZ = 806.365  # the run trace's first Graph Execute: summary_htp_frequency_ghz 0.806365
# the eight FullyConnected ops' q::ConvLayer_s1.opt on HMX: (ts, dur) in cycles, as the fixture's lines give them
HMX = [(40057, 4095), (44188, 1181), (45387, 1178), (46737, 1170), (48055, 1172), (49379, 1179), (50697, 1168),
       (52009, 1169)]
LLAMA_1B = Path(__file__).parent / "data" / "configs" / "llama-3.2-1b"


def _one_line_error(exc, path, where):
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and where in msg and "expected" in msg
    assert isinstance(exc.value, EdgeprobeError)


def _copy(tmp_path, text=None, runtrace=True):
    """The optrace (or `text` in its place) in tmp_path, with the run trace beside it unless told otherwise."""
    p = tmp_path / "chrometrace.json"
    p.write_text(OPTRACE.read_text() if text is None else text)
    if runtrace:
        shutil.copy(RUNTRACE, tmp_path / "chrometrace_runtrace.json")
    return p


def test_optrace_events_lanes_and_times():
    t = load_foreign(OPTRACE)
    assert detect_format(OPTRACE) == "qnn-optrace" and t.meta["source"]["format"] == "qnn-optrace"
    assert t.meta["source"]["version"] == "OP_TRACE 1.1.0"
    # 51 entries: 19 executed ops of Core 0 Overview; 9 copies on QNN-op processes; $Const and q::Reshape (tid 1)
    # not executed; 4 flow records and 5 counters; 14 metadata records (not counted)
    assert len(t.events) == 19
    assert t.meta["skipped"] == {"per_qnn_op_copies": 9, "not_executed": 2, "flows_counters_other": 9}
    assert t.meta["time"]["clock_mhz"] == pytest.approx(MHZ, rel=1e-12)
    assert "traceEvents[3] Graph Execute" in t.meta["time"]["clock_from"]
    assert sorted(t.lanes) == ["dma", "hmx", "npu"]
    hmx = [e for e in t.events if e["kernel"] == "q::ConvLayer_s1.opt"]
    assert [e["name"] for e in hmx] == [f"MatMul_{i}" for i in range(8)]
    assert all(e["lane"] == "hmx" and e["kind"] == "FullyConnected" and e["flags"] == ["uses_hmx"] for e in hmx)
    assert [e["cycles"] for e in hmx] == [d for _, d in HMX]
    for e, (ts, dur) in zip(hmx, HMX):
        assert e["start_us"] == pytest.approx(ts / MHZ, rel=1e-12)
        assert e["end_us"] == pytest.approx((ts + dur) / MHZ, rel=1e-12)
    assert hmx[0]["end_us"] - hmx[0]["start_us"] == pytest.approx(5.0783454, abs=1e-6)  # 4095 / 806.365
    assert hmx[0]["shape"] == [1, 8, 32, 256] and hmx[0]["dtype"] == "QUInt8"
    assert hmx[0]["input_ops"][:2] == ["0x0000120300000012", "0x0000121000000012"]
    assert (hmx[0]["thread"], hmx[0]["tid"], hmx[0]["core"]) == ("Type: HMX", 256, 0)
    # every op's Start Cycle is its ts from one origin: the timeline is the trace's, not laid end to end
    assert {e["start_cycle"] - round(e["start_us"] * MHZ) for e in t.events} == {7997466066654}
    crouton = next(e for e in t.events if e["kernel"] == "q::ForceFormat_Crouton")
    assert (crouton["lane"], crouton["thread"], crouton["tid"], crouton["cycles"]) == ("npu", "Type: HVX", 512, 24061)
    # a DMA wait on the HMX thread: the Flags put it on the dma lane; its dominant-path share is kept apart
    wait = next(e for e in t.events if e["flags"] == ["dma_wait"] and e["name"] == "MatMul_3" and e["cycles"] == 5604)
    assert (wait["lane"], wait["thread"], wait["dominant_path_cycles"]) == ("dma", "Type: HMX", 34)
    assert [e["start_us"] for e in t.events] == sorted(e["start_us"] for e in t.events)
    dma = [3267, 1157, 3225, 1326, 3394, 5604, 121, 3062]  # the Flags dma/dma_set/dma_wait ops' dur, in file order
    assert sorted(e["cycles"] for e in t.events if e["lane"] == "dma") == sorted(dma)
    assert all(e["measured"] is True and e["emulated"] is False for e in t.events)


def test_optrace_clock_given_or_missing_or_of_another_run(tmp_path):
    from edgeprobe.foreign.qnn_profile import read

    events, meta = read(_copy(tmp_path, runtrace=False), mhz=1000.0)
    first = next(e for e in events if e["kernel"] == "q::ConvLayer_s1.opt")
    assert (first["start_us"], first["end_us"]) == (40.057, 44.152)
    assert meta["time"]["clock_from"] == "given by the caller"
    (tmp_path / "lone").mkdir()
    lone = _copy(tmp_path / "lone", runtrace=False)
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(lone)
    _one_line_error(exc, lone, "clock")
    assert "chrometrace_runtrace.json" in str(exc.value)
    other = tmp_path / "other"
    other.mkdir()
    p = _copy(other)
    doc = json.loads(RUNTRACE.read_text())
    for r in doc["traceEvents"]:
        if r.get("name") == "Graph Execute":
            r["args"]["stat_start_cycles"] += 10**6
            r["args"]["stat_end_cycles"] += 10**6
    rt = other / "chrometrace_runtrace.json"
    rt.write_text(json.dumps(doc))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(p)
    _one_line_error(exc, rt, "Graph Execute")


def test_optrace_bad_inputs(tmp_path):
    text = OPTRACE.read_text()
    cut = _copy(tmp_path, text[:len(text) // 2])
    assert detect_format(cut) == "qnn-optrace"  # known by its header, unreadable by its body
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(cut)
    _one_line_error(exc, cut, "column")
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(RUNTRACE)  # the run trace is QNN's too, but not the per-op trace
    _one_line_error(exc, RUNTRACE, "header")
    assert "RUN_TRACE" in str(exc.value)
    doc = json.loads(text)
    del doc["traceEvents"][15]["dur"]  # MatMul_0's q::ConvLayer_s1.opt
    nodur = tmp_path / "nodur" / "chrometrace.json"
    nodur.parent.mkdir()
    nodur.write_text(json.dumps(doc))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(nodur)
    _one_line_error(exc, nodur, "traceEvents[15]")
    doc = json.loads(text)
    del doc["traceEvents"][4]["ph"]
    noph = tmp_path / "noph.json"
    noph.write_text(json.dumps(doc))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(noph, format="qnn-optrace")
    _one_line_error(exc, noph, "traceEvents[4]")
    doc = json.loads(text)
    doc["traceEvents"] = [r for r in doc["traceEvents"] if "Start Cycle" not in r.get("args", {})]
    idle = tmp_path / "idle.json"
    idle.write_text(json.dumps(doc))
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(idle)
    _one_line_error(exc, idle, "traceEvents")
    # the generic Chrome JSON reader is not given QNN's cycles as µs
    lfm2 = Path(__file__).parent / "data" / "foreign" / "chrome_json" / "lfm2_hexagon_v79.json"
    assert detect_format(lfm2) == "chrome-json"


def test_optrace_writes_perfetto_and_imports_through_the_cli(tmp_path, capsys):
    from edgeprobe.cli import main

    out = load_foreign(OPTRACE).to_chrome_json(tmp_path / "trace.json")
    assert sum(e["ph"] == "X" for e in json.loads(out.read_text())["traceEvents"]) == 19
    rc = main(["trace", "import", str(OPTRACE), "--out", str(tmp_path / "o"), "--json"])
    s = json.loads(capsys.readouterr().out)
    assert rc == 0 and (s["format"], s["events"]) == ("qnn-optrace", 19)
    assert sorted(s["lanes"]) == ["dma", "hmx", "npu"]


def test_optrace_alignment():
    """The excerpt's graph is eight bare 256x256 FullyConnected ops, not a transformer layer: aligned to a Llama
    template nothing maps (its op names carry no layer)."""
    t = load_foreign(OPTRACE)
    a = align(t, LLAMA_1B, tokens=256)
    assert a.share == 0.0 and a.total_us == pytest.approx(sum(e["end_us"] - e["start_us"] for e in t.events))
    assert {e["unmatched"] for e in a.trace.events} == {"no layer of the model"}
    # 8 q::ConvLayer_s1.opt, MatMul_0's bias and weight loads and its ForceFormat_Crouton, MatMul_3's two DMA waits
    assert a.by_kind["FullyConnected"]["events"] == 13


# By hand, from the fixture's lines: each q::ConvLayer_s1.opt has Dims [1,8,32,256] (output: 1*8*32*256 = 65536
# elements, N = 256 channels, M = 1*8*32 = 256 rows); its in[0] (MatMul_0: q::ForceFormat_Crouton 0x...1203..12,
# MatMul_k: MatMul_{k-1}'s output) has Dims [1,8,32,256], so K = 256; MatMul_0's in[1], q::ConvLayer.opt.
# weights_to_vtcm 0x...1210..12, has Dims [1,1,256,256]: 65536 weights / N 256 = 256 = K. FLOPs = 2 * 65536 * 256.
FC_FLOPS = 2 * (1 * 8 * 32 * 256) * 256
assert FC_FLOPS == 33_554_432 == 2 * 256 * 256 * 256  # a 256x256 by 256x256 matmul


def test_optrace_flops_from_the_files_shapes(tmp_path):
    t = load_foreign(OPTRACE)
    hmx = [e for e in t.events if e["kernel"] == "q::ConvLayer_s1.opt"]
    assert [(e["flops"], e["reduced_dim"], e["rows"]) for e in hmx] == [(FC_FLOPS, 256, 256)] * 8
    assert "weight 0x0000121000000012 [1, 1, 256, 256] / 256" in hmx[0]["flops_from"]  # both ways for MatMul_0
    # MatMul_1's weight (0x0000121100000016) is not in the excerpt: K from its input alone
    assert hmx[1]["flops_from"] == "K = 256: last dim of input 0x000011ed00000012 [1, 8, 32, 256]"
    others = [e for e in t.events if e["kernel"] != "q::ConvLayer_s1.opt"]
    assert len(others) == 11 and all(e["flops"] == 0 for e in others)
    # bytes = Dims x Data Type width where both are given: 256*256 QUInt8 input, the [1,8,1,64] Int32 bias (256
    # biases padded to 512 in VTCM), the 256*256 QInt8 weights, the two 1*8*32*256 QUInt8 layout changes
    got = sorted((e["kernel"], e["bytes"]) for e in others if "bytes" in e)
    assert got == [("q::*InputSlice", 65536), ("q::ConvLayer.opt.bias_to_vtcm", 1 * 8 * 1 * 64 * 4),
                   ("q::ConvLayer.opt.weights_to_vtcm", 65536), ("q::ForceFormat_Crouton", 65536),
                   ("q::ForceFormat_Flat", 65536)]
    f = t.meta["flops"]
    assert (f["compute_ops"], f["compute_ops_without_shapes"], f["other_ops_flops_0"], f["other_ops_with_bytes"],
            f["without_shapes"]) == (8, 0, 11, 5, [])
    # a shape the file does not give: no FLOPs for that op (no default), counted with why
    doc = json.loads(OPTRACE.read_text())
    for r in doc["traceEvents"]:
        if r.get("args", {}).get("ID") == "0x0000120300000012":  # MatMul_0's input, both copies
            del r["args"]["Dims"]
    p = _copy(tmp_path, json.dumps(doc))
    t2 = load_foreign(p)
    first = next(e for e in t2.events if e["kernel"] == "q::ConvLayer_s1.opt")
    assert first["name"] == "MatMul_0" and "flops" not in first
    assert t2.meta["flops"]["compute_ops_without_shapes"] == 1
    assert t2.meta["flops"]["without_shapes"] == ["traceEvents[15] MatMul_0 (q::ConvLayer_s1.opt): input "
                                                  "0x0000120300000012 not in the file"]
    # a weight whose dims disagree with the input's K: no FLOPs either
    doc = json.loads(OPTRACE.read_text())
    for r in doc["traceEvents"]:
        if r.get("args", {}).get("ID") == "0x0000121000000012":
            r["args"]["Dims"] = [1, 1, 128, 256]
    (tmp_path / "w").mkdir()
    t3 = load_foreign(_copy(tmp_path / "w", json.dumps(doc)))
    assert sum("flops" not in e for e in t3.events) == 1
    assert "disagree with K 256" in t3.meta["flops"]["without_shapes"][0]


def test_optrace_fit_names_its_degeneracy_and_held_out_error():
    """Eight ops of one shape: the rate and the fixed per-op cost cannot be separated. The fit says so and keeps the
    one figure the data fixes, the time per op at that size (a rate alone, as for every one-size fit)."""
    t = load_foreign(OPTRACE)
    m = fit(t)
    assert set(m.fits) == {"hmx"} and set(m.fits["hmx"]) == {"FullyConnected"}  # DMA/HVX ops (flops 0) not fitted
    f = m.fits["hmx"]["FullyConnected"]
    us = [d / MHZ for _, d in HMX]
    assert sum(us) / 8 == pytest.approx(1.908565, abs=1e-6)  # 12312 cycles / 8 / 806.365 MHz
    # the fit's figure: the time of least relative error over the eight, sum(1/u) / sum(1/u^2)
    mean = sum(1 / u for u in us) / sum(1 / u ** 2 for u in us)
    assert (f["n"], f["sizes"], f["fixed_us"], f["us_per_byte"]) == (8, 1, 0.0, 0.0)
    assert f["us_per_flop"] == pytest.approx(mean / FC_FLOPS, rel=1e-12)
    assert f["rate_gflops"] == pytest.approx(FC_FLOPS / mean / 1e3, rel=1e-12)  # ~17,500 GFLOP/s effective
    assert f["regime"] == "one: every op has M = 256"
    assert f["degenerate"].startswith("degenerate: all 8 ops have one size (3.35544e+07 FLOPs)")
    assert "cannot be separated" in f["degenerate"] and "\n" not in f["degenerate"]
    assert "degenerate (one size: rate and fixed cost not separable): hmx/FullyConnected" in m.source
    # the fit gives back that figure exactly; the cold MatMul_0 (4095 cycles) sits far above it, the seven warm ones
    # (1168..1181 cycles) close: a relative-error fit is not dragged by the one outlier as a mean is
    pred = f["us_per_flop"] * FC_FLOPS
    assert pred == pytest.approx(mean, rel=1e-12)
    errs = [abs(pred - u) / u for u in us]
    assert errs[0] == pytest.approx(1 - mean / us[0], rel=1e-9) and max(errs[1:]) < 0.12
    assert f["fit_median_rel_error"] == pytest.approx(sorted(errs)[3:5][0] / 2 + sorted(errs)[3:5][1] / 2, rel=1e-12)
    # held out: no layers, so fit on MatMul_0, 2, 4, 6 (even-indexed) and predict MatMul_1, 3, 5, 7
    tr = [d / MHZ for d in (4095, 1178, 1172, 1168)]
    train = sum(1 / u for u in tr) / sum(1 / u ** 2 for u in tr)
    held = [abs(train - d / MHZ) / (d / MHZ) for d in (1181, 1170, 1179, 1169)]
    h = m.held_out
    assert (h["n_train"], h["n_predicted"], h["n_unseen_kind"]) == (4, 4, 0)
    assert h["degenerate_training_fits"] == ["hmx/FullyConnected"]
    assert h["median_rel_error"] == pytest.approx(sorted(held)[1] / 2 + sorted(held)[2] / 2, rel=1e-12)
    assert h["median_rel_error"] < 0.15  # the cold first op drags the training figure far less than a mean (62%)


def test_optrace_clock_passed_through_read_foreign_and_the_cli(tmp_path, capsys):
    from edgeprobe.cli import main
    from edgeprobe.foreign import read_foreign

    lone = _copy(tmp_path, runtrace=False)
    events, meta = read_foreign(lone, "auto", mhz=MHZ)
    first = next(e for e in events if e["kernel"] == "q::ConvLayer_s1.opt")
    assert first["start_us"] == pytest.approx(40057 / MHZ, rel=1e-12) and meta["time"]["clock_from"] == \
        "given by the caller"
    rc = main(["trace", "import", str(lone), "--mhz", "806.365", "--out", str(tmp_path / "o"), "--json"])
    s = json.loads(capsys.readouterr().out)
    assert rc == 0 and (s["format"], s["events"]) == ("qnn-optrace", 19)
    x = [e for e in json.loads((tmp_path / "o" / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    # the Perfetto durations are the file's cycles over the given clock, as with the run trace's
    assert sorted(round(e["dur"] * MHZ) for e in x) == sorted(e["cycles"] for e in load_foreign(OPTRACE).events)
    # without --mhz the lone optrace is refused in one line naming the clock
    rc = main(["trace", "import", str(lone), "--out", str(tmp_path / "o2")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and str(lone) in err and "clock" in err and "--mhz" in err
    # a clock beside the run trace's: agreeing to 0.1% it is taken, else refused naming both
    t = Trace.load_foreign(OPTRACE, mhz=806.4)
    assert t.meta["time"]["clock_mhz"] == 806.4 and "agrees with" in t.meta["time"]["clock_from"]
    with pytest.raises(ForeignTraceError) as exc:
        read_foreign(OPTRACE, mhz=1000)
    _one_line_error(exc, OPTRACE, "clock")
    assert "summary_htp_frequency_ghz 0.806365" in str(exc.value)
    # formats without a use for a clock refuse it, in one line, from Python and the CLI
    hexlog = Path(__file__).parent / "data" / "foreign" / "llamacpp_hexagon" / "issue18139_mul_mat.log"
    with pytest.raises(ForeignTraceError) as exc:
        read_foreign(hexlog, mhz=1000)
    _one_line_error(exc, hexlog, "argument")
    assert "llamacpp-hexagon-op file has no use for a clock" in str(exc.value)
    rc = main(["trace", "import", str(hexlog), "--mhz", "1000", "--out", str(tmp_path / "o3")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "qnn-optrace" in err and not (tmp_path / "o3").exists()
