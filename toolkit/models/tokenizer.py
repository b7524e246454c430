"""Tokenizers built with the `tokenizers` library, from GGUF metadata or a tokenizer.json."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ..errors import TokenRangeError, UnsupportedModelError

# GGUF token types (llama.cpp's llama_token_type): 3 = control, 4 = user-defined.
_SPECIAL_TYPES = (3, 4)

# llama.cpp's `tokenizer.ggml.pre` names, as pre-tokenizer pipelines of the `tokenizers` library.
# "smollm", "starcoder" and "refact" split every digit apart, then apply GPT-2's byte-level regex.
_PRE_TOKENIZERS = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]),
}
_PRE_TOKENIZERS["starcoder"] = _PRE_TOKENIZERS["smollm"]
_PRE_TOKENIZERS["refact"] = _PRE_TOKENIZERS["smollm"]


@dataclass
class Tokenizer:
    """Text <-> token ids. `encode` adds BOS only where the checkpoint's metadata asks for it."""

    hf: HFTokenizer
    vocab_size: int
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool = False
    _hf_json: str | None = field(default=None, init=False, repr=False, compare=False)  # to_json's, made once

    def encode(self, text: str, add_bos: bool | None = None) -> np.ndarray:
        """text -> int32[tokens]."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenRangeError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size}); "
                                  "decode ids produced by this model's tokenizer")
        return self.hf.decode(ids, skip_special_tokens=False)

    def to_json(self) -> dict:
        if self._hf_json is None:  # Gemma 3's 262k pieces take 0.5 s to serialize; each quantized model asks
            self._hf_json = self.hf.to_str()
        return {"tokenizer": self._hf_json, "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "add_bos": self.add_bos}

    @classmethod
    def from_json(cls, d: dict) -> "Tokenizer":
        return cls(hf=HFTokenizer.from_str(d["tokenizer"]), vocab_size=d["vocab_size"], bos_id=d["bos_id"],
                   eos_id=d["eos_id"], add_bos=d["add_bos"])

    @classmethod
    def from_gguf_fields(cls, get) -> "Tokenizer":
        """Build from GGUF metadata; `get(key, default)` reads one field's value."""
        kind = get("tokenizer.ggml.model", None)
        if kind == "llama":
            return cls._from_spm_fields(get)
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2', SentencePiece BPE 'llama'); "
                "load the model's Hugging Face folder instead, whose tokenizer.json describes it fully")
        pre = get("tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZERS:
            raise UnsupportedModelError(
                f"pre-tokenizer {pre!r} is not supported (known: {sorted(_PRE_TOKENIZERS)}); "
                "load the model's Hugging Face folder, whose tokenizer.json describes it fully")
        tokens = list(get("tokenizer.ggml.tokens", []))
        merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
        types = list(get("tokenizer.ggml.token_type", [1] * len(tokens)))
        hf = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        hf.pre_tokenizer = _PRE_TOKENIZERS[pre]()
        hf.decoder = decoders.ByteLevel()
        specials = [AddedToken(t, special=True, normalized=False)
                    for t, ty in zip(tokens, types) if ty in _SPECIAL_TYPES]
        hf.add_special_tokens(specials)
        return cls(hf=hf, vocab_size=len(tokens),
                   bos_id=_opt_int(get("tokenizer.ggml.bos_token_id", None)),
                   eos_id=_opt_int(get("tokenizer.ggml.eos_token_id", None)),
                   add_bos=bool(get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def _from_spm_fields(cls, get) -> "Tokenizer":
        """SentencePiece BPE stored in GGUF (llama.cpp's "llama" tokenizer: Gemma, Llama 2): pieces in priority
        order, spaces spelled "▁", unknown characters as <0xXX> byte pieces. GGUF keeps no merges; llama.cpp
        merges the adjacent pair whose union is the best-ranked piece, which is BPE with merges ranked by
        the merged piece's position in the file (Gemma's scores follow that order but for ties)."""
        tokens = list(get("tokenizer.ggml.tokens", []))
        types = list(get("tokenizer.ggml.token_type", [1] * len(tokens)))
        # Gemma stores its whitespace-run pieces as real spaces; the text they match is "▁" runs
        pieces = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
        vocab = {t: i for i, t in enumerate(pieces)}
        mergeable = {t for t, ty in zip(pieces, types) if ty in (1, 4)}  # normal and user-defined, not control/byte
        merges = []
        for i, t in enumerate(pieces):
            if t not in mergeable or len(t) < 2:
                continue
            splits = [(t[:j], t[j:]) for j in range(1, len(t)) if t[:j] in vocab and t[j:] in vocab]
            merges += [(i, vocab[a], vocab[b], a, b) for a, b in splits]
        merges.sort()
        unk = get("tokenizer.ggml.unknown_token_id", None)
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], byte_fallback=True,
                                    unk_token=pieces[int(unk)] if unk is not None else None, fuse_unk=True))
        prefix = bool(get("tokenizer.ggml.add_space_prefix", True))
        norm = [normalizers.Replace(" ", "\u2581")]
        hf.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if prefix else []) + norm)
        hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                       + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t, ty in zip(pieces, types) if ty == 3 or (ty == 4 and "\u2581" not in t)])
        return cls(hf=hf, vocab_size=len(tokens), bos_id=_opt_int(get("tokenizer.ggml.bos_token_id", None)),
                   eos_id=_opt_int(get("tokenizer.ggml.eos_token_id", None)),
                   add_bos=bool(get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_folder(cls, path, vocab_size: int, bos_id=None, eos_id=None) -> "Tokenizer":
        """Build from a Hugging Face folder's tokenizer.json (and tokenizer_config.json for add_bos)."""
        import json
        from pathlib import Path

        folder = Path(path)
        hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        add_bos = False
        cfg_file = folder / "tokenizer_config.json"
        if cfg_file.exists():
            add_bos = bool(json.loads(cfg_file.read_text()).get("add_bos_token", False))
        return cls(hf=hf, vocab_size=vocab_size, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos)


def _opt_int(v):
    return None if v is None else int(v)
