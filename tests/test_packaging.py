"""Every source folder is a listed package: a folder missing from pyproject's `packages` is left out of a built
wheel (an editable install still finds it, so no other test would notice) and setuptools warns at every setup."""
import pathlib

import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_folder_with_sources_is_a_listed_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for name, folder in cfg["package-dir"].items():
        for d in [ROOT / folder, *(p for p in (ROOT / folder).rglob("*") if p.is_dir())]:
            if "__pycache__" in d.parts or not any(d.glob("*.py")) and not any(d.glob("*.c")):
                continue
            found.add(".".join([name, *d.relative_to(ROOT / folder).parts]))
    assert found == listed, f"folders not listed: {sorted(found - listed)}; listed, no folder: {sorted(listed - found)}"
