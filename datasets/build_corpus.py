"""Rebuild the bundled calibration/evaluation corpus from text that CPython itself ships.

Sources (all under the PSF License Agreement, which allows redistribution; recorded per document in
corpus/SOURCES.json with sha256 and character counts):
  * `pydoc_data.topics`: the Python Language Reference topics that `help()` shows (English prose).
  * docstrings of pure-Python standard-library modules, read with `ast` (nothing is imported).

Deterministic: documents are sorted by id and split by a hash of the id, so the same CPython
version always yields byte-identical files. Run: python datasets/build_corpus.py [--out DIR]
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import sysconfig
from pathlib import Path

HELDOUT_EVERY = 8  # about one document in eight goes to the held-out evaluation split
MIN_DOCSTRING = 200  # shorter docstrings are mostly signatures, not prose

# Standard-library modules rich in prose docstrings, in a fixed list so the corpus does not change
# when an unrelated module is added to CPython.
STDLIB_MODULES = [
    "argparse", "ast", "asyncio/events", "asyncio/tasks", "base64", "bdb", "bisect", "calendar", "cgi",
    "cmd", "codecs", "collections/__init__", "concurrent/futures/_base", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "doctest", "email/message",
    "enum", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "gzip", "heapq", "hmac", "html/parser", "http/client", "http/cookiejar", "http/server", "imaplib",
    "inspect", "ipaddress", "json/__init__", "json/decoder", "logging/__init__", "mailbox", "mimetypes",
    "multiprocessing/pool", "netrc", "numbers", "optparse", "os", "pathlib", "pdb", "pickle",
    "pkgutil", "platform", "plistlib", "poplib", "pprint", "pydoc", "queue", "random", "re/__init__",
    "reprlib", "sched", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "trace", "traceback", "typing", "unittest/case", "urllib/parse", "urllib/request",
    "uuid", "warnings", "weakref", "webbrowser", "xml/dom/minidom", "zipfile",
]


def topic_documents() -> dict[str, str]:
    from pydoc_data.topics import topics
    return {f"pydoc_topics/{k}": v.strip() + "\n" for k, v in sorted(topics.items())}


def docstring_documents(stdlib: Path) -> dict[str, str]:
    docs = {}
    for mod in STDLIB_MODULES:
        path = stdlib / f"{mod}.py"
        if not path.exists():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parts = []
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) >= MIN_DOCSTRING:
                    parts.append(doc.strip())
        # ast.walk visits the module twice (tree itself, then as its own first node): keep one
        seen, unique = set(), []
        for p in parts:
            if p not in seen:
                seen.add(p)
                unique.append(p)
        if unique:
            docs[f"stdlib_docstrings/{mod}"] = "\n\n".join(unique) + "\n"
    return docs


def is_heldout(doc_id: str) -> bool:
    return int(hashlib.sha256(doc_id.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def build(out: Path) -> dict:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = {**topic_documents(), **docstring_documents(stdlib)}
    splits: dict[str, list[str]] = {"train": [], "heldout": []}
    sources = []
    for doc_id in sorted(docs):
        text = docs[doc_id]
        split = "heldout" if is_heldout(doc_id) else "train"
        splits[split].append(text)
        sources.append({"id": doc_id, "split": split, "chars": len(text),
                        "sha256": hashlib.sha256(text.encode()).hexdigest()})
    out.mkdir(parents=True, exist_ok=True)
    for split, texts in splits.items():
        (out / f"{split}.txt").write_text("\n\n".join(texts), encoding="utf-8")
    manifest = {
        "built_with": f"CPython {platform.python_version()}",
        "license": "Python Software Foundation License Agreement (PSF-2.0); redistribution permitted",
        "sources": "pydoc_data.topics and docstrings of standard-library modules, read with ast",
        "heldout_rule": f"sha256(document id) % {HELDOUT_EVERY} == 0",
        "files": {s: {"chars": len((out / f"{s}.txt").read_text(encoding='utf-8')),
                      "sha256": hashlib.sha256((out / f"{s}.txt").read_bytes()).hexdigest(),
                      "documents": len(t)} for s, t in splits.items()},
        "documents": sources,
    }
    (out / "SOURCES.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "corpus")
    args = ap.parse_args()
    m = build(args.out)
    for split, info in m["files"].items():
        print(f"{split:8s} {info['documents']:4d} documents {info['chars']:9,d} chars  {args.out / (split + '.txt')}")


if __name__ == "__main__":
    main()
