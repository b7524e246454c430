"""The wire format's checks in-process: frame descriptions that must be refused (whatever their id), and the one
table of error codes that the agent, its docs and the client share."""
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest

from edgeprobe_agent.protocol import (
    ERRORS,
    NO_ID,
    AgentError,
    ProtocolError,
    check_request,
    error_reply,
    pack,
    request_id,
    unpack,
)

ROOT = Path(__file__).resolve().parent.parent


def _frames(spec, *payload):
    return [msgpack.packb({"v": 1, "id": 7, "op": "hello", "frames": spec})] + list(payload)


@pytest.mark.parametrize("spec, payload", [
    ([{"dtype": "object", "shape": [1]}], [b"x" * 8]),
    ([{"dtype": ["float32"], "shape": [1]}], [b"x" * 4]),            # unhashable dtype
    ([{"dtype": "float32", "shape": [-1]}], [b""]),
    ([{"dtype": "int64", "shape": [2 ** 62, 4]}], [b""]),           # wraps to 0 bytes in int64 arithmetic
    ([{"dtype": "uint8", "shape": [2 ** 32, 2 ** 32]}], [b""]),       # 2**64 wraps to 0 too
    ([{"dtype": "uint8", "shape": [1] * 33}], [b"x"]),               # more dimensions than numpy has
    ([{"dtype": "uint8", "shape": [True]}], [b"x"]),                 # a bool is not a dimension
    ([{"dtype": "uint8", "shape": "4"}], [b"xxxx"]),
    ([{"dtype": "float32", "shape": [4]}], [b"abc"]),                # byte count
    ([{"dtype": "float32", "shape": [1]}], []),                      # frame count
    ([], [b"x"]),
    ({"dtype": "uint8"}, [b"x"]),
    (["uint8"], [b"x"]),
])
def test_bad_frame_descriptions_are_refused_and_the_id_stays_readable(spec, payload):
    frames = _frames(spec, *payload)
    with pytest.raises(ProtocolError) as e:
        unpack(frames)
    assert e.value.code == "bad_frames"
    assert request_id(msgpack.unpackb(frames[0])) == 7  # what the agent answers under


def test_request_ids_and_error_replies():
    assert request_id({"id": 3}) == 3 and request_id({"id": True}) == NO_ID and request_id({"id": 1.0}) == NO_ID
    assert request_id([1]) == NO_ID and request_id({}) == NO_ID
    assert error_reply(True, "bad_id", "x")["id"] == NO_ID and error_reply(12, "bad_id", "x")["id"] == 12
    with pytest.raises(ProtocolError, match="integer 'id'"):
        check_request({"v": 1, "id": False, "op": "hello"})
    with pytest.raises(ProtocolError, match="unknown request"):
        check_request({"v": 1, "id": 1, "op": ["hello"]})
    h, arrays = unpack(pack({"id": 1}, [np.arange(6, dtype=np.int16).reshape(2, 3), np.zeros(0, np.float32)]))
    assert h["id"] == 1 and arrays[0].tolist() == [[0, 1, 2], [3, 4, 5]] and arrays[1].shape == (0,)


def test_every_error_code_the_agent_raises_is_in_the_table_and_the_docs():
    from edgeprobe_agent.executor import PlanError
    from edgeprobe_agent.ops import OpError
    from edgeprobe_agent.store import StoreError

    assert all(issubclass(c, AgentError) for c in (ProtocolError, PlanError, OpError, StoreError))
    used = set()
    for f in list((ROOT / "device_agent").glob("*.py")):
        used |= set(re.findall(r"(?:Error|error_reply)\([^\"'()]*[\"']([a-z_0-9]+)[\"']", f.read_text()))
    assert used and used <= set(ERRORS), sorted(used - set(ERRORS))
    docs = (ROOT / "docs" / "protocol.md").read_text()
    assert all(f"| `{code}` |" in docs for code in ERRORS), [c for c in ERRORS if f"| `{c}` |" not in docs]


def test_chunk_crc32_is_zlibs_whichever_implementation_computes_it():
    import zlib

    from edgeprobe_agent import protocol

    assert protocol.crc32.__module__ == "isal.isal_zlib"  # the host's fast path (isal is a dependency)
    rng = np.random.default_rng(3)
    for n in (0, 1, 4095, 1 << 20):  # a phone's agent checks with zlib what the host computed with ISA-L
        a = rng.integers(0, 256, n, dtype=np.uint8)
        assert protocol.crc32(a) == protocol.crc32(memoryview(a)) == zlib.crc32(a.tobytes())


def test_the_clients_plain_values_reach_the_agent_as_sent():
    # a manifest or plan as a notebook builds it: numpy scalars and arrays, tuples, sets, non-string keys
    from edgeprobe.client import _plain

    value = {"ops": [{"shape": (np.int64(64), 576), "scale": np.float32(0.5), "ids": np.arange(3, dtype=np.int32),
                      "tags": {"b"}, "name": np.str_("blk.0"), "ok": np.bool_(True), "none": None}],
             3: {"nested": [(1, 2.5), [np.float16(1.5)]]}, "raw": b"\x00\x01"}
    plain = _plain(value)
    got = msgpack.unpackb(msgpack.packb(plain, use_bin_type=True), raw=False, strict_map_key=True)
    assert got == {"ops": [{"shape": [64, 576], "scale": 0.5, "ids": [0, 1, 2], "tags": ["b"], "name": "blk.0",
                            "ok": True, "none": None}], "3": {"nested": [[1, 2.5], [1.5]]}, "raw": b"\x00\x01"}
    assert type(got["ops"][0]["shape"][0]) is int and type(got["ops"][0]["ok"]) is bool
