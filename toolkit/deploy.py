"""Deploy the device agent over SSH (a phone's Termux sshd, a dev board) and tunnel its port.

paramiko connects with the device's host key checked against known_hosts or an explicit SHA256
fingerprint — an unknown key is refused, never accepted silently. The agent and kernel packages are
copied over SFTP (only files whose sha256 changed, with a progress bar), the agent is started
detached (setsid + nohup, `;` before the background command so the channel does not hang), bound to
the device's loopback, and a local port is forwarded to it through the SSH connection: ZeroMQ
then runs over the tunnel. Only the device's code goes over (`edgeprobe_agent` and `edgeprobe_kernels`, their .py
and .cl files), never the host toolkit; the device needs only Python with numpy, pyzmq and msgpack.
"""
from __future__ import annotations

import base64
import hashlib
import json
import posixpath
import select
import shlex
import socket
import threading
import time
from pathlib import Path

from .errors import DeployError, NotSSHServerError, SSHTimeoutError
from .probe import first_bytes

__all__ = ["DeployError", "NotSSHServerError", "SSHTimeoutError", "deploy_ssh", "start_local_sshd", "Tunnel",
           "fingerprint", "probe_ssh"]

BANNER_TIMEOUT_S = 5.0  # an sshd sends its banner at once; a phone's over Wi-Fi within a second

PACKAGES = {"edgeprobe_agent": Path(__file__).resolve().parent.parent / "device_agent",
            "edgeprobe_kernels": Path(__file__).resolve().parent.parent / "kernels"}


def fingerprint(key) -> str:
    """OpenSSH-style "SHA256:..." fingerprint of a paramiko public key."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


def probe_ssh(host: str, port: int, timeout_s: float = BANNER_TIMEOUT_S) -> str:
    """The server's SSH banner ("SSH-2.0-OpenSSH_9.2p1"), read before paramiko connects so that a wrong port fails in
    one line: OSError's kinds as DeployError, NotSSHServerError when it answers something else (an HTTP server
    answers our identification line with a 400), SSHTimeoutError when it sends nothing within timeout_s."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except socket.timeout:
        raise DeployError(f"cannot reach {host}:{port}: no answer to a TCP connect within {timeout_s:g} s (a wrong "
                          "host, or a firewall)") from None
    except OSError as e:
        raise DeployError(f"cannot reach {host}:{port} ({e.strerror or e}); is sshd running (Termux: `sshd`)?") \
            from None
    with sock:
        try:  # RFC 4253 §4.2: either side may send its identification first; ours makes a non-SSH server talk
            sock.sendall(b"SSH-2.0-edgeprobe_probe\r\n")
        except OSError:
            pass
        got, closed = first_bytes(sock, lambda got: b"SSH-" in got, 4096, timeout_s)
    for line in got.decode("latin-1").splitlines():
        if line.startswith("SSH-"):  # lines before it are a pre-banner message the RFC allows
            return line.strip()
    if got.strip():
        text = got.decode("latin-1")
        first = text.strip().splitlines()[0][:60]
        like = " like an HTTP server" if "HTTP/" in text or "<html" in text.lower() else ""
        raise NotSSHServerError(f"not an SSH server at {host}:{port}: it answered{like} ({first!r}); give the port "
                                "the device's sshd listens on (Termux: 8022)")
    if closed:
        raise NotSSHServerError(f"not an SSH server at {host}:{port}: it closed the connection without an SSH banner; "
                                "give the port the device's sshd listens on (Termux: 8022)")
    raise SSHTimeoutError(f"no SSH banner from {host}:{port} within {timeout_s:g} s: something accepts connections "
                          "there but does not answer as an sshd (a hung sshd, or another service)")


def _client(host, user, key_path, port, known_hosts, host_fingerprint):
    import paramiko

    key = Path(key_path).expanduser()
    if not key.is_file():  # before any connection: a typo'd key path is the user's to fix, not the network's
        raise DeployError(f"the SSH key {key_path} {'is a folder' if key.is_dir() else 'does not exist'}; give the "
                          "private key the device accepts (--ssh-key PATH, e.g. ~/.ssh/id_ed25519)")
    probe_ssh(host, port)

    c = paramiko.SSHClient()
    if host_fingerprint:
        class _Pinned(paramiko.MissingHostKeyPolicy):
            def missing_host_key(self, client, hostname, key):
                if fingerprint(key) != host_fingerprint:
                    raise DeployError(f"{hostname} presented host key {fingerprint(key)}, not the expected "
                                      f"{host_fingerprint}; refusing to connect")
        c.set_missing_host_key_policy(_Pinned())
    else:
        c.set_missing_host_key_policy(paramiko.RejectPolicy())
        kh = Path(known_hosts).expanduser() if known_hosts else Path("~/.ssh/known_hosts").expanduser()
        if kh.exists():
            c.load_host_keys(str(kh))
    try:
        c.connect(host, port=port, username=user, key_filename=str(key_path), look_for_keys=False,
                  allow_agent=False, timeout=15, banner_timeout=BANNER_TIMEOUT_S)
    except paramiko.SSHException as e:
        if "not found in known_hosts" in str(e) or "Server" in str(e) and "not found" in str(e):
            raise DeployError(f"{host}:{port} is not in known_hosts ({e}); add its key (ssh-keyscan -p {port} {host}) "
                              "after checking it, or pass host_fingerprint='SHA256:...'") from e
        raise DeployError(f"ssh to {user}@{host}:{port} failed: {e}") from e
    except OSError as e:
        raise DeployError(f"cannot reach {host}:{port} ({e}); is sshd running (Termux: `sshd`)?") from e
    return c


def _run(c, cmd: str, timeout: float = 60) -> str:
    _, out, err = c.exec_command(cmd, timeout=timeout)
    status = out.channel.recv_exit_status()
    text = out.read().decode(errors="replace")
    if status != 0:
        raise DeployError(f"remote command failed ({status}): {cmd}\n{err.read().decode(errors='replace')[-500:]}")
    return text


def device_files() -> dict:
    """{"pkg/sub/name.py": (local path, sha256)}: every .py and .cl file of the device's packages, subpackages
    (edgeprobe_agent.ops, .store, ...) included."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for p in sorted(folder.rglob("*")):
            if p.suffix in (".py", ".cl") and p.is_file() and "__pycache__" not in p.parts:
                out[f"{pkg}/{p.relative_to(folder).as_posix()}"] = (p, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def sync_packages(c, remote_dir: str, progress: bool = True) -> int:
    """Copy the agent and kernel packages to remote_dir over SFTP, only files whose sha256 changed.
    Returns the bytes sent."""
    from tqdm.auto import tqdm

    sftp = c.open_sftp()
    manifest_path = f"{remote_dir}/.edgeprobe-files.json"
    try:
        with sftp.open(manifest_path) as f:
            remote = json.loads(f.read())
    except (IOError, ValueError):
        remote = {}
    local = device_files()
    todo = [(rel, p) for rel, (p, h) in local.items() if remote.get(rel) != h]
    # parents sort before their children, so each folder is made after the one holding it
    folders = {remote_dir} | {f"{remote_dir}/{posixpath.dirname(rel)}" for rel in local}
    for d in sorted(folders):
        try:
            sftp.stat(d)
        except IOError:
            sftp.mkdir(d)
    for rel in sorted(set(remote) - set(local)):  # a module that moved (ops.py -> ops/) must not shadow its new home
        try:
            sftp.remove(f"{remote_dir}/{rel}")
        except IOError:
            pass
    total = sum(p.stat().st_size for _, p in todo)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="deploy", disable=not progress or not todo, leave=False)
    for rel, p in todo:
        sftp.put(str(p), f"{remote_dir}/{rel}")
        bar.update(p.stat().st_size)
    bar.close()
    with sftp.open(manifest_path, "w") as f:
        f.write(json.dumps({rel: h for rel, (_, h) in local.items()}))
    sftp.close()
    return total


class Tunnel:
    """A local TCP port forwarded to the device's loopback port through the SSH transport."""

    def __init__(self, client, remote_dir: str, agent_port: int):
        self.client, self.remote_dir, self.agent_port = client, remote_dir, agent_port
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(4)
        self.local_url = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self._stop = False
        threading.Thread(target=self._accept, daemon=True, name="ssh-tunnel").start()

    def _accept(self):
        while not self._stop:
            try:
                r, _, _ = select.select([self.server], [], [], 0.2)
                if not r:
                    continue
                sock, addr = self.server.accept()
            except (OSError, ValueError):
                return  # the tunnel was closed

            try:
                chan = self.client.get_transport().open_channel("direct-tcpip", ("127.0.0.1", self.agent_port), addr)
            except Exception:
                sock.close()
                continue
            threading.Thread(target=self._pump, args=(sock, chan), daemon=True).start()

    def _pump(self, sock, chan):
        try:
            while not self._stop:
                r, _, _ = select.select([sock, chan], [], [], 0.2)
                if sock in r:
                    data = sock.recv(1 << 20)
                    if not data:
                        break
                    chan.sendall(data)
                if chan in r:
                    data = chan.recv(1 << 20)
                    if not data:
                        break
                    sock.sendall(data)
        except OSError:
            pass
        finally:
            chan.close()
            sock.close()

    def close(self, stop_agent: bool = True) -> None:
        self._stop = True
        if stop_agent:
            try:
                _run(self.client, f"cd {shlex.quote(self.remote_dir)}; kill $(cat agent.pid) 2>/dev/null; true", 15)
            except Exception:
                pass
        self.server.close()
        self.client.close()


def deploy_ssh(host: str, user: str, key_path, port: int = 22, python: str = "python3", known_hosts=None,
               host_fingerprint: str | None = None, remote_dir: str = "edgeprobe-agent", agent_port: int = 5555,
               progress: bool = True, start_timeout_s: float = 180.0) -> Tunnel:
    """Connect, sync the packages, (re)start the agent on the device's loopback, open the tunnel. start_timeout_s:
    a first start on a device compiles every numba kernel (its cache is empty), over a minute on a busy host."""
    c = _client(host, user, key_path, port, known_hosts, host_fingerprint)
    rd = remote_dir
    sync_packages(c, rd, progress)
    q = shlex.quote
    # a previous agent of ours on this port is stopped first; `;` (not &&) before the detached start
    start = (f"cd {q(rd)}; kill $(cat agent.pid 2>/dev/null) 2>/dev/null; sleep 0.2; "
             f"PYTHONPATH=. setsid nohup {q(python)} -m edgeprobe_agent --bind tcp://127.0.0.1:{agent_port} "
             f"--store store > agent.log 2>&1 < /dev/null & echo $! > agent.pid")
    _run(c, start, 30)
    deadline = time.monotonic() + start_timeout_s
    log = ""
    while time.monotonic() < deadline:
        log = _run(c, f"cat {q(rd)}/agent.log 2>/dev/null; true", 15)
        if "listening on" in log:
            return Tunnel(c, rd, agent_port)
        if "error" in log.lower() or "Traceback" in log:
            break
        time.sleep(0.3)
    try:  # an agent that is slow to start, not failed, must not stay behind holding the port and the store
        _run(c, f"cd {q(rd)}; kill $(cat agent.pid) 2>/dev/null; true", 15)
    except Exception:
        pass
    c.close()
    said = [l for l in log.splitlines() if l.startswith("edgeprobe-agent: error:")]
    if said:  # the agent named the problem itself (missing packages with their install command, a bad option)
        raise DeployError(f"the agent did not start on {host} ({python}): {said[-1][len('edgeprobe-agent: error: '):]}")
    raise DeployError(f"the agent did not start on {host}: {log[-800:] or 'no output'}; the device needs Python "
                      f"{python!r} with numpy, pyzmq and msgpack (numba optional; Termux: pkg install python "
                      "python-numpy libzmq; pip install pyzmq msgpack)")


def start_local_sshd(folder, sshd: str | None = None):
    """A private OpenSSH server on 127.0.0.1 with its own host and client keys — the stand-in for a
    phone's Termux sshd in tests and benchmarks (Debian openssh-server).

    Returns (process, info) with info = {port, key (client private key), known_hosts, dir}; stop it with
    process.terminate().
    """
    import shutil
    import subprocess

    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    sshd = sshd or shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(sshd).exists():
        raise DeployError("no sshd: install Debian openssh-server (make test does)")
    for name in ("host", "client"):
        if not (d / name).exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "client.pub").read_text())
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cfg = d / "sshd_config"
    cfg.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {d / 'host'}", f"PidFile {d / 'sshd.pid'}",
        f"AuthorizedKeysFile {d / 'authorized_keys'}", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes", "PermitRootLogin yes", "UsePAM no", "StrictModes no", "AllowTcpForwarding yes",
        "Subsystem sftp internal-sftp", ""]))
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory must exist
    subprocess.run([sshd, "-t", "-f", str(cfg)], check=True)
    proc = subprocess.Popen([sshd, "-D", "-f", str(cfg), "-E", str(d / "sshd.log")])
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    kind, key = (d / "host.pub").read_text().split()[:2]
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {kind} {key}\n")
    return proc, {"port": port, "key": d / "client", "known_hosts": d / "known_hosts", "dir": d}
