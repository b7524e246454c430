import socket

import numpy as np
import pytest


class _ToyTokenizer:
    def __init__(self, tag):
        self.tag = tag

    def to_json(self):
        return {"toy": self.tag}  # a distinct tokenizer blob per model


def tiny_llm(n_layers: int, seed: int, scheme: str = "float", **quantize_kw):
    """A random Llama of `n_layers` layers, hidden 16, vocab 64, quantized under `scheme`: a decode step on the
    agent costs about a millisecond. Every weight (norms too) is random, so no two models share a blob."""
    from edgeprobe.models import LazyWeights
    from edgeprobe.models.config import ModelConfig
    from edgeprobe.models.model import Model
    from edgeprobe.quant import quantize

    rng = np.random.default_rng(seed)
    h, f, V = 16, 32, 64
    cfg = ModelConfig(arch="llama", n_layers=n_layers, hidden=h, ffn=f, n_heads=2, n_kv_heads=1, head_dim=8,
                      vocab_size=V, context_length=4096)
    norm = lambda: 1 + 0.1 * rng.normal(size=h)
    w = {"token_embd.weight": rng.normal(size=(V, h)), "output_norm.weight": norm()}
    for i in range(n_layers):
        w.update({f"blk.{i}.attn_norm.weight": norm(), f"blk.{i}.ffn_norm.weight": norm(),
                  f"blk.{i}.attn_q.weight": rng.normal(size=(16, h)) * .3,
                  f"blk.{i}.attn_k.weight": rng.normal(size=(8, h)) * .3,
                  f"blk.{i}.attn_v.weight": rng.normal(size=(8, h)) * .3,
                  f"blk.{i}.attn_output.weight": rng.normal(size=(h, 16)) * .3,
                  f"blk.{i}.ffn_gate.weight": rng.normal(size=(f, h)) * .3,
                  f"blk.{i}.ffn_up.weight": rng.normal(size=(f, h)) * .3,
                  f"blk.{i}.ffn_down.weight": rng.normal(size=(h, f)) * .3})
    loaders = {n: (lambda a=a: np.asarray(a, np.float32)) for n, a in w.items()}
    m = Model(config=cfg, tokenizer=_ToyTokenizer(seed), weights=LazyWeights(loaders, None), source="toy",
              sha256=f"{seed:064x}", name=f"toy{seed}")
    return quantize(m, scheme, **quantize_kw)


@pytest.fixture(scope="session")
def tiny():
    return tiny_llm


@pytest.fixture(scope="module")
def dev(module_dir):
    """A local agent of this test module, on its own store."""
    from edgeprobe.device import Device

    d = Device.local(store=module_dir / "store")
    yield d
    d.close()


@pytest.fixture(scope="session")
def slow_plan():
    """make(n) -> (plan, inputs): a chain of n matrix-vector products with a 64 MB matrix (2.5 ms each on one
    idle core here, 16 kB kept per op), so a run lasts long enough to cancel or to outlive a heartbeat timeout,
    from a small plan."""
    def make(n: int):
        ops = [{"name": f"mv{i}", "kind": "lm_head", "lane": "cpu",
                "inputs": [{"input": "x"} if i == 0 else {"op": f"mv{i - 1}"}, {"input": "w"}]} for i in range(n)]
        return {"ops": ops}, {"x": np.ones((1, 4096), np.float32), "w": np.eye(4096, dtype=np.float32)}
    return make


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A real OpenSSH server on 127.0.0.1 (Termux's sshd stand-in) with its own keys; info: port, key, known_hosts,
    dir (which also holds wrong_known_hosts: another key under the server's name)."""
    from edgeprobe.deploy import start_local_sshd

    proc, info = start_local_sshd(tmp_path_factory.mktemp("sshd"))
    d = info["dir"]
    (d / "wrong_known_hosts").write_text(
        f"[127.0.0.1]:{info['port']} " + " ".join((d / "client.pub").read_text().split()[:2]) + "\n")
    yield info
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def free_port():
    """free_port() -> a loopback TCP port nothing listens on now (for a deployed agent's port)."""
    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    return pick


@pytest.fixture(scope="session")
def ray_cluster():
    """A real Ray cluster on 127.0.0.1 for the session: `ray start --head --block` with 2 CPUs, a 100 MB object store,
    no dashboard, its own ports, temp dir and auth token, started by the library's start_head (the one `--ray local`
    uses: a start the raylet aborts for Ray issue 65983 is retried with new ports, up to 3 starts). Stopped by its PID
    at the end (never `ray stop`, which stops every cluster of the machine). Yields {"address" (its GCS), "client"
    (its Ray Client server, ray://), "env", "pid"}; env is what a process joining it needs
    (this process's os.environ gets the same for the session: ray reads it when first imported)."""
    import os
    import secrets

    from edgeprobe.profile.cluster import HeadStartError, start_head

    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: Ray's switch that keeps a single-node cluster on loopback
    # the session's own, set by tests/conftest.py before anything imported Ray
    extra = {k: os.environ.get(k) or v for k, v in (
        ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "token"),
        ("RAY_AUTH_TOKEN", secrets.token_hex(32)), ("RAY_USAGE_STATS_ENABLED", "0"))}
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        head = start_head(num_cpus=2, object_store_bytes=100_000_000, env={**os.environ}, starts=3, timeout_s=180)
    except HeadStartError as e:
        pytest.fail(f"`ray start --head` did not start: {e.why}")
    try:
        yield {"address": head.address, "client": head.client, "env": {**os.environ}, "pid": head.pid}
    finally:
        head.stop(timeout_s=60)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
