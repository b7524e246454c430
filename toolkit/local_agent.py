"""The local agent launcher: `python -m edgeprobe_agent` started on a free loopback port, on this machine or in the
emulated arm64 Python (arm64.py), with a blob store (its flash) no other agent holds. `Client.local()` (client.py)
connects to what `start` launched; nothing here speaks the protocol.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from edgeprobe_agent.protocol import HEARTBEAT_TIMEOUT_S
from edgeprobe_kernels.paths import cache_root

from .errors import DeviceError

EMULATED_TIMEOUT_S = 60.0  # HEARTBEAT_TIMEOUT_S for an agent under qemu-aarch64 (Client.local(arch="arm64"))

# how long a starting agent may take to print its address: Python's imports under qemu-user take ~30 s on a busy host
START_TIMEOUT_S = 60.0
EMULATED_START_TIMEOUT_S = 180.0

STDERR_TAIL_BYTES = 64 << 10  # what a local agent's stderr keeps for error messages


class StderrTail:
    """A child's stderr drained on a thread into its last `limit` bytes: a chatty agent never blocks on a full
    pipe, and its last words can be quoted when it dies."""

    def __init__(self, stream, limit: int = STDERR_TAIL_BYTES):
        self.limit = limit
        self.seen = 0  # bytes drained in all
        self._buf = bytearray()
        self._lock = threading.Lock()  # the drain thread appends, any caller reads
        self._thread = threading.Thread(target=self._drain, args=(stream,), daemon=True, name="agent-stderr")
        self._thread.start()

    def _drain(self, stream) -> None:
        fd = stream.fileno()
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            with self._lock:
                self.seen += len(chunk)
                self._buf += chunk
                if len(self._buf) > self.limit:
                    del self._buf[:len(self._buf) - self.limit]
        stream.close()  # this thread is its only reader: closed at the end, not left to the garbage collector

    def text(self, wait_s: float = 0.0) -> str:
        """The tail so far; wait_s: first wait that long for the stream's end (after the process exited)."""
        if wait_s:
            self._thread.join(wait_s)
        with self._lock:
            return bytes(self._buf).decode("utf-8", "replace")


def exit_note(returncode: int) -> str:
    """'exited with status 3', or '... -9 (killed by SIGKILL)' (a negative Popen returncode is the signal)."""
    if returncode is not None and returncode < 0:
        try:
            return f"exited with status {returncode} (killed by {signal.Signals(-returncode).name})"
        except ValueError:
            return f"exited with status {returncode} (killed by signal {-returncode})"
    return f"exited with status {returncode}"


def stderr_note(tail: str, lines: int = 3) -> str:
    """A process's last stderr lines on one line ('its stderr ends: a | b'), or 'it wrote nothing on stderr'."""
    last = [line.strip() for line in tail.splitlines() if line.strip()][-lines:]
    return f"its stderr ends: {' | '.join(last)}" if last else "it wrote nothing on stderr"


@dataclass
class LocalAgent:
    """A started agent process: where it listens, its stderr tail, its store, and how long a client waits for it."""

    url: str
    process: subprocess.Popen
    stderr: StderrTail
    store: Path
    agent_path: Path | None  # the folder an emulated agent imports its packages from (removed when it stops)
    timeout_s: float
    options: dict  # how start() was called, so a closed client can start it again

    def kill(self) -> None:
        """Stop it at once and remove what it was given (a client that failed to connect holds nothing of it)."""
        self.process.kill()
        self.process.wait(timeout=5)
        if self.agent_path is not None:
            shutil.rmtree(self.agent_path, ignore_errors=True)


def start(store: str | Path | None = None, memory_budget_mb: float | None = None,
          startup_timeout_s: float | None = None, lanes=None, npu_backend: str | None = None, say=None,
          arch: str | None = None) -> LocalAgent:
    """Start `python -m edgeprobe_agent` on a free loopback port and wait for its address. The arguments are
    Client.local's (see there): store given is used as is; left out, the default store or its first free sibling.
    startup_timeout_s None: START_TIMEOUT_S, or EMULATED_START_TIMEOUT_S under qemu-aarch64."""
    from . import arm64

    options = {"store": store, "memory_budget_mb": memory_budget_mb, "startup_timeout_s": startup_timeout_s,
               "lanes": lanes, "npu_backend": npu_backend, "arch": arch}
    argv, agent_path = arm64.interpreter(arch)
    if startup_timeout_s is None:
        startup_timeout_s = START_TIMEOUT_S if agent_path is None else EMULATED_START_TIMEOUT_S
    default = "agent-store" + ("" if agent_path is None else "-arm64")
    base = Path(store or os.environ.get("EDGEPROBE_AGENT_STORE") or cache_root() / default)
    env = None
    if agent_path is not None:  # the emulated device sees only its own packages and the agent's
        env = {**os.environ, "PYTHONPATH": str(agent_path)}
    try:
        # concurrent hosts pick and lock a default store one at a time, so two never start on the same sibling
        with (_PickLock(base) if store is None else _NoLock()):
            chosen = base if store is not None else free_store(base)
            if chosen != base:
                (say or (lambda m: print(m, file=sys.stderr)))(
                    f"edgeprobe: the agent store {base} is in use by another agent; this run's agent uses {chosen} "
                    "(uploads there once; pass --store / store= to choose)")
            cmd = argv + ["-m", "edgeprobe_agent", "--bind", "tcp://127.0.0.1:*", "--store", str(chosen),
                          "--parent-pid", str(os.getpid())]  # a killed host must not leave its agent holding the store
            if memory_budget_mb is not None:
                cmd += ["--memory-budget", str(memory_budget_mb)]
            if lanes is not None:
                cmd += ["--lanes", ",".join(lanes)]
            if npu_backend is not None:
                cmd += ["--npu-backend", npu_backend]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            tail = StderrTail(proc.stderr)
            url = read_listen_line(proc, startup_timeout_s, tail)
    except BaseException:
        if agent_path is not None:
            shutil.rmtree(agent_path, ignore_errors=True)
        raise
    # qemu-user runs the agent 20-50x slower, more on a loaded host: its replies wait longer
    timeout_s = HEARTBEAT_TIMEOUT_S if agent_path is None else EMULATED_TIMEOUT_S
    return LocalAgent(url, proc, tail, chosen, agent_path, timeout_s, options)


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _PickLock:
    """An exclusive flock beside the default store, held while a host picks a store and its agent locks it."""

    def __init__(self, base: Path):
        base.parent.mkdir(parents=True, exist_ok=True)
        self.path = base.parent / f".{base.name}.pick.lock"

    def __enter__(self):
        import fcntl

        self.f = open(self.path, "a+")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.f.close()  # closing the file releases the lock
        return False


def store_held(root: Path) -> bool:
    """Whether an agent holds root/.lock (the store's lock; device_agent.store._lock_store)."""
    import fcntl

    if not (root / ".lock").exists():
        return False
    with open(root / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def free_store(base: Path, tries: int = 32) -> Path:
    """base, or its first sibling base-2, base-3, ... that no agent holds."""
    for i in range(1, tries + 1):
        cand = base if i == 1 else base.with_name(f"{base.name}-{i}")
        if not store_held(cand):
            return cand
    raise DeviceError("store_busy", f"{tries} agent stores beside {base} are all in use; stop an agent or pass a "
                                    "store of its own (--store DIR, Device.local(store=...))")


def read_listen_line(proc: subprocess.Popen, timeout_s: float, tail: StderrTail) -> str:
    """The address the agent prints ("listening on URL") once it is ready; DeviceError if it exits or stays silent."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            line = proc.stdout.readline().decode("utf-8", "replace")
            if "listening on " in line:
                return line.strip().split("listening on ", 1)[1]
        if proc.poll() is not None:
            raise DeviceError("agent_start", f"the local agent {exit_note(proc.returncode)} at start; "
                                             f"{stderr_note(tail.text(wait_s=2.0))}")
    proc.kill()
    proc.wait(timeout=5)
    raise DeviceError("agent_start", f"the local agent did not report its address within {timeout_s:.0f} s; "
                                     f"{stderr_note(tail.text(wait_s=2.0))}")
