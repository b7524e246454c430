"""The wire protocol between the host client (ZeroMQ DEALER) and the device agent (ROUTER).

Written down in docs/protocol.md. A message is a multipart ZeroMQ message:
    frame 0      header: a msgpack map (never pickle)
    frames 1..n  raw tensor bytes, described by header["frames"] = [{"dtype", "shape"}, ...]
Every request carries "v" (PROTOCOL_VERSION), "id" (an integer the client picks) and "op". The agent
answers each request with exactly one final reply {"id", "final": True, "ok": bool, ...}; a failed
request gets {"ok": False, "error": {"code", "message"}}. Long requests also send non-final messages
({"final": False, "event": "progress" | "heartbeat", ...}) with the same id.
"""
from __future__ import annotations

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
REQUESTS = ("hello", "has_blobs", "put_blob", "load_model", "put_plan", "run", "cancel", "stats", "heartbeat", "bye",
            "open_session", "session_reorder", "close_session")
CHUNK_BYTES = 4 << 20            # put_blob chunk size the client uses (the agent accepts any)
HEARTBEAT_S = 0.5                # interval of heartbeats while a request is in flight
HEARTBEAT_TIMEOUT_S = 5.0        # silence after which either side gives the other up
MAX_HEADER_BYTES = 1 << 24       # a header larger than this is refused unparsed
ALLOWED_DTYPES = {"int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"}


class ProtocolError(ValueError):
    """A message that does not follow the protocol; `code` names the kind of fault."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def pack(header: dict, arrays=()) -> list:
    """header + arrays -> frames; arrays go raw (zero-copy where contiguous), described in header["frames"]."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    h = dict(header)
    if arrays:
        h["frames"] = [{"dtype": a.dtype.name, "shape": list(a.shape)} for a in arrays]
    return [msgpack.packb(h, use_bin_type=True)] + [memoryview(a).cast("B") if a.size else b"" for a in arrays]


def unpack(frames) -> tuple[dict, list[np.ndarray]]:
    """frames -> (header, arrays). Raises ProtocolError on anything malformed; never executes content."""
    if not frames:
        raise ProtocolError("empty", "empty message")
    raw = bytes(frames[0])
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError("header_too_large", f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types on garbage
        raise ProtocolError("bad_header", f"header is not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise ProtocolError("bad_header", f"header must be a map, got {type(header).__name__}")
    specs = header.get("frames", [])
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise ProtocolError("bad_frames", f"header describes {len(specs) if isinstance(specs, list) else '?'} "
                                          f"frames but {len(frames) - 1} followed")
    arrays = []
    for i, (spec, fr) in enumerate(zip(specs, frames[1:])):
        if not isinstance(spec, dict) or spec.get("dtype") not in ALLOWED_DTYPES or not isinstance(spec.get("shape"), list) \
                or not all(isinstance(d, int) and d >= 0 for d in spec["shape"]):
            raise ProtocolError("bad_frames", f"frame {i + 1}: spec {str(spec)[:80]} needs dtype in "
                                              f"{sorted(ALLOWED_DTYPES)} and a shape of non-negative ints")
        dt = np.dtype(spec["dtype"])
        n = int(np.prod(spec["shape"], dtype=np.int64))
        buf = memoryview(fr).cast("B") if not isinstance(fr, (bytes, bytearray)) else fr
        if len(buf) != n * dt.itemsize:
            raise ProtocolError("bad_frames", f"frame {i + 1} holds {len(buf)} bytes, its spec {spec} needs {n * dt.itemsize}")
        arrays.append(np.frombuffer(buf, dtype=dt).reshape(spec["shape"]))
    return header, arrays


def check_request(header: dict) -> tuple[int, str]:
    """The request's id and op, or ProtocolError saying what is missing."""
    rid = header.get("id")
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise ProtocolError("bad_id", "request needs an integer 'id'")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("version", f"protocol version {header.get('v')!r} is not {PROTOCOL_VERSION}; "
                                       "update the client or the agent so both speak the same version")
    op = header.get("op")
    if op not in REQUESTS:
        raise ProtocolError("unknown_op", f"unknown request {str(op)[:40]!r}; requests are {', '.join(REQUESTS)}")
    return rid, op


def error_reply(rid, code: str, message: str) -> dict:
    return {"id": rid if isinstance(rid, int) else -1, "final": True, "ok": False,
            "error": {"code": code, "message": message}}
