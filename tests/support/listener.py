"""A TCP port on loopback that counts the connections made to it (`listener`): what
shows that a refused endpoint was never connected to; or (`hold`) keeps them open and
never answers: a store that never answers."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest


class Listener:
    """A TCP port on 127.0.0.1 that counts the connections made to it, and closes each
    at once or (`hold`) keeps it open, unanswered, until `close`."""

    def __init__(self, *, hold: bool = False) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.socket.settimeout(0.1)
        self.port = self.socket.getsockname()[1]
        self.accepts = 0
        self.hold = hold
        self._held: list[socket.socket] = []
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
            if self.hold:
                self._held.append(connection)
            else:
                connection.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for connection in self._held:
            connection.close()
        self.socket.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    served = Listener()
    try:
        yield served
    finally:
        served.close()
