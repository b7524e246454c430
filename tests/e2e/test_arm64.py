"""The agent on an emulated phone CPU: Debian's arm64 Python (numpy, pyzmq, msgpack, no numba) under qemu-aarch64,
built by scripts/arm64_python.sh (make test runs it). Real arm64 machine code, real sockets, a real sshd.

Emulation is slow (a float32 GEMM runs at about 0.14 GFLOP/s; a 16-token prefill took 23 s, a decode step 2.5 s), so
the prompts are small: SmolLM2 prefills 10 tokens (14 s of emulated compute; more than the 8 rows up to which the
numba reference takes its GEMV kernels) and decodes 3 steps after a 4-token prompt. The two CLI runs share one store,
so SmolLM2's 324 MB go up once.

Every kernel agrees with x86 to float32 rounding (int8 GEMMs exactly), but per-tensor W8A8 can turn one ulp into one
int8 code step: with the first 8 (or 12) held-out tokens, blk.1.attn_output's input rounds one code differently in one
row, and the logits then differ by up to 3.0 (cosine 0.9984). Both runs are deterministic; on the first 10 tokens (and
16, and 4) no code flips.
"""
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import numpy as np
import pytest

from edgeprobe import arm64
from edgeprobe.deploy import DeployError
from edgeprobe.device import Device

# int8 GEMMs are exact on both machines; the float32 parts (BLAS sums in attention, shadow rows) round differently on
# arm64's OpenBLAS than on x86's, in thousands of last bits a layer, and per-tensor int8 downstream turns one such bit
# into a whole code step now and then: max |dlogit| 1.1e-5 at logits of ~10-20 on one host, 1.9 (cosine 0.99982, the
# same top token) on another. So the check is the model's, not the bits': the numba agent's top token, cosine >= this
COSINE_VS_NUMBA = 0.999


def _user() -> str:
    return os.environ.get("USER") or __import__("getpass").getuser()


@pytest.fixture(scope="module")
def store(module_dir):
    """One agent store for this module's CLI runs (the arm64 agent's and the numba reference agent's, in turn)."""
    return module_dir / "arm64-store"


def _cli(args, store, timeout=900) -> dict:
    env = {**os.environ, "EDGEPROBE_AGENT_STORE": str(store)}
    r = subprocess.run([sys.executable, "-m", "edgeprobe", "run", *args, "--json", "--no-progress"], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_prefill_on_the_emulated_arm64_agent_matches_host_and_numba(store, tmp_path):
    trace = tmp_path / "trace.json"
    out = _cli(["--model", "smollm2-135m", "--scheme", "w8a8-shadow", "--prompt-len", "10", "--device", "arm64",
                "--trace", str(trace)], store)
    assert out["agent_machine"] == "aarch64" and out["agent_numba"] is None and out["agent_emulator"] == "qemu-aarch64"
    b = out["agent"]["backends"]
    assert b["cpu"]["kernels"] == "numpy" and b["npu"]["kernels"] == "numpy" and "numba" in b["cpu"]["unavailable"]
    assert out["logits_cosine_vs_host"] >= 0.999
    assert out["numba_reference_numba"]  # the reference agent on this host really ran numba kernels
    assert out["logits_cosine_vs_numba"] >= COSINE_VS_NUMBA and out["top1_equals_numba"]
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    ops = [e for e in events if e["args"].get("backend")]
    assert len(ops) > 30 * 7 and all(e["args"]["backend"] == "numpy" for e in ops)  # every op says numpy computed it
    cpu_ops = [e for e in ops if e["args"].get("emulated") == "isa"]  # the cpu lane: arm64 code under qemu
    assert cpu_ops and all(e["args"]["emulated"] in ("isa", "semantics") for e in ops)
    print(f"\narm64 prefill of 10 tokens: makespan {out['makespan_ms'] / 1e3:.1f} s ({out['tok_per_s']:.2f} tok/s); "
          f"cosine vs host {out['logits_cosine_vs_host']:.7f}; "
          f"vs numba {out['logits_cosine_vs_numba']:.7f}, max |dlogit| "
          f"{out['logits_max_abs_diff_vs_numba']:.2g}")


def test_decode_on_the_emulated_arm64_agent(store):
    out = _cli(["--model", "smollm2-135m", "--scheme", "w8a8-shadow", "--prompt-len", "4", "--decode", "3",
                "--device", "arm64"], store)
    assert out["agent_machine"] == "aarch64" and out["agent_numba"] is None
    assert out["decode_steps"] == 3 and len(out["texts"]) == 1 and out["texts"][0]
    assert out["logits_cosine_vs_host"] >= 0.999 and out["decode_logits_min_cosine_vs_host"] >= 0.999
    print(f"\narm64 decode: median step {out['decode_step_ms_median'] / 1e3:.2f} s "
          f"({out['decode_tok_per_s']:.2f} tok/s); "
          f"min cosine vs host {out['decode_logits_min_cosine_vs_host']:.7f}")


def test_ssh_deploy_into_the_arm64_python_sends_only_agent_and_kernels(sshd, tmp_path, tiny, free_port):
    remote = tmp_path / "phone"
    qm = tiny(2, seed=16, scheme="q4_0-tile")  # LUT dequantization and FP16 GEMMs, in numpy there
    dev = Device.ssh("127.0.0.1", _user(), sshd["key"], port=sshd["port"], python=str(arm64.python()),
                     known_hosts=sshd["known_hosts"], remote_dir=str(remote), agent_port=free_port(), progress=False)
    try:
        assert dev.info["machine"] == "aarch64" and dev.info["numba"] is None and dev.info["emulator"] == "qemu-aarch64"
        got = dev.generate(qm, [1, 2, 3], 3, progress=False)
        assert all(e["backend"] == "numpy" for e in got.trace.events if e["lane"] in ("cpu", "npu"))
    finally:
        dev.close()
    # the device holds the agent and the kernels, never the host toolkit
    pkgs = {p.name for p in remote.iterdir() if p.is_dir() and p.name != "store" and p.name != "__pycache__"}
    assert pkgs == {"edgeprobe_agent", "edgeprobe_kernels"}
    sent = [p for p in remote.rglob("*") if p.is_file() and p.suffix in (".py", ".cl")]
    assert not any("toolkit" in p.parts or p.parent.name == "edgeprobe" for p in sent)
    with Device.local(store=tmp_path / "ref") as ref:
        assert ref.info["numba"]
        want = ref.generate(qm, [1, 2, 3], 3, progress=False)
    assert np.array_equal(got.tokens, want.tokens)
    assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(got.logits, want.logits))


def test_a_device_python_without_pyzmq_is_told_what_to_install(sshd, tmp_path, free_port):
    """A real interpreter that has numpy and msgpack but no pyzmq: a venv given only those two packages."""
    env = tmp_path / "phone-venv"
    venv.EnvBuilder(with_pip=False).create(env)
    site = next((env / "lib").glob("python3*/site-packages"))
    have = Path(np.__file__).parent.parent  # this venv's site-packages
    assert (have / "numpy").is_dir() and (have / "msgpack").is_dir() and (have / "zmq").is_dir()
    for name in ("numpy", "numpy.libs", "msgpack"):  # numpy.libs: its bundled OpenBLAS (wheels only)
        if (have / name).exists():
            (site / name).symlink_to(have / name)
    with pytest.raises(DeployError) as e:
        Device.ssh("127.0.0.1", _user(), sshd["key"], port=sshd["port"], python=str(env / "bin" / "python"),
                   known_hosts=sshd["known_hosts"], remote_dir=str(tmp_path / "r"), agent_port=free_port(),
                   progress=False)
    msg = str(e.value)
    assert "lacks pyzmq;" in msg and "pip install pyzmq" in msg  # pyzmq alone: numpy and msgpack were found


def test_unknown_or_unbuilt_arch_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(arm64.Arm64Error, match="use arm64"):
        Device.local(store=tmp_path / "s", arch="riscv64")
    monkeypatch.setenv("EDGEPROBE_ARM64", str(tmp_path / "nothing-here"))
    with pytest.raises(arm64.Arm64Error, match="arm64_python.sh"):
        Device.local(store=tmp_path / "s", arch="arm64")
    r = subprocess.run([sys.executable, "-m", "edgeprobe", "run", "--device", "arm64", "--prompt-len", "4", "--json"],
                       capture_output=True, text=True, timeout=300, env={**os.environ})
    assert r.returncode == 2 and "arm64_python.sh" in r.stderr
