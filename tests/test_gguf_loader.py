"""The GGUF loader reads each tensor's bytes from the file in row blocks and dequantizes them into one float32 array:
the same bits as `gguf.quants.dequantize` of the whole tensor, for every ggml type the loader meets."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from edgeprobe import models
from edgeprobe.errors import ModelFormatError
from edgeprobe.models import gguf_loader
from edgeprobe.models.gguf_writer import add_bpe_tokenizer, add_llama_keys

Q = gguf.GGMLQuantizationType
# tiny llama: hidden 256 (a K-quant super-block), 1 block, a 256-piece byte vocabulary
H, FFN, HEADS, KV, HD, V = 256, 512, 4, 2, 64, 256


def _raw_k_quant(rng, shape: tuple, qtype) -> np.ndarray:
    """Random bytes in `qtype`'s block layout, its float16 scales set to small finite values (gguf-py cannot
    quantize to K-quants)."""
    blocks = rng.integers(0, 256, gguf.quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    b = blocks.reshape(-1, size)
    scale_at = {Q.Q4_K: (0, 2), Q.Q6_K: (size - 2,)}[qtype]  # Q4_K: d, dmin first; Q6_K: d last
    for at in scale_at:
        d = (rng.random(len(b), dtype=np.float32) * np.float32(1e-3)).astype(np.float16)
        b[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks


def _encode(rng, shape: tuple, qtype) -> tuple[np.ndarray, object]:
    """(array to write, raw_dtype) for a tensor of float `shape` stored as `qtype`."""
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    if qtype == Q.F32:
        return x, None
    if qtype == Q.F16:
        return x.astype(np.float16), None
    if qtype in (Q.Q4_K, Q.Q6_K):
        return _raw_k_quant(rng, shape, qtype), qtype
    return gguf.quants.quantize(x, qtype), qtype  # BF16, Q8_0, Q4_0


def _write(path: Path, specs: dict, seed: int = 0, llama: bool = False) -> None:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    if llama:
        add_llama_keys(w, context=128, hidden=H, n_layers=1, ffn=FFN, heads=HEADS, kv_heads=KV, head_dim=HD,
                       rope_theta=10000.0, rms_eps=1e-5, vocab=V)
        byte_pieces = [chr(c) for c in range(0x100, 0x200)]  # any 256 distinct pieces: nothing is tokenized here
        add_bpe_tokenizer(w, byte_pieces, [], [1] * V, "gpt-2")
    for name, (shape, qtype) in specs.items():
        arr, raw = _encode(rng, shape, qtype)
        w.add_tensor(name, arr, raw_dtype=raw)  # quantized: `arr` holds the bytes, shaped [rows, row bytes]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _reference(path: Path) -> dict[str, np.ndarray]:
    """Each tensor as `gguf.quants.dequantize` gives it from the reader's map, whole, float32 in its numpy shape."""
    reader = gguf.GGUFReader(path)
    return {t.name: np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
            .reshape(tuple(int(x) for x in reversed(t.shape))) for t in reader.tensors}


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32),
                                                                                       b.view(np.uint32))


def _count_blocks(monkeypatch) -> dict:
    """Wrap gguf.quants.dequantize to count its calls per ggml type (one per row block read)."""
    calls, real = {}, gguf.quants.dequantize

    def counted(data, qtype):
        calls[qtype] = calls.get(qtype, 0) + 1
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", counted)
    return calls


LLAMA = {
    "token_embd.weight": ((V, H), Q.Q6_K),
    "blk.0.attn_norm.weight": ((H,), Q.F32),
    "blk.0.attn_q.weight": ((HEADS * HD, H), Q.Q4_K),
    "blk.0.attn_k.weight": ((KV * HD, H), Q.Q8_0),
    "blk.0.attn_v.weight": ((KV * HD, H), Q.Q4_0),
    "blk.0.attn_output.weight": ((H, HEADS * HD), Q.F16),
    "blk.0.ffn_norm.weight": ((H,), Q.F32),
    "blk.0.ffn_gate.weight": ((FFN, H), Q.BF16),
    "blk.0.ffn_up.weight": ((FFN, H), Q.F32),
    "blk.0.ffn_down.weight": ((H, FFN), Q.Q4_K),
    "output_norm.weight": ((H,), Q.F32),
    "output.weight": ((V, H), Q.Q8_0),
}


def test_loaded_weights_equal_whole_tensor_dequantization_bit_for_bit(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    _write(path, LLAMA, llama=True)
    ref = _reference(path)
    # ~1,000 values a block: 3 rows of 256 or 1 of 512 -> every 2-D tensor in several blocks, the last one partial
    monkeypatch.setattr(gguf_loader, "_BLOCK_VALUES", 1000)
    calls = _count_blocks(monkeypatch)
    m = models.load(path, cache_dir=tmp_path / "cache")
    assert m.meta["tensor_types"] == {"Q6_K": 1, "F32": 4, "Q4_K": 2, "Q8_0": 2, "Q4_0": 1, "F16": 1, "BF16": 1}
    for name in LLAMA:
        assert _same_bits(np.asarray(m.weights[name]), ref[name]), name
    assert calls[Q.Q6_K] == -(-V // 3) and calls[Q.Q4_K] == -(-HEADS * HD // 3) + H
    assert calls[Q.F32] == 3 + -(-FFN // 3)  # the three norms are one row each
    # the weights cache holds the same bits: a second load maps them
    m2 = models.load(path, cache_dir=tmp_path / "cache")
    for name in LLAMA:
        w = m2.weights[name]
        assert isinstance(w, np.memmap) and _same_bits(np.asarray(w), ref[name]), name


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_a_tensor_larger_than_one_block_is_read_in_several(tmp_path, monkeypatch, qtype):
    rows, cols = 1100, 4096  # 4.5M values: two default blocks of 1,024 rows, the second partial
    assert rows * cols > gguf_loader._BLOCK_VALUES
    path = tmp_path / "big.gguf"
    _write(path, {"big.weight": ((rows, cols), qtype), "small.weight": ((8, 256), Q.F16)}, seed=1)
    ref = _reference(path)
    calls = _count_blocks(monkeypatch)
    reader = gguf.GGUFReader(path)
    got = {t.name: gguf_loader.read_tensor(path, t) for t in reader.tensors}
    assert calls[qtype] == 2 and calls[Q.F16] == 1
    assert _same_bits(got["big.weight"], ref["big.weight"]) and _same_bits(got["small.weight"], ref["small.weight"])


def test_row_blocks_shared_over_threads_and_an_expert_alone_give_the_same_bits(tmp_path, monkeypatch):
    """Inside a host pass read_tensor's row blocks run on the pass's threads (pread, no shared file position): the
    blocks are the same, so are the bits; a row range (an MoE expert's rows) is those rows of the whole."""
    import threading

    from edgeprobe_kernels import threads as T

    rows, cols = 1100, 4096
    path = tmp_path / "big.gguf"
    _write(path, {"big.weight": ((rows, cols), Q.Q8_0)}, seed=2)
    ref = _reference(path)["big.weight"]
    seen, real, lock = set(), gguf.quants.dequantize, threading.Lock()

    def tracked(data, qtype):
        with lock:
            seen.add(threading.current_thread().name)
        return real(data, qtype)
    monkeypatch.setattr(gguf.quants, "dequantize", tracked)
    monkeypatch.setattr(gguf_loader, "_BLOCK_VALUES", 100 * cols)  # 11 blocks
    monkeypatch.setenv("EDGEPROBE_THREADS", "2")
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "big.weight")
    with T.host_pass():
        whole = gguf_loader.read_tensor(path, t)
        part = gguf_loader.read_tensor(path, t, (300, 550))
    assert _same_bits(whole, ref) and _same_bits(part, np.ascontiguousarray(ref[300:850]))
    assert len(seen) == 2  # the calling thread and one of the pool's


def test_a_file_truncated_after_it_was_opened_names_the_tensor(tmp_path):
    """Truncated before loading is test_models.py's; here the file shrinks once the loader has checked it."""
    path = tmp_path / "tiny.gguf"
    _write(path, LLAMA, llama=True)
    m = models.load(path, cache_dir=None)
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "output.weight")
    del reader
    m.weights["blk.0.attn_q.weight"]  # noqa: B018 - loads while the file is whole
    with open(path, "r+b") as f:
        f.truncate(t.data_offset + t.n_bytes // 2)
    with pytest.raises(ModelFormatError, match="truncated: tensor output.weight ends past the end") as e:
        m.weights["output.weight"]  # noqa: B018
    assert "\n" not in str(e.value)
