"""One run across a farm of device agents: the same workflow, so the same plan, on several agents at once — local
ones, phones over SSH, the emulated arm64 one — with one thread and one client per device. Each device gives its
own trace; the farm lays them side by side: a comparison table (makespan, per-lane busy %, tok/s) and one Perfetto
file with a process per device, on the host's clock (every client aligns its agent's clock), so runs that overlapped
overlap there too.

    with Farm.open(["local", "arm64", "ssh://u0_a123@127.0.0.1:8022"], ssh_key="~/.ssh/id_ed25519") as farm:
        res = farm.run(lambda dev: dev.prefill(qm, tokens), tokens=len(tokens))
    print(res.format_table()); res.to_chrome_json("out/farm.json")

Agents that share this host's cores (two local ones here) slow each other when run at once; `concurrent=False`
runs them in turn for a fair comparison. A device that fails in the middle is reported in its row and the others
finish; one that cannot be opened stops `Farm.open` with every such device named.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .errors import EdgeprobeError, FarmError
from .trace import LANE_ORDER, Trace, write_chrome_json


@dataclass
class DeviceRun:
    """One device's part of a farm run: the workflow's value (a RunResult, a Decoded: anything with a .trace), the
    extra fields it returned beside it, the agent's hello, bytes uploaded, when the work started (Unix time) and its
    wall time, or its error."""

    device: str
    value: object = None
    extra: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    upload_bytes: int = 0
    started: float = 0.0
    wall_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def trace(self) -> Trace | None:
        return getattr(self.value, "trace", None)


@dataclass
class FarmResult:
    runs: list
    tokens: int | None = None  # tokens each device ran (for tok/s); None leaves tok/s out

    def __getitem__(self, device: str) -> DeviceRun:
        return next(r for r in self.runs if r.device == device)

    @property
    def traces(self) -> dict[str, Trace]:
        return {r.device: r.trace for r in self.runs if r.ok and r.trace is not None}

    def table(self) -> list[dict]:
        """A row per device: machine, kernels (numba, numpy), emulator, makespan_ms, tok_per_s (tokens / makespan),
        wall_s (the whole workflow: upload, plan, run), busy_pct per lane, upload_mb; error for a failed device."""
        rows = []
        for r in self.runs:
            row = {"device": r.device, "machine": r.info.get("machine"),
                   "kernels": ((r.info.get("backends") or {}).get("cpu") or {}).get("kernels"),
                   "emulator": r.info.get("emulator")}
            if not r.ok or r.trace is None:
                rows.append({**row, "error": r.error or f"the workflow returned {type(r.value).__name__}, no trace"})
                continue
            m = r.trace.metrics()
            ms = m["makespan_ms"]
            rows.append({**row, "makespan_ms": ms,
                         "tok_per_s": self.tokens / (ms / 1e3) if self.tokens and ms > 0 else None,
                         "wall_s": r.wall_s, "busy_pct": {k: v["busy_pct"] for k, v in m["lanes"].items()},
                         "upload_mb": r.upload_bytes / 1e6})
        return rows

    def format_table(self, rows: list[dict] | None = None) -> str:
        """The table as text, a lane column per lane any device used; rows may carry extra columns (e.g. a
        cosine against the host), shown after the fixed ones."""
        rows = self.table() if rows is None else rows
        lanes = [l for l in LANE_ORDER if any(l in row.get("busy_pct", {}) for row in rows)]
        fixed = {"device", "machine", "kernels", "emulator", "makespan_ms", "tok_per_s", "wall_s", "busy_pct",
                 "upload_mb", "error"}
        extra = [k for row in rows for k in row if k not in fixed]
        extra = list(dict.fromkeys(extra))
        head = ["device", "machine", "kernels", "makespan ms", "tok/s", "wall s"] + [f"{l} busy %" for l in lanes] + \
               ["upload MB"] + [k.replace("_", " ") for k in extra]
        body = []
        for row in rows:
            if "error" in row:
                first = (row["error"].strip().splitlines() or ["?"])[0]  # an agent's stderr tail stays in the JSON
                body.append([row["device"], row["machine"] or "?", row["kernels"] or "?", f"failed: {first}"])
                continue
            cells = [row["device"], (row["machine"] or "?") + (" (qemu)" if row.get("emulator") else ""),
                     row["kernels"] or "?", f"{row['makespan_ms']:.1f}",
                     "-" if row["tok_per_s"] is None else f"{row['tok_per_s']:.1f}", f"{row['wall_s']:.1f}"]
            cells += [f"{row['busy_pct'][l]:.0f}" if l in row["busy_pct"] else "-" for l in lanes]
            cells += [f"{row['upload_mb']:.1f}"] + [_cell(row.get(k)) for k in extra]
            body.append(cells)
        width = [max(len(r[i]) for r in [head] + body if len(r) == len(head)) for i in range(len(head))]
        lines = []
        for r in [head] + body:
            names = "  ".join(c.ljust(w) for c, w in zip(r[:3], width))  # device, machine, kernels: left-aligned
            rest = r[3] if len(r) != len(head) else "  ".join(c.rjust(w) for c, w in zip(r[3:], width[3:]))
            lines.append(f"{names}  {rest}")
        return "\n".join(lines)

    def to_chrome_json(self, path):
        """One Perfetto file: a process per device (named by it), a thread per lane, on the host's clock."""
        traces = self.traces
        if not traces:
            raise FarmError("no device of this farm run produced a trace")
        return write_chrome_json(path, traces)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.6f}" if abs(v) <= 1 else f"{v:.3g}"
    return "-" if v is None else str(v)


def device_names(specs) -> list[str]:
    """Unique names for device specs: a repeated spec gets #2, #3, ... ("local", "local#2")."""
    seen: dict[str, int] = {}
    out = []
    for s in specs:
        seen[s] = seen.get(s, 0) + 1
        out.append(s if seen[s] == 1 else f"{s}#{seen[s]}")
    return out


class Farm:
    """Connected devices by name, each driven by its own thread in `run` (a client is never shared by two
    threads at once). Close it (or use `with`) to close every device."""

    def __init__(self, devices: dict):
        if not devices:
            raise FarmError("a farm needs at least one device")
        self.devices = dict(devices)

    @classmethod
    def open(cls, specs, opener=None, **options) -> "Farm":
        """Open every device at once. specs: device specs (edgeprobe.device.open_device: local, arm64, tcp://...,
        ssh://USER@HOST[:PORT]) or {name: spec}; opener(spec) -> a client replaces open_device(spec, **options).
        If any fails, the others are closed and FarmError names each failure."""
        from .device import open_device

        named = dict(specs) if isinstance(specs, dict) else dict(zip(device_names(list(specs)), specs))
        opener = opener or (lambda spec: open_device(spec, **options))
        opened, failed, futures = {}, {}, {}
        try:
            with ThreadPoolExecutor(max_workers=len(named) or 1, thread_name_prefix="farm-open") as pool:
                futures = {name: pool.submit(opener, spec) for name, spec in named.items()}
                for name, fut in futures.items():
                    try:
                        opened[name] = fut.result()
                    except Exception as e:  # noqa: BLE001 - every device's reason is reported below
                        known = isinstance(e, (EdgeprobeError, ValueError))
                        failed[name] = str(e) if known else f"{type(e).__name__}: {e}"
        except BaseException:  # Ctrl-C: the pool has waited for every open; close what opened
            for fut in futures.values():
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    fut.result().close()
            raise
        if failed:
            for dev in opened.values():
                dev.close()
            raise FarmError("could not open " + "; ".join(f"{n} ({why})" for n, why in failed.items()))
        return cls(opened)

    def run(self, work, tokens: int | None = None, concurrent: bool = True) -> FarmResult:
        """work(dev) on every device — at once (a thread each) or, concurrent=False, in turn — and wait for all.
        work returns a RunResult (anything with .trace) or (it, extra dict). tokens: tokens each run processed,
        for tok/s. A device's exception becomes its row's error; the other devices finish. Ctrl-C waits for the
        runs in flight (a client is never closed under a thread that is using it)."""
        def one(name, dev) -> DeviceRun:
            before, t0 = getattr(dev, "uploaded_bytes", 0), time.time()
            try:
                value = work(dev)
            except Exception as e:  # noqa: BLE001 - reported in the device's row, the farm goes on
                return DeviceRun(name, info=dict(getattr(dev, "info", {}) or {}), started=t0, wall_s=time.time() - t0,
                                 error=str(e) if isinstance(e, EdgeprobeError) else f"{type(e).__name__}: {e}")
            value, extra = value if isinstance(value, tuple) else (value, {})
            return DeviceRun(name, value, extra, dict(dev.info), getattr(dev, "uploaded_bytes", 0) - before, t0,
                             time.time() - t0)

        if not concurrent:
            return FarmResult([one(n, d) for n, d in self.devices.items()], tokens)
        with ThreadPoolExecutor(max_workers=len(self.devices), thread_name_prefix="farm") as pool:
            futures = [pool.submit(one, n, d) for n, d in self.devices.items()]
            return FarmResult([f.result() for f in futures], tokens)

    def prefill(self, qm, tokens, concurrent: bool = True, **kw) -> FarmResult:
        """The same layer-by-layer prefill (workflows.prefill) on every device."""
        return self.run(lambda dev: dev.prefill(qm, tokens, progress=False, **kw), len(tokens), concurrent)

    def prefill_chunked(self, qm, tokens, chunk: int = 256, scheduler: str = "ooo", cost_model="this-host-emulated",
                        concurrent: bool = True, *, profile=None) -> FarmResult:
        """The same chunked prefill plan (one schedule over `cost_model`) on every device. profile: the old name of
        cost_model."""
        cost_model = cost_model if profile is None else profile
        return self.run(lambda dev: dev.prefill_chunked(qm, tokens, chunk=chunk, scheduler=scheduler,
                                                        cost_model=cost_model, progress=False), len(tokens), concurrent)

    def close(self) -> None:
        for dev in self.devices.values():
            dev.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
