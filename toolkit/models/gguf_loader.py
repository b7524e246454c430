"""Load a Llama-family GGUF checkpoint: config from metadata, tokenizer, lazily dequantized weights.

Dequantization uses the `gguf` package's own `gguf.quants.dequantize` (every ggml type it knows).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import gguf
import numpy as np

from edgeprobe_kernels.threads import run_blocks

from ..errors import ModelFormatError, UnsupportedModelError
from .config import ModelConfig, check_ffn_shapes, fused_rows
from .model import Model
from .tokenizer import Tokenizer
from .weights import LazyWeights, default_cache_dir, file_sha256, npy_cache_limit

SUPPORTED_ARCHS = ("llama", "gemma2", "gemma3", "phi3", "qwen2", "qwen3", "qwen3moe")
# llama.cpp runs these with NEOX RoPE: Q/K rows stay in the halves layout
HALVES_ARCHS = ("gemma2", "gemma3", "phi3", "qwen2", "qwen3", "qwen3moe")
GEMMA_ARCHS = ("gemma2", "gemma3")
# llama.cpp's values for Gemma files that lack the keys (src/llama-model.cpp): Gemma 3 has 5 local layers to 1
# global and a local RoPE base, Gemma 2 alternates local and global layers
GEMMA3_SWA_PATTERN, GEMMA3_ROPE_LOCAL, GEMMA2_SWA_PATTERN = 6, 10000.0, 2
GEMMA2_27B_LAYERS = 46  # llama.cpp scales Gemma 2 27B's queries by 1/sqrt(hidden / heads), the others' by head_dim's
_MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _MAGIC


def open_reader(path: Path) -> gguf.GGUFReader:
    """GGUFReader with its low-level failures turned into ModelFormatError."""
    if not is_gguf(path):
        raise ModelFormatError(f"{path} is not a GGUF file (its first bytes are not 'GGUF'); "
                               "pass a .gguf checkpoint or a Hugging Face model folder")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader fails with IndexError/ValueError deep inside numpy on bad files
        raise ModelFormatError(
            f"{path} starts like a GGUF file but cannot be read ({type(e).__name__}: {e}); it is probably "
            "truncated or corrupt: copy or download it again") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelFormatError(f"{path} is truncated: tensor {t.name} ends past the end of the file; "
                                   "copy or download it again")
    return reader


def _field_getter(reader: gguf.GGUFReader):
    def get(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()
    return get


def config_from_gguf(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    get = _field_getter(reader)
    arch = get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(f"{path}: architecture {arch!r} is not supported "
                                    f"(supported: {', '.join(SUPPORTED_ARCHS)}); use a Llama-family model")

    def need(key):
        v = get(f"{arch}.{key}")
        if v is None:
            raise ModelFormatError(f"{path}: metadata key {arch}.{key} is missing; the file was not written "
                                   "by a complete GGUF converter")
        return v

    names = {t.name: t for t in reader.tensors}
    hidden, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    n_kv = int(get(f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(get(f"{arch}.attention.key_length", hidden // n_heads))
    vocab = get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(get("tokenizer.ggml.tokens", []))
    n_experts = int(get(f"{arch}.expert_count", 0) or 0)
    gemma = arch in GEMMA_ARCHS
    window = int(get(f"{arch}.attention.sliding_window", 0) or 0)
    n_layers = int(need("block_count"))
    if "rope_factors_long.weight" in names or "rope_factors_short.weight" in names:
        raise UnsupportedModelError(f"{path}: LongRoPE (rope_factors_long/short, Phi-3 128k) is not supported; "
                                    "plain RoPE and Llama 3's are implemented")
    swa_default = {"gemma3": GEMMA3_SWA_PATTERN, "gemma2": GEMMA2_SWA_PATTERN, "phi3": n_layers + 1}.get(arch, 0)
    attn_scale = 0.0
    if arch == "gemma2" and n_layers == GEMMA2_27B_LAYERS and hidden // n_heads != head_dim:
        attn_scale = float(hidden // n_heads) ** -0.5
    return ModelConfig(
        arch=arch,
        n_layers=n_layers,
        hidden=hidden,
        ffn=int(need("feed_forward_length")),  # Phi-3's fused ffn_up holds 2 x this many rows
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=int(vocab),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(get(f"{arch}.context_length", 2048)),
        rope_pairs="adjacent",  # Gemma's files keep Hugging Face's halves: the loader permutes Q/K (and their norms)
        tie_embeddings="output.weight" not in names,
        act_fn="gelu_tanh" if gemma else "silu",
        embed_scale=float(np.sqrt(np.float32(hidden))) if gemma else 1.0,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        post_norms="blk.0.post_attention_norm.weight" in names,
        sliding_window=window,
        swa_pattern=int(get(f"{arch}.attention.sliding_window_pattern", swa_default if window else 0)),
        rope_theta_local=float(get(f"{arch}.rope.freq_base_swa", GEMMA3_ROPE_LOCAL if arch == "gemma3" else 0.0)),
        attn_scale=attn_scale,
        attn_softcap=float(get(f"{arch}.attn_logit_softcapping", 0.0) or 0.0),
        final_softcap=float(get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
        attn_bias="blk.0.attn_q.bias" in names,
        rope_freq_factors=tuple(_rope_freqs(path, names.get("rope_freqs.weight"))),
        n_experts=n_experts,
        n_experts_used=int(get(f"{arch}.expert_used_count", 0) or 0),
        expert_ffn=int(get(f"{arch}.expert_feed_forward_length", 0) or 0),
        norm_topk=bool(get(f"{arch}.expert_weights_norm", True)),
        shared_expert_ffn=int(get(f"{arch}.expert_shared_feed_forward_length", 0) or 0),
        shared_expert_gate="blk.0.ffn_gate_inp_shexp.weight" in names,
        name=str(get("general.name", path.stem)),
    )


# float32 values per row block: a tensor is dequantized block by block into one preallocated array (16 MiB a block)
_BLOCK_VALUES = 1 << 22


def _read_into(fd: int, buf: np.ndarray, offset: int) -> int:
    """Fill uint8 `buf` from `offset` of file descriptor `fd` (pread: no shared position, so threads may read one
    file at once); returns the bytes read (short only at the end)."""
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            break
        got += n
    return got


def read_tensor(path: Path, t: gguf.ReaderTensor, row_range: tuple[int, int] | None = None) -> np.ndarray:
    """float32[rows, cols] of tensor `t` (rows: the product of its outer dims), the values of
    `gguf.quants.dequantize(t.data, t.tensor_type)` bit for bit; with row_range=(first, count), those rows only
    (an MoE expert's slice of a stacked [E, out, in] tensor: its out rows from first = e * out).

    Its bytes are read from the file a row block at a time (not through the reader's memory map, whose pages would
    stay resident) and each block dequantized into one preallocated array: the transient is one float32 copy plus a
    block a thread. Row blocks give the same bits as the whole tensor, since ggml dequantizes each row's blocks on
    their own; inside a host pass the blocks are shared over its threads (gguf's numpy dequantization releases the
    GIL: 190 M values/s a core for Q8_0, a third of an 8B outlier profile's time on 512 tokens).
    """
    stored = t.data  # a view of the reader's map: only its dtype and shape are used, no page of it is touched
    row_items = int(stored.shape[-1]) if stored.ndim else 1
    rows = max(1, int(stored.size) // max(row_items, 1))
    cols = int(t.n_elements) // rows
    row_bytes = row_items * stored.dtype.itemsize
    first, rows = (0, rows) if row_range is None else row_range
    out = np.empty((rows, cols), np.float32)
    step = max(1, _BLOCK_VALUES // max(cols, 1))
    fd = os.open(path, os.O_RDONLY)

    def rows_block(r0: int, r1: int) -> None:
        n = r1 - r0
        buf = np.empty(n * row_bytes, np.uint8)
        if _read_into(fd, buf, t.data_offset + (first + r0) * row_bytes) != buf.size:
            raise ModelFormatError(f"{path} is truncated: tensor {t.name} ends past the end of the file; "
                                   "copy or download it again")
        try:
            block = gguf.quants.dequantize(buf.view(stored.dtype).reshape(n, row_items), t.tensor_type)
        except NotImplementedError as e:
            raise UnsupportedModelError(f"tensor {t.name}: ggml type {t.tensor_type.name} cannot be "
                                        "dequantized by the installed gguf package; upgrade gguf") from e
        out[r0:r1] = block.reshape(n, cols)
    try:
        run_blocks(rows_block, [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)])
    finally:
        os.close(fd)
    return out


def _expert_dequantizer(get_reader, name: str, shape: tuple):
    """load(e) -> float32[out, in]: expert e's rows of a stacked [E, out, in] tensor, read alone (EdgeMoE loads
    one expert at a time; a Mixtral-8x7B stack is 1.9 GB of float32, an expert 235 MB)."""
    E, out, cols = shape

    def load(e: int) -> np.ndarray:
        if not 0 <= e < E:
            raise IndexError(f"{name} has {E} experts, not {e}")
        r = get_reader()
        return read_tensor(r.path, r.tensor(name), (e * out, out)).reshape(out, cols)
    return load


def _dequantizer(get_reader, name: str, shape: tuple, transform=None):
    def load() -> np.ndarray:
        r = get_reader()
        arr = read_tensor(r.path, r.tensor(name)).reshape(shape)
        return transform(arr) if transform else arr
    return load


def _rope_freqs(path: Path, t) -> np.ndarray:
    """Llama 3's RoPE frequency divisors, stored by llama.cpp's converter as the tensor rope_freqs.weight."""
    if t is None:
        return np.zeros(0)
    return read_tensor(path, t).reshape(-1).astype(np.float64)


def _fused(cfg: ModelConfig, name: str, shapes: dict) -> list[tuple[str, int, int]] | None:
    """Phi-3's fused tensors as llama.cpp's converter writes them -> [(unfused name, first row, rows)]: attn_qkv
    holds Q, K, V's rows, ffn_up (with no ffn_gate beside it) gate's then up's (None for any other tensor)."""
    if cfg.arch != "phi3":
        return None
    blk = name.rpartition(".")[0].rpartition(".")[0]  # blk.{i}
    if name.endswith(".attn_qkv.weight"):
        return fused_rows(cfg, blk, "qkv")
    if name.endswith(".ffn_up.weight") and f"{blk}.ffn_gate.weight" not in shapes and shapes[name][0] == 2 * cfg.ffn:
        return fused_rows(cfg, blk, "gate_up")
    return None


def _rope_transforms(cfg: ModelConfig, names) -> dict:
    """Per-tensor reorderings into the forward pass's "adjacent" RoPE layout. llama.cpp's converter permutes
    Llama's Q/K rows already; Gemma's and Qwen's files keep the halves layout (NEOX RoPE): their Q/K rows,
    biases and per-head norms are reordered here."""
    from .hf_loader import rope_layout_transform

    if cfg.arch not in HALVES_ARCHS:
        return {}
    out = {n: rope_layout_transform(n, cfg) for n in names}
    return {n: f for n, f in out.items() if f is not None}


class _Reader:
    """Opens the GGUF file once, on first need (parsing its metadata takes seconds in pure Python)."""

    def __init__(self, path: Path, reader: gguf.GGUFReader | None = None):
        self.path, self._reader, self._by_name = path, reader, None

    def __call__(self) -> "_Reader":
        if self._reader is None:
            self._reader = open_reader(self.path)
        return self

    def tensor(self, name: str) -> gguf.ReaderTensor:
        if self._by_name is None:
            self._by_name = {t.name: t for t in self._reader.tensors}
        return self._by_name[name]


def _check_tensors(cfg: ModelConfig, reader: gguf.GGUFReader, path: Path) -> None:
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}
    for name, shape in list(shapes.items()):  # Phi-3: check the unfused tensors
        for part, _, rows in _fused(cfg, name, shapes) or ():
            shapes[part] = (rows, *shape[1:])
    h, q, kv = cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    expect = {"token_embd.weight": (cfg.vocab_size, h), "output_norm.weight": (h,)}
    for i in range(cfg.n_layers):
        expect.update({f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,),
                       f"blk.{i}.attn_q.weight": (q, h), f"blk.{i}.attn_k.weight": (kv, h),
                       f"blk.{i}.attn_v.weight": (kv, h), f"blk.{i}.attn_output.weight": (h, q)})
        if not cfg.n_experts:
            expect.update({f"blk.{i}.ffn_gate.weight": (cfg.ffn, h), f"blk.{i}.ffn_up.weight": (cfg.ffn, h),
                           f"blk.{i}.ffn_down.weight": (h, cfg.ffn)})
        if cfg.qk_norm:
            expect.update({f"blk.{i}.attn_q_norm.weight": (cfg.head_dim,),
                           f"blk.{i}.attn_k_norm.weight": (cfg.head_dim,)})
        if cfg.post_norms:
            expect.update({f"blk.{i}.post_attention_norm.weight": (h,), f"blk.{i}.post_ffw_norm.weight": (h,)})
    check_ffn_shapes(cfg, shapes, path)
    for name, shape in expect.items():
        if name not in shapes:
            raise ModelFormatError(f"{path}: tensor {name} is missing; this is not a complete "
                                   f"{cfg.arch} checkpoint")
        if shapes[name] != shape:
            raise ModelFormatError(f"{path}: tensor {name} has shape {shapes[name]}, the metadata implies "
                                   f"{shape}; the file's metadata and tensors disagree")


def load_gguf(path: Path, cache_dir: Path | None | bool = True, name: str = "") -> Model:
    """Load a GGUF file. `cache_dir=True` uses the default cache, None/False disables caching.

    The cache (`<cache>/weights/<sha256[:24]>/`) holds the config and the tokenizer, so a second load of the same
    file never parses the GGUF again, and, for a model whose float32 weights fit `npy_cache_limit()` (2 GB: the
    built-in models), each tensor as float32 .npy, mapped instead of dequantized again. A larger model's weights stay
    in the checkpoint's quantized blocks and are dequantized when a pass reads them (issue 43, item 1): the cache
    then grows by its metadata only.
    """
    path = Path(path)
    if not is_gguf(path):
        open_reader(path)  # raises the precise error
    sha = file_sha256(path)
    if cache_dir is True:
        cache_dir = default_cache_dir() / "weights" / sha[:24]
    cache_dir = Path(cache_dir) if cache_dir else None
    meta = _read_meta(cache_dir)
    if meta is not None:
        cfg = ModelConfig(**meta["config"])
        tok = Tokenizer.from_json(meta["tokenizer"])
        get_reader, shapes, types = _Reader(path), meta["shapes"], meta["tensor_types"]
    else:
        reader = open_reader(path)
        cfg = config_from_gguf(reader, path)
        _check_tensors(cfg, reader, path)
        tok = Tokenizer.from_gguf_fields(_field_getter(reader))
        get_reader = _Reader(path, reader)
        shapes = {t.name: [int(x) for x in reversed(t.shape)] for t in reader.tensors}
        types = {}
        for t in reader.tensors:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        _write_meta(cache_dir, {"config": dataclasses.asdict(cfg), "tokenizer": tok.to_json(),
                                "shapes": shapes, "tensor_types": types, "source": str(path)})
    from .hf_loader import _chain, rope_layout_transform

    loaders = {}
    for n, s in shapes.items():
        parts = _fused(cfg, n, shapes)
        if parts is None:
            loaders[n] = None
            continue
        for part, r0, rows in parts:  # Phi-3: each part is its rows of the fused tensor, then in the adjacent layout
            rope = rope_layout_transform(part, cfg) if cfg.arch in HALVES_ARCHS else None
            loaders[part] = _dequantizer(get_reader, n, tuple(s), _chain((lambda a, b: lambda w: w[a:a + b])(r0, rows),
                                                                        rope))
    tf = _rope_transforms(cfg, shapes)
    loaders = {n: f or _dequantizer(get_reader, n, tuple(shapes[n]), tf.get(n)) for n, f in loaders.items()}
    float_bytes = 4 * sum(math.prod(s) for s in shapes.values())
    npy_dir = cache_dir if float_bytes <= npy_cache_limit() else None
    parts = {n: _expert_dequantizer(get_reader, n, tuple(s)) for n, s in shapes.items()
             if n.endswith("_exps.weight") and len(s) == 3}
    return Model(config=cfg, tokenizer=tok, weights=LazyWeights(loaders, npy_dir, parts=parts), source=str(path),
                 sha256=sha, name=name or cfg.name,
                 meta={"format": "gguf", "tensor_types": types, "float32_bytes": float_bytes,
                       "npy_cache": str(npy_dir) if npy_dir else None})


_META = "meta.json"


def _read_meta(cache_dir: Path | None) -> dict | None:
    if cache_dir is None or not (cache_dir / _META).exists():
        return None
    try:
        meta = json.loads((cache_dir / _META).read_text())
        return meta if meta.get("version") == _META_VERSION else None
    except (OSError, ValueError):
        return None  # unreadable cache metadata: parse the GGUF again


def _write_meta(cache_dir: Path | None, meta: dict) -> None:
    if cache_dir is None:
        return
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f"{_META}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"version": _META_VERSION, **meta}))
        os.replace(tmp, cache_dir / _META)
    except OSError:
        pass  # no cache then; LazyWeights warns once when it cannot write tensors either


_META_VERSION = 2  # 2: Gemma 3 fields in the config
