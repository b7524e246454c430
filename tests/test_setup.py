"""What a newcomer's first commands touch: the Makefile's setup stamps and what git ignores."""
import shutil
import subprocess
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_make_lab_after_make_test_does_not_set_up_again(tmp_path):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    name = lambda spec: spec.split(">")[0].split("=")[0].split("<")[0].strip()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    # the stamps are honest only while the test extra (with the core deps) installs everything the notebook and ray
    # extras do
    assert {name(d) for d in extras["notebook"]} <= {name(d) for d in extras["test"] + deps}
    assert {name(d) for d in extras["ray"]} <= {name(d) for d in extras["test"] + deps}
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text('echo "setup $1" >> setup.log\n')  # records each setup it runs
    (tmp_path / "scripts" / "arm64_python.sh").write_text("")  # a prerequisite of the stamps
    (tmp_path / ".venv").mkdir()
    make = lambda *a: subprocess.run(["make", "--no-print-directory", *a], cwd=tmp_path, capture_output=True, text=True)
    assert make("setup-test").returncode == 0
    assert make("-q", "setup-notebook").returncode == 0, "make lab would run the notebook setup again"
    assert make("-q", "setup-ray").returncode == 0, "make bench would run the ray setup again"
    assert make("-q", "setup").returncode == 0
    assert (tmp_path / "setup.log").read_text().splitlines() == ["setup test"]


def test_make_demo_builds_the_emulated_phone_that_device_arm64_needs(tmp_path):
    # `make -n`: what make would run, nothing run; the arm64 Python missing under an empty cache
    r = subprocess.run(["make", "-n", "--no-print-directory", "demo", f"EDGEPROBE_CACHE={tmp_path / 'cache'}"],
                       cwd=ROOT, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert f"bash scripts/arm64_python.sh {tmp_path / 'cache' / 'arm64'}" in r.stdout.splitlines()


def test_jupyter_checkpoints_are_ignored():
    r = subprocess.run(["git", "check-ignore", "-q", "notebooks/.ipynb_checkpoints/01_outliers-checkpoint.ipynb"],
                       cwd=ROOT)
    assert r.returncode == 0


def test_demo_summary_says_which_windows_each_perplexity_is_over():
    from edgeprobe.demo import summary_lines

    s = {"perplexity_heldout": 13.622, "perplexity_windows": 8, "perplexity_window": 512, "accuracy_windows": 4,
         "accuracy_window": 256, "outlier_channels_pct": 1.0, "channels_for_80pct_outliers_pct": 0.5,
         "ffn_inactive_fraction": 0.2, "accuracy": {"float": {"perplexity": 14.746, "delta_vs_float_pct": None},
                                                    "w8a8": {"perplexity": 20.0, "delta_vs_float_pct": 35.6}},
         "repeats": 2, "prompt_len": 1024, "chunk": 256, "in_order_ms": 1000, "predicted_in_order_ms": 900,
         "ooo_ms": 900, "predicted_ooo_ms": 700, "ooo_vs_in_order": 0.9, "busy_pct_ooo": {"npu": 90},
         "chunk_shared_memory_saving": 0.6, "report": "r", "trace": "t"}
    from edgeprobe.demo import summary_rows

    def rows(s):
        return dict(summary_rows(s))

    r = rows(s)
    # each perplexity row names the windows it is over, from the summary's own fields: other windows, other rows
    assert r["held-out perplexity (float, 8 × 512 tokens)"] == "13.622"
    assert r["perplexity float"].startswith("14.746 (4 × 256;") and r["perplexity w8a8"] == "20.000 (+35.60%)"
    r = rows({**s, "perplexity_windows": 3, "perplexity_window": 128, "accuracy_windows": 2, "accuracy_window": 64})
    assert r["held-out perplexity (float, 3 × 128 tokens)"] == "13.622"
    assert r["perplexity float"].startswith("14.746 (2 × 64;")
    assert rows(s)["  out-of-order / in-order"].startswith("0.90 ") and rows({**s, "ooo_vs_in_order": 1.07})[
        "  out-of-order / in-order"].startswith("1.07 ")
    w = max(len(a) for a, _ in summary_rows(s))
    assert summary_lines(s)[3:] == [f"{a:<{w}}  {b}" for a, b in summary_rows(s)]  # the table is these rows


def test_readme_links_only_documents_a_clone_has():
    import re

    text = (ROOT / "README.md").read_text()
    assert "../shared" not in text
    linked = set(re.findall(r"`(docs/[\w./-]+\.md)(?:#[\w-]+)?`", text))
    for path in linked:
        assert (ROOT / path).exists(), path
    docs = text + "".join((ROOT / p).read_text() for p in linked)
    for var in ("EDGEPROBE_AGENT_STORE", "EDGEPROBE_PREPARED_CACHE", "EDGEPROBE_NB_TOKENS", "EDGEPROBE_NB_PROMPT"):
        assert var in docs, var  # every variable a user may need is documented, in the README or a page it links
