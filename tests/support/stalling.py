"""A store on loopback that accepts every connection and never answers a byte: what a
hung or trickling object store looks like to a client before its first byte."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def stalling_endpoint() -> Iterator[str]:
    """An HTTP endpoint that accepts every connection and never answers a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)  # kept open, never read from or written to

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        done.set()
        server.close()
        for conn in held:
            conn.close()
