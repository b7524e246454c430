"""What a newcomer's first commands touch: the Makefile's setup stamps and what git ignores."""
import shutil
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_make_lab_after_make_test_does_not_set_up_again(tmp_path):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    name = lambda spec: spec.split(">")[0].split("=")[0].split("<")[0].strip()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    # the stamp is honest only while the test extra (with the core deps) installs everything the notebook extra does
    assert {name(d) for d in extras["notebook"]} <= {name(d) for d in extras["test"] + deps}
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text('echo "setup $1" >> setup.log\n')  # records each setup it runs
    (tmp_path / ".venv").mkdir()
    make = lambda *a: subprocess.run(["make", "--no-print-directory", *a], cwd=tmp_path, capture_output=True, text=True)
    assert make("setup-test").returncode == 0
    assert make("-q", "setup-notebook").returncode == 0, "make lab would run the notebook setup again"
    assert make("-q", "setup").returncode == 0
    assert (tmp_path / "setup.log").read_text().splitlines() == ["setup test"]


def test_jupyter_checkpoints_are_ignored():
    r = subprocess.run(["git", "check-ignore", "-q", "notebooks/.ipynb_checkpoints/01_outliers-checkpoint.ipynb"],
                       cwd=ROOT)
    assert r.returncode == 0
