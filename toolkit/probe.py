"""What answers at an address, before a protocol's own client gets there: the first bytes a server sends on connect
(a ZeroMQ greeting, an SSH identification, an HTTP page), so a wrong address gets a sentence, not a library's
traceback or a long wait."""
from __future__ import annotations

import socket
import time


def first_bytes(sock: socket.socket, enough, limit: int, timeout_s: float) -> tuple[bytes, bool]:
    """Read from a connected `sock` until enough(got) holds, `limit` bytes came, or `timeout_s` passed.
    -> (the bytes read, whether the peer closed or reset the connection)."""
    got, deadline = b"", time.monotonic() + timeout_s
    while not enough(got) and len(got) < limit and time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            part = sock.recv(limit)
        except socket.timeout:
            return got, False
        except OSError:
            return got, True
        if not part:
            return got, True
        got += part
    return got, False
