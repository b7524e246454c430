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


def test_optrace_alignment_and_fit():
    """The excerpt's graph is eight bare 256x256 FullyConnected ops, not a transformer layer: aligned to a Llama
    template nothing maps (its op names carry no layer), and without FLOPs on its events the cost fit refuses it."""
    t = load_foreign(OPTRACE)
    a = align(t, LLAMA_1B, tokens=256)
    assert a.share == 0.0 and a.total_us == pytest.approx(sum(e["end_us"] - e["start_us"] for e in t.events))
    assert {e["unmatched"] for e in a.trace.events} == {"no layer of the model"}
    # 8 q::ConvLayer_s1.opt, MatMul_0's bias and weight loads and its ForceFormat_Crouton, MatMul_3's two DMA waits
    assert a.by_kind["FullyConnected"]["events"] == 13
    with pytest.raises(ForeignTraceError) as exc:
        fit(t)
    _one_line_error(exc, OPTRACE, "events")
    assert "no event with a FLOP count" in str(exc.value)
