"""Loading real checkpoints: metadata, tokenizer, lazy dequantization, cache, bad files."""
import json

import gguf
import numpy as np
import pytest

from edgeprobe import models
from edgeprobe.corpus import read_corpus
from edgeprobe.errors import ModelFormatError, ModelNotFoundError, TokenRangeError, UnsupportedModelError
from edgeprobe.models.tokenizer import Tokenizer


def test_smollm2_config_from_metadata(smollm):
    c = smollm.config
    assert (c.n_layers, c.hidden, c.ffn, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 1536, 9, 3, 64)
    assert c.vocab_size == 49152 and c.rope_theta == 100000.0 and abs(c.rms_eps - 1e-5) < 1e-9
    assert c.tie_embeddings and "output.weight" not in smollm.weights
    assert smollm.output_weight is smollm.weights["token_embd.weight"]
    assert smollm.meta["tensor_types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    assert 130e6 < c.n_params() < 140e6


def test_weights_are_dequantized_with_gguf_quants(smollm):
    reader = gguf.GGUFReader(smollm.source)
    t = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    ref = gguf.quants.dequantize(t.data, t.tensor_type)
    w = smollm.weights["blk.3.ffn_down.weight"]
    assert w.dtype == np.float32 and w.shape == (576, 1536)
    np.testing.assert_array_equal(w, ref)


def test_second_load_uses_cache_without_parsing_gguf(tmp_path, monkeypatch):
    path = models.resolve("smollm2-135m")
    m1 = models.load(path, cache_dir=tmp_path)
    w1 = np.array(m1.weights["blk.0.attn_q.weight"])
    assert (tmp_path / "meta.json").exists() and (tmp_path / "blk.0.attn_q.weight.npy").exists()

    def no_parse(*a, **k):
        raise AssertionError("the GGUF was parsed again although the cache holds everything needed")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    m2 = models.load(path, cache_dir=tmp_path)
    assert m2.config == m1.config
    np.testing.assert_array_equal(m2.weights["blk.0.attn_q.weight"], w1)
    assert isinstance(m2.weights["blk.0.attn_q.weight"], np.memmap)
    assert m2.tokenizer.encode("cache hit") .tolist() == m1.tokenizer.encode("cache hit").tolist()


def test_unwritable_cache_falls_back_to_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="cannot write the weight cache"):
        m = models.load("smollm2-135m", cache_dir=blocker / "sub")
        w = m.weights["blk.0.attn_norm.weight"]
    assert w.shape == (576,)


def test_tokenizer_round_trips_the_corpus_exactly(smollm):
    for split in ("train", "heldout"):
        text = read_corpus(split)
        ids = smollm.tokenizer.encode(text)
        assert smollm.tokenizer.decode(ids) == text
    text = "naïve café — 東京 🚀 x=1234\t\n  end"
    assert smollm.tokenizer.decode(smollm.tokenizer.encode(text)) == text


def test_tokenizer_pre_tokenizer_and_special_tokens(smollm):
    tok = smollm.tokenizer
    # SmolLM2's pre-tokenizer ("smollm") splits every digit apart.
    digits = [tok.decode([i]) for i in tok.encode("2024")]
    assert digits == ["2", "0", "2", "4"]
    # Control tokens are matched whole, not spelled out.
    assert tok.encode("<|im_start|>").tolist() == [1]
    # The metadata says add_bos_token = false: no BOS is added.
    assert not tok.add_bos and tok.encode("Hello")[0] != tok.bos_id


def test_bos_added_only_where_metadata_says(smollm):
    tok = Tokenizer(hf=smollm.tokenizer.hf, vocab_size=smollm.tokenizer.vocab_size, bos_id=1, eos_id=2, add_bos=True)
    assert tok.encode("Hello")[0] == 1
    assert tok.encode("Hello", add_bos=False).tolist() == smollm.tokenizer.encode("Hello").tolist()


def test_decode_rejects_ids_out_of_range(smollm):
    with pytest.raises(TokenRangeError, match="outside the vocabulary"):
        smollm.tokenizer.decode([5, 49152])


# ---- bad files -----------------------------------------------------------------------------------

def test_missing_file_and_unknown_name(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not a built-in name"):
        models.load(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        models.load("smollm3-999m")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("this is a text file, not a checkpoint\n")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        models.load(p)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFormatError, match="empty"):
        models.load(empty)


@pytest.mark.parametrize("keep", [1000, 5_000_000, 98_000_000])
def test_truncated_gguf(tmp_path, keep):
    src = models.resolve("smollm2-135m")
    p = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        p.write_bytes(f.read(keep))
    with pytest.raises(ModelFormatError, match="truncated"):
        models.load(p, cache_dir=None)


def _write_gguf(path, arch, extra=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    for k, v in (extra or {}).items():
        w.add_uint32(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "gpt2.gguf"
    _write_gguf(p, "gpt2")
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2' is not supported"):
        models.load(p, cache_dir=None)


def test_llama_gguf_with_missing_tensors(tmp_path):
    p = tmp_path / "partial.gguf"
    _write_gguf(p, "llama")
    with pytest.raises(ModelFormatError, match="missing"):
        models.load(p, cache_dir=None)


def test_hf_folder_errors(tmp_path):
    with pytest.raises(ModelFormatError, match="config.json"):
        models.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="model_type 'bert'"):
        models.load(tmp_path)
