"""The npu lane's hvx backend: real Hexagon v67 HVX code under qemu-hexagon, bit-exact with the NPU-semantics
kernels, and a bridge that refuses bad requests and outlives a killed DSP process."""
import os
import signal
import time

import numpy as np
import pytest

from edgeprobe_kernels import hvx_bridge
from edgeprobe_kernels.check import _compare, check, gemm_s8s32_ref, quantize_ref, w8a8_ref

needs_hvx = pytest.mark.usefixtures("hvx_toolchain")  # fails, never skips, when the setup did not install it
rng = np.random.default_rng(7)


@pytest.fixture(scope="module")
def dsp():
    d = hvx_bridge.HvxDsp(arena_mb=64, scratch_mb=16, timeout_s=60)
    yield d.start() if hvx_bridge.available() else d
    d.close()


def test_missing_toolchain_is_reported_with_the_install_command(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    why = hvx_bridge.unavailable_reason()
    assert "qemu-hexagon" in why and "apt-get install clang-15 lld-15 qemu-user" in why
    with pytest.raises(hvx_bridge.HvxUnavailable, match="apt-get install"):
        hvx_bridge.build()


@needs_hvx
def test_kernel_check_is_bit_exact():
    r = check("hvx")
    assert r["ok"] and set(r["kernels"]) == {"gemm_s8s32", "quantize_per_tensor", "w8a8_linear", "q4_tile_dequant",
                                             "exp_lut", "gemm_f16w_seq"}
    assert all(k["bit_exact"] and k["max_abs_err"] == 0 and k["cases"] >= 1 for k in r["kernels"].values())


def test_the_check_sees_one_ulp():
    ref = np.linspace(-1, 1, 50, dtype=np.float32)
    off = ref.copy()
    off[3] = np.nextafter(off[3], np.float32(2))
    row = _compare("x", [(ref, ref), (off, ref)])
    assert not row["bit_exact"] and not row["ok"] and 0 < row["max_abs_err"] < 1e-6
    assert _compare("x", [(np.float32(-0.0), np.float32(0.0))])["bit_exact"] is False  # signed zeros count


@needs_hvx
def test_linear_shapes_and_counters(dsp):
    """M = 1 and a tail of columns; QEMU's counters: at least one packet per vrmpy the shape needs."""
    M, K, N = 1, 576, 200
    x = rng.standard_normal((M, K)).astype(np.float32)
    wt = rng.integers(-127, 128, (K, N), dtype=np.int8)
    c = {}
    y = dsp.w8a8(x, wt, 0.02, 0.01, key="w1", counters=c)
    assert np.array_equal(y.view(np.uint32), w8a8_ref(x, wt, 0.02, 0.01).view(np.uint32))
    a = rng.integers(-128, 128, (8, K), dtype=np.int8)
    g = {}
    assert np.array_equal(dsp.gemm_s8s32(a, wt, counters=g), gemm_s8s32_ref(a, wt))
    vrmpy = 8 // 4 * 4 * (-(-N // 32)) * (K // 4)  # 4 rows per block x vectors of 32 columns x groups of 4 inputs
    assert g["hvx_insns"] >= vrmpy and vrmpy <= g["packets"] <= 2 * vrmpy and g["scalar_packets"] == 0
    est = hvx_bridge.dsp_estimate(g)
    assert est["dsp_cycles_estimate"] == g["packets"] and est["dsp_clock_hz"] > 0 and "estimate" in est["dsp_model"]


@needs_hvx
def test_bad_requests_are_refused_and_the_program_keeps_serving(dsp):
    pid = dsp.pid
    with pytest.raises(hvx_bridge.HvxError, match="unknown op"):
        dsp.raw(99)
    with pytest.raises(hvx_bridge.HvxError, match="outside the arena"):
        dsp.raw(hvx_bridge.OP_GEMM_S8S32, m=4, k=4, n=32, bufs=(dsp.arena_bytes - 8, 0, 0))
    with pytest.raises(hvx_bridge.HvxError, match="aligned"):
        dsp.raw(hvx_bridge.OP_GEMM_S8S32, m=4, k=4, n=32, bufs=(0, 64, 0))
    with pytest.raises(hvx_bridge.HvxError, match="shape"):
        dsp.raw(hvx_bridge.OP_GEMM_S8S32, m=4, k=6, n=32)
    with pytest.raises(ValueError, match="int8"):
        dsp.gemm_s8s32(np.zeros((2, 3), np.float32), np.zeros((3, 4), np.int8))
    with pytest.raises(ValueError, match=r"uint8\[S, 144\]"):
        dsp.q4_tile_dequant(np.zeros((2, 100), np.uint8))
    x = rng.standard_normal((3, 40)).astype(np.float32)
    assert np.array_equal(dsp.quantize(x, 0.01), quantize_ref(x, 0.01)) and dsp.pid == pid


@needs_hvx
def test_a_killed_dsp_process_gives_a_clear_error_then_a_new_one(dsp):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    wt = rng.integers(-127, 128, (64, 32), dtype=np.int8)
    before = dsp.w8a8(x, wt, 0.02, 0.01, key="kept")
    old = dsp.pid
    os.kill(old, signal.SIGKILL)
    time.sleep(0.2)
    with pytest.raises(hvx_bridge.HvxError,
                       match=r"qemu-hexagon, pid \d+\) died \(killed by signal 9\).*next call starts a new one"):
        dsp.w8a8(x, wt, 0.02, 0.01, key="kept")
    after = dsp.w8a8(x, wt, 0.02, 0.01, key="kept")  # weights stayed in the arena the new process maps
    assert dsp.pid != old and np.array_equal(after, before)


@needs_hvx
def test_a_hung_dsp_call_times_out_and_is_stopped():
    d = hvx_bridge.HvxDsp(arena_mb=64, scratch_mb=16).start()
    d.timeout_s = 0.05  # after start: QEMU's own start-up may take longer than that on a busy machine
    try:
        a = rng.integers(-127, 128, (256, 2048), dtype=np.int8)
        b = rng.integers(-127, 128, (2048, 1024), dtype=np.int8)  # ~5 M packets: 0.5-1 s under QEMU, 10x the timeout
        with pytest.raises(hvx_bridge.HvxError, match="gave no reply in 0 s and was stopped"):
            d.gemm_s8s32(a, b)
        assert d.proc is None
    finally:
        d.close()


@needs_hvx
def test_build_is_cached_by_content(tmp_path, monkeypatch):
    a = hvx_bridge.build(tmp_path)
    assert hvx_bridge.build(tmp_path) == a and a.stat().st_size > 0
    src = tmp_path / "src"
    src.mkdir()
    for p in hvx_bridge.SOURCE_DIR.iterdir():
        (src / p.name).write_bytes(p.read_bytes() + (b"\n/* changed */\n" if p.name == "main.c" else b""))
    monkeypatch.setattr(hvx_bridge, "SOURCE_DIR", src)
    assert hvx_bridge.build(tmp_path) != a


@needs_hvx
def test_cli_kernels_check(capsys):
    import json

    from edgeprobe.cli import main

    assert main(["kernels", "check", "--backend", "hvx", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] and out["kernels"]["exp_lut"]["bit_exact"] and out["kernels"]["gemm_s8s32"]["cases"] >= 6


def test_cli_kernels_check_without_the_toolchain_says_how_to_install_it(capsys, monkeypatch):
    from edgeprobe.cli import main

    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["kernels", "check", "--backend", "hvx", "--json"]) == 2
    assert "apt-get install clang-15 lld-15 qemu-user" in capsys.readouterr().err


@needs_hvx
def test_q4_0_tile_is_bit_exact_between_the_npu_backends(dsp):
    """The W4A16 GEMM fixes its summation order (k from 0) on both backends; BLAS (the host's) does not."""
    from edgeprobe.quant.blobs import BlobStore
    from edgeprobe.quant.schemes import build_q4_0_tile
    from edgeprobe_kernels import hvx_linear
    from edgeprobe_kernels.linear_records import NPU_RUNNERS, RUNNERS

    store = BlobStore()
    rec = build_q4_0_tile("blk.0.ffn_up", rng.standard_normal((70, 130)).astype(np.float32), {}, store)
    x = (rng.standard_normal((5, 130)) * 4).astype(np.float32)
    numba_y = NPU_RUNNERS["q4_0-tile"](rec, store.get, {})(x)
    hvx_y = hvx_linear.runner(rec, "all", store.get, dsp=dsp)(x)
    assert np.array_equal(numba_y.view(np.uint32), hvx_y.view(np.uint32))
    host = RUNNERS["q4_0-tile"](rec, store.get, {})(x)  # BLAS: the same products, another order
    assert np.allclose(host, numba_y, rtol=1e-5, atol=1e-5)


def test_numba_kernel_check_includes_the_k_order_gemm():
    r = check("numba")
    assert r["ok"] and r["kernels"]["gemm_f16w_seq"]["bit_exact"] and r["kernels"]["gemm_f16w_seq"]["cases"] >= 3


@needs_hvx
def test_the_shared_dsp_is_stopped_at_exit_by_its_own_process_only():
    """A process that used the shared DSP (`kernels check --backend hvx` in process) stops its QEMU at exit: no
    running child and no open pipes at the interpreter's teardown (-X dev reports them). A forked child, which
    inherits the object but not the process, leaves it running."""
    import subprocess
    import sys

    code = ("from edgeprobe_kernels import hvx_bridge\n"
            "d = hvx_bridge.shared().start()\nassert d.proc.poll() is None\nprint(d.pid)\n")
    r = subprocess.run([sys.executable, "-X", "dev", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) > 0 and "ResourceWarning" not in r.stderr, r.stderr
    code += ("hvx_bridge._SHARED_PID = -1  # as in a forked child\nhvx_bridge._close_shared()\n"
             "assert d.proc is not None and d.proc.poll() is None\n"
             "hvx_bridge._SHARED_PID = __import__('os').getpid()\nhvx_bridge._close_shared()\n"
             "assert d.proc is None\n")
    r = subprocess.run([sys.executable, "-X", "dev", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ResourceWarning" not in r.stderr, r.stderr


@needs_hvx
def test_a_call_in_flight_at_exit_gets_the_shared_dsp_killed_not_waited_for(exited):
    """A daemon thread (an agent's lane) holds the DSP's lock when the interpreter exits: the exit does not wait for
    it, and the QEMU process is killed rather than left running."""
    import subprocess
    import sys

    code = ("import threading, time\nfrom edgeprobe_kernels import hvx_bridge\n"
            "d = hvx_bridge.shared().start()\nprint(d.pid, flush=True)\nheld = threading.Event()\n"
            "def call():\n    with d.lock:\n        held.set()\n        time.sleep(600)\n"
            "threading.Thread(target=call, daemon=True).start()\nheld.wait()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    qemu = int(r.stdout)
    state = exited(qemu)  # SIGKILL lands asynchronously
    assert state in ("Z", "gone"), f"QEMU (pid {qemu}) still {state} after its host exited"
