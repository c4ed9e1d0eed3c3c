"""The operator's end of the resolves' fork server (`resolve_forkserver`): `Forkserver`
starts the server when first needed, and again after it ended, and forks children from
it; `Forked` is one child, as much of `subprocess.Popen` as `resolve_children` uses.
The protocol is in `resolve_forkserver`'s docstring.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from typing import IO

from shardcache_operator import resolve_forkserver

#: Seconds to wait for a server, or a child a dead server left the operator, to end
#: once killed or told to.
END_SECONDS = 10.0
#: The longest status line read: `error <message>` is the longest.
_LINE_BYTES = 256


class ServerEnded(RuntimeError):
    """The fork server ended while one of its children ran, or before answering."""


class Forked:
    """One child of the fork server, as much of `subprocess.Popen` as a resolve uses:
    `pid`, `stdin`, `stdout`, `stderr`, `kill` and `wait`. Used by one thread."""

    def __init__(
        self,
        pid: int,
        status: socket.socket,
        stdin: IO[bytes],
        stdout: IO[bytes],
        stderr: IO[bytes],
    ) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.returncode: int | None = None
        self._status = status

    def kill(self) -> None:
        """Have the server kill the child (nothing once it was reaped)."""
        with contextlib.suppress(OSError):
            self._status.send(b"k")

    def wait(self, timeout: float | None = None) -> int:
        """The child's exit code once the server reaped it; `subprocess.TimeoutExpired`
        after `timeout`; `ServerEnded` where the server ended first (its children die
        with it: PR_SET_PDEATHSIG)."""
        if self.returncode is not None:
            return self.returncode
        if self._status.fileno() == -1:
            raise ServerEnded("the resolves' fork server ended while a resolve ran")
        try:
            line = _line(self._status, timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired("resolve child", timeout or 0.0) from None
        self._status.close()
        if not line.startswith("exit "):
            self._reap_orphan()
            raise ServerEnded(
                "the resolves' fork server ended while a resolve ran "
                f"(expected its child's exit status, found {line!r:.80})"
            )
        self.returncode = int(line.split()[1])
        return self.returncode

    def _reap_orphan(self) -> None:
        """Where the operator is its container's init (pid 1: the chart's pod), reap
        the child, which the server's end left to it (killed by PR_SET_PDEATHSIG): no
        one else would, and it would stay a zombie until the operator restarts. Its pid
        cannot have been taken again while it is a zombie. Anywhere else its new
        parent reaps it."""
        if os.getpid() != 1:
            return
        deadline = time.monotonic() + END_SECONDS
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                if not os.path.exists(f"/proc/{self.pid}"):
                    return  # the server reaped it before it ended
                pid = 0  # not handed to the operator yet
            if pid == self.pid:
                return
            time.sleep(0.01)

    def close(self) -> None:
        """Let go of the child's pipes and status socket: the server kills it if it
        still runs."""
        for pipe in (self.stdin, self.stdout, self.stderr):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()
        self._status.close()


class Forkserver:
    """The operator's end: starts the server when first needed (and again after it
    ended), and forks children from it. Called from any thread."""

    def __init__(
        self, *, memory: int, idle_seconds: float = resolve_forkserver.IDLE_SECONDS
    ) -> None:
        self.memory = memory
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._last_code: int | None = None
        self._closed = False

    def pid(self) -> int | None:
        """The server's pid while it runs."""
        with self._lock:
            process = self._process
            return process.pid if process is not None and process.poll() is None else None

    def exit_code(self) -> int | None:
        """How the server last ended (as `subprocess.Popen.returncode`), waiting a
        second for one whose end its children saw first; None where it runs, or was
        killed here for not answering."""
        with self._lock:
            if self._process is None:
                return self._last_code
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(1.0)
            return self._process.returncode

    def fork(self, timeout: float) -> Forked:
        """A new child, its stdin waiting for a `resolve_child` request. A server that
        ended (idle, or killed) is replaced once; `ServerEnded` if the new one fails
        too, TimeoutError if no pid comes within `timeout`."""
        deadline = time.monotonic() + timeout
        for attempt in (1, 2):
            try:
                return self._fork(deadline)
            except ServerEnded:
                if attempt == 2 or self._closed:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """End the server (it kills and reaps its children first) and start no other."""
        with self._lock:
            self._closed = True
            control, process = self._control, self._process
            self._control = self._process = None
        if control is not None:
            control.close()
        if process is not None:
            try:
                process.wait(END_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __del__(self) -> None:
        # A resolver dropped without `close` (tools, tests): its server ends with it.
        with contextlib.suppress(Exception):
            self.close()

    def _fork(self, deadline: float) -> Forked:
        ours: list[int] = []
        theirs: list[int] = []
        status: socket.socket | None = None
        try:
            stdin_r, stdin_w = os.pipe()
            stdout_r, stdout_w = os.pipe()
            stderr_r, stderr_w = os.pipe()
            ours += [stdin_w, stdout_r, stderr_r]
            theirs += [stdin_r, stdout_w, stderr_w]
            status, child_status = socket.socketpair()
            theirs.append(child_status.detach())
            with self._lock:
                control = self._started()
                server = self._process
                try:
                    socket.send_fds(control, [b"f"], theirs)
                except OSError:
                    # It ended (idle, killed) since we last looked: a new one.
                    self._ended(server)
                    raise ServerEnded("the resolves' fork server ended") from None
            for fd in theirs:
                os.close(fd)
            theirs.clear()
            line = _line(status, max(0.0, deadline - time.monotonic()))
            if line.startswith("error "):
                raise OSError(f"the resolves' fork server could not fork: {line[6:]}")
            if not line.startswith("pid "):
                with self._lock:
                    self._ended(server)
                raise ServerEnded(
                    f"the resolves' fork server ended before forking (found {line!r:.80})"
                )
            forked = Forked(
                int(line.split()[1]),
                status,
                os.fdopen(stdin_w, "wb"),
                os.fdopen(stdout_r, "rb"),
                os.fdopen(stderr_r, "rb"),
            )
            ours.clear()
            return forked
        except BaseException:
            for fd in ours + theirs:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if status is not None:
                status.close()
            raise

    def _started(self) -> socket.socket:
        """The control socket of a running server, started now if none runs. Under
        the lock."""
        if self._closed:
            raise ServerEnded("the resolves' fork server was closed: the operator is stopping")
        if self._process is not None and self._process.poll() is not None:
            self._ended(self._process)
        if self._control is not None:
            return self._control
        # Datagrams in order: one request a message, its descriptors with it.
        control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    resolve_forkserver.__name__,
                    str(theirs.fileno()),
                    str(self.memory),
                    repr(self.idle_seconds),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env={**os.environ, **resolve_forkserver.ENV},
                pass_fds=(theirs.fileno(),),
            )
        # It ends by itself when idle, with no resolve to notice: reaped the moment
        # it ends instead of staying a zombie until the next fork or the operator's end.
        threading.Thread(
            target=self._process.wait, name="resolve-forkserver-reaper", daemon=True
        ).start()
        self._control = control
        return control

    def _ended(self, server: subprocess.Popen[bytes] | None) -> None:
        """Forget `server` if it is still the current one: it ended, or it failed to
        answer a fork (killed then); reap it. Under the lock."""
        if server is not self._process:
            return  # another thread replaced it already
        if self._control is not None:
            self._control.close()
        if self._process is not None:
            self._last_code = self._process.poll()
            if self._last_code is None:
                self._process.kill()
                self._process.wait()
        self._control = self._process = None


def _line(sock: socket.socket, timeout: float | None) -> str:
    """One `\\n`-ended line from `sock`, read byte by byte (the status socket carries
    two lines in all, and the second may not be read yet); "" at its end. TimeoutError
    after `timeout`."""
    # 0 would make the socket non-blocking: BlockingIOError, not TimeoutError.
    sock.settimeout(None if timeout is None else max(timeout, 1e-3))
    data = bytearray()
    while not data.endswith(b"\n") and len(data) < _LINE_BYTES:
        try:
            byte = sock.recv(1)
        except (ConnectionResetError, BrokenPipeError):
            byte = b""
        if not byte:
            return ""
        data += byte
    return data.decode("ascii", "replace").strip()


# The server's side. Only the standard library and `resolve_child` (which imports
# nothing else at its top) before the limits are in place, as in a resolve child.
