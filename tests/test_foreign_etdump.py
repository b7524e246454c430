"""ExecuTorch ETDump reader against a real .etdp (tests/data/foreign/executorch_etdump: the file ExecuTorch's runtime
wrote for its devtools tutorial). Expected numbers come from the file's bytes at offsets read off a hex dump, not from
the reader's flatbuffer walk."""
import json
import struct
from pathlib import Path

import pytest

from edgeprobe.errors import EdgeprobeError
from edgeprobe.foreign import ForeignTraceError, detect_format, load_foreign

ETDP = Path(__file__).parent / "data" / "foreign" / "executorch_etdump" / "devtools_tutorial.etdp"
FMT = "executorch-etdump"
# (byte offset of a ProfileEvent's start_time, its end_time follows) -> its name, from `xxd` of the fixture
RAW = {0xB8: "Method::execute", 0xE0: "OPERATOR_CALL", 0x108: "native_call_addmm.out"}


def _one_line_error(exc, path, where):
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and where in msg and "expected" in msg
    assert isinstance(exc.value, EdgeprobeError)


def test_etdump_events_runs_and_lanes():
    t = load_foreign(ETDP)
    assert detect_format(ETDP) == FMT and t.meta["source"] == {"tool": "ExecuTorch ETDump", "format": FMT,
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


def test_etdump_writes_perfetto_and_imports_through_the_cli(tmp_path, capsys):
    from edgeprobe.cli import main

    rc = main(["trace", "import", str(ETDP), "--out", str(tmp_path / "o"), "--json"])
    s = json.loads(capsys.readouterr()[0])
    assert rc == 0 and (s["format"], s["events"], s["lanes"]) == (FMT, 31, ["cpu"])
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
        load_foreign(cut, format=FMT)
    _one_line_error(exc, cut, "byte 0")
    assert "truncated" in str(exc.value)
    relabelled = tmp_path / "relabelled.etdp"  # a cut file whose size prefix was made to agree: offsets run past
    relabelled.write_bytes(struct.pack("<I", 1496) + data[4:1500])
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(relabelled, format=FMT)
    _one_line_error(exc, relabelled, "byte ")
    assert "past the end" in str(exc.value)
    text = tmp_path / "not.etdp"
    text.write_text("ggml-hex: HTP0 hwinfo\n")
    with pytest.raises(ForeignTraceError) as exc:
        load_foreign(text, format=FMT)
    _one_line_error(exc, text, "bytes 4-12")
