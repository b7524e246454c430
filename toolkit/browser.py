"""A real headless Chromium (Debian `chromium`) looking at what edgeprobe writes: reports, exported notebooks.

`dump_dom` returns the page's DOM after its scripts ran (so plotly charts have drawn their SVG layers);
`screenshot` writes a PNG. Both run Chromium with the flags this machine needs (no sandbox as root, no GPU,
no background networking on a closed network, a fresh profile) under a time limit — never a hang.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import EdgeprobeError

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


class BrowserError(EdgeprobeError, RuntimeError):
    """Chromium is missing, failed or timed out."""


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        raise BrowserError("Chromium is not installed: `apt-get install chromium` (make test installs it)")
    return exe


def _run(args: list, timeout_s: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="edgeprobe-chromium-") as prof:
        try:
            r = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={prof}", *args], capture_output=True, text=True,
                               timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BrowserError(f"Chromium did not finish within {timeout_s:.0f} s") from None
    if r.returncode != 0:
        raise BrowserError(f"Chromium exited with {r.returncode}: {r.stderr[-800:]}")
    return r


def _url(page) -> str:
    s = str(page)
    return s if s.startswith(("http://", "https://", "file://")) else Path(s).resolve().as_uri()


def dump_dom(page, wait_ms: int = 15000, timeout_s: float = 120) -> str:
    """The DOM of `page` (a file or URL) after its scripts ran for up to `wait_ms` of virtual time."""
    return _run([f"--virtual-time-budget={wait_ms}", "--dump-dom", _url(page)], timeout_s).stdout


def screenshot(page, png, size=(1400, 900), wait_ms: int = 15000, timeout_s: float = 120) -> Path:
    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    _run([f"--virtual-time-budget={wait_ms}", f"--screenshot={png}", f"--window-size={size[0]},{size[1]}",
          "--hide-scrollbars", _url(page)], timeout_s)
    if not png.exists() or png.stat().st_size == 0:
        raise BrowserError(f"Chromium wrote no screenshot to {png}")
    return png
