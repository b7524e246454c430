"""JupyterLab starts headless on loopback and serves the notebooks (the tour a researcher opens first), each paired
with its jupytext source: what Lab opens holds the .py's cells, and saving in Lab rewrites the .py too."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jupytext

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_jupyterlab_serves_the_notebooks_on_loopback(tmp_path):
    served = tmp_path / "notebooks"  # a copy: the test saves a notebook through Lab
    shutil.copytree(NOTEBOOKS, served, ignore=shutil.ignore_patterns("out", ".ipynb_checkpoints", "__pycache__"))
    port, token = _free_port(), "edgeprobe-test-token"
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                             "--allow-root", f"--ServerApp.root_dir={served}", f"--IdentityProvider.token={token}",
                             "--ServerApp.port_retries=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"),
                                 "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
                                 "JUPYTER_DATA_DIR": str(tmp_path / "data")})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.stdout.read()[-2000:]
            assert time.monotonic() < deadline, "JupyterLab did not answer within 90 s"
            time.sleep(0.5)
        names = sorted(p.name for p in served.glob("*.ipynb"))
        assert len(names) >= 7
        with urllib.request.urlopen(f"{base}/api/contents?token={token}", timeout=10) as r:
            listed = {c["name"] for c in json.load(r)["content"]}
        assert set(names) <= listed
        for name in names:
            with urllib.request.urlopen(f"{base}/lab/tree/{name}?token={token}", timeout=10) as r:
                assert r.status == 200 and "JupyterLab" in r.read().decode()
            with urllib.request.urlopen(f"{base}/api/contents/{name}?token={token}", timeout=10) as r:
                doc = json.load(r)
            assert doc["type"] == "notebook" and doc["content"]["cells"][0]["source"].startswith("# ")
            source = jupytext.read(served / name.replace(".ipynb", ".py"))
            assert [c["source"] for c in doc["content"]["cells"]] == [c.source for c in source.cells], name
        # an edit saved in Lab reaches the paired source (notebooks/jupytext.toml pairs ipynb with py:percent)
        doc["content"]["cells"].append({"cell_type": "markdown", "metadata": {}, "source": "Saved from Lab."})
        put = urllib.request.Request(f"{base}/api/contents/{name}", method="PUT",
                                     data=json.dumps({"type": "notebook", "format": "json",
                                                      "content": doc["content"]}).encode(),
                                     headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(put, timeout=30) as r:
            assert r.status == 200
        source = jupytext.read(served / name.replace(".ipynb", ".py"))
        assert source.cells[-1].cell_type == "markdown" and source.cells[-1].source == "Saved from Lab."
        try:  # and nothing answers without the token
            urllib.request.urlopen(f"{base}/api/contents", timeout=10)
            raise AssertionError("the notebook server answered without its token")
        except urllib.error.HTTPError as e:
            assert e.code in (401, 403)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
