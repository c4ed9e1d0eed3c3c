"""A TCP port on loopback that counts the connections made to it (`listener`): what
shows that a refused endpoint was never connected to."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest


class Listener:
    """A TCP port on 127.0.0.1 that counts the connections made to it."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.socket.settimeout(0.1)
        self.port = self.socket.getsockname()[1]
        self.accepts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self.socket.accept()
            except TimeoutError:
                continue
            self.accepts += 1
            connection.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    served = Listener()
    try:
        yield served
    finally:
        served.close()
