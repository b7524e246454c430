"""The wire protocol between the host client (ZeroMQ DEALER) and the device agent (ROUTER).

Written down in docs/protocol.md. A message is a multipart ZeroMQ message:
    frame 0      header: a msgpack map (never pickle)
    frames 1..n  raw tensor bytes, described by header["frames"] = [{"dtype", "shape"}, ...]
Every request carries "v" (PROTOCOL_VERSION), "id" (an integer the client picks) and "op". The agent
answers each request with exactly one final reply {"id", "final": True, "ok": bool, ...}; a failed
request gets {"ok": False, "error": {"code", "message"}} under the request's own id whenever its header
parses to a map with an integer id (-1 only when no id can be read). Long requests also send non-final
messages ({"final": False, "event": "progress" | "heartbeat", ...}) with the same id.

Every failure the agent reports is an AgentError(code, message) with a code from ERRORS; ProtocolError,
PlanError, OpError and StoreError are its subclasses, kept so callers can still catch one family.
"""
from __future__ import annotations

import math

import msgpack
import numpy as np

try:  # chunk checksums on both sides (client and store import it from here): ISA-L's CRC-32 gives zlib's values faster
    from isal.isal_zlib import crc32  # noqa: F401
except ImportError:  # a phone's agent without isal: the same checksum, slower
    from zlib import crc32  # noqa: F401

PROTOCOL_VERSION = 1
# run's optional "numerics" field {"ops": glob | None, "full": [op names], "full_limit_bytes": int, "fault": test only}
# asks for per-op output summaries (edgeprobe_kernels.numerics); the reply's "numerics" {"version", "summaries", "full",
# "full_bytes"[, "full_steps"]} carries them, the full tensors as frames after the outputs' (an older agent's reply
# lacks the key). Capture version 2 (hello's "numerics") names a fused op's sub-ops (a decode step's template ops) and
# tags a decode loop's summaries with their "step"; a version-1 agent knows only the plan's own op names
REQUESTS = ("hello", "has_blobs", "put_blob", "load_model", "put_plan", "run", "cancel", "stats", "heartbeat", "bye",
            "open_session", "session_reorder", "close_session")
CHUNK_BYTES = 4 << 20            # put_blob chunk size the client uses (the agent accepts any)
HEARTBEAT_S = 0.5                # interval of heartbeats while a request is in flight
HEARTBEAT_TIMEOUT_S = 5.0        # silence after which either side gives the other up
MAX_HEADER_BYTES = 1 << 24       # a header larger than this is refused unparsed
MAX_STEPS = 1 << 16             # decode steps one run may loop over (a run of `steps`)
MAX_NDIM = 32                    # numpy's own limit on every version the agent runs on
ALLOWED_DTYPES = {"int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"}
NO_ID = -1                       # the id of an error reply to a message whose id could not be read

# Every error code the agent sends, and what it means (docs/protocol.md lists the same table).
ERRORS = {
    # the message itself
    "empty": "a message with no frames",
    "bad_header": "frame 0 is not a msgpack map",
    "header_too_large": "frame 0 exceeds MAX_HEADER_BYTES",
    "bad_frames": "the frame descriptions do not match the frames (count, dtype, shape, bytes)",
    "bad_id": "the request's id is missing, not an integer, or already in flight",
    "version": "the protocol version differs from the agent's",
    "unknown_op": "an unknown request, or a plan op of unknown kind",
    "bad_request": "a request field is missing or has the wrong type or value",
    # uploads and the blob store
    "bad_sha": "a blob id is not a lowercase hex sha256",
    "chunk_checksum": "a chunk does not match its CRC-32",
    "blob_checksum": "a finished blob does not match its sha256",
    "bad_blob": "a blob's dtype and shape do not make its byte count",
    "bad_chunk": "a chunk's index or size does not fit its blob",
    "missing_blob": "a blob the request needs is not in the store",
    "write_failed": "writing a blob to flash failed",
    "store_busy": "another agent holds the store",
    "bad_rows": "rows outside a blob",
    "bad_layout": "a kernel layout of a blob asked for under a malformed tag",
    # plans and runs
    "bad_plan": "a plan is malformed",
    "unknown_ref": "a plan names an op that is not in it",
    "unknown_lane": "a plan asks for a lane this agent lacks",
    "cycle": "a plan's dependencies (with each lane's order) form a cycle",
    "unknown_plan": "run names a plan that was not sent",
    "unknown_target": "cancel names no run of this client in flight",
    "missing_input": "the plan reads a run input the run did not send",
    "bad_input": "an op's input has the wrong shape or values",
    "bad_attrs": "an op's attrs are malformed",
    "op_failed": "a kernel failed",
    "unknown_record": "a linear record of unknown kind",
    "no_gpu_kernel": "a linear has no OpenCL kernel",
    "cancelled": "the run was cancelled (cancel, a silent client, or the agent stopping)",
    # decode sessions
    "unknown_model": "no model with that id is loaded",
    "unknown_session": "no session with that name is open",
    "busy": "the session has a run in flight",
    "no_prefill": "a decode step on an empty session",
    "context_full": "the session's capacity is reached",
    "memory_budget": "the request does not fit the agent's memory budget",
    "no_session": "an op needs a decode session and the run named none",
    # anything else
    "internal": "an unexpected exception in the agent (a bug); the agent keeps serving",
}


class AgentError(ValueError):
    """The one error type of the agent: `code` (a key of ERRORS) and a message saying what to do."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class ProtocolError(AgentError):
    """A message that does not follow the protocol."""


def leaf_names(ops) -> list:
    """The names of a plan's op dicts (in the order given) with each fused op's sub-ops, at any depth, in its place:
    the names a run's numerics capture may pick (capture version 2; the host reads them from the plan it sends)."""
    out = []
    for op in ops:
        out += leaf_names(op["attrs"]["ops"]) if op["kind"] == "fused" else [op["name"]]
    return out


def pack(header: dict, arrays=()) -> list:
    """header + arrays -> frames; arrays go raw (zero-copy where contiguous), described in header["frames"]."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    bad = [a.dtype.name for a in arrays if a.dtype.name not in ALLOWED_DTYPES]
    if bad:  # an object array's buffer is pointers: never put it on the wire
        raise ValueError(f"cannot send arrays of dtype {', '.join(bad)}; dtypes are {sorted(ALLOWED_DTYPES)}")
    h = dict(header)
    if arrays:
        h["frames"] = [{"dtype": a.dtype.name, "shape": list(a.shape)} for a in arrays]
    return [msgpack.packb(h, use_bin_type=True)] + [memoryview(a).cast("B") if a.size else b"" for a in arrays]


def unpack_header(frame) -> dict:
    """Frame 0 -> the header map, or ProtocolError (empty / header_too_large / bad_header)."""
    raw = bytes(frame)
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError("header_too_large", f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types on garbage
        raise ProtocolError("bad_header", f"header is not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise ProtocolError("bad_header", f"header must be a map, got {type(header).__name__}")
    return header


def request_id(header) -> int:
    """The header's integer id (bools are not ids), or NO_ID."""
    rid = header.get("id") if isinstance(header, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else NO_ID


def is_shape(shape) -> bool:
    """A list of at most MAX_NDIM non-negative ints (bools are not ints here)."""
    return isinstance(shape, list) and len(shape) <= MAX_NDIM and \
        all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)


def unpack_frames(header: dict, frames) -> list[np.ndarray]:
    """The arrays header["frames"] describes, checked against the frames that came (count, dtype, shape,
    bytes; sizes in Python integers, so no shape can overflow into a match). Raises ProtocolError bad_frames."""
    specs = header.get("frames", [])
    if not isinstance(specs, list) or len(specs) != len(frames):
        raise ProtocolError("bad_frames", f"header describes {len(specs) if isinstance(specs, list) else '?'} "
                                          f"frames but {len(frames)} followed")
    arrays = []
    for i, (spec, fr) in enumerate(zip(specs, frames)):
        dtype = spec.get("dtype") if isinstance(spec, dict) else None
        shape = spec.get("shape") if isinstance(spec, dict) else None
        if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES or not is_shape(shape):
            raise ProtocolError("bad_frames", f"frame {i + 1}: spec {str(spec)[:80]} needs dtype in "
                                              f"{sorted(ALLOWED_DTYPES)} and a shape of at most {MAX_NDIM} "
                                              "non-negative ints")
        dt = np.dtype(dtype)
        need = math.prod(shape) * dt.itemsize
        buf = memoryview(fr).cast("B") if not isinstance(fr, (bytes, bytearray)) else fr
        if len(buf) != need:
            raise ProtocolError("bad_frames", f"frame {i + 1} holds {len(buf)} bytes, its spec "
                                              f"{str(spec)[:80]} needs {need}")
        arrays.append(np.frombuffer(buf, dtype=dt).reshape(shape))
    return arrays


def unpack(frames) -> tuple[dict, list[np.ndarray]]:
    """frames -> (header, arrays). Raises ProtocolError on anything malformed; never executes content."""
    if not frames:
        raise ProtocolError("empty", "empty message")
    header = unpack_header(frames[0])
    return header, unpack_frames(header, frames[1:])


def check_request(header: dict) -> tuple[int, str]:
    """The request's id and op, or ProtocolError saying what is missing."""
    rid = header.get("id")
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise ProtocolError("bad_id", "request needs an integer 'id'")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("version", f"protocol version {str(header.get('v'))[:20]!r} is not {PROTOCOL_VERSION}; "
                                       "update the client or the agent so both speak the same version")
    op = header.get("op")
    if not isinstance(op, str) or op not in REQUESTS:
        raise ProtocolError("unknown_op", f"unknown request {str(op)[:40]!r}; requests are {', '.join(REQUESTS)}")
    return rid, op


def error_reply(rid, code: str, message: str) -> dict:
    return {"id": rid if isinstance(rid, int) and not isinstance(rid, bool) else NO_ID, "final": True, "ok": False,
            "error": {"code": code, "message": message}}
