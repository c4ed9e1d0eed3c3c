"""A warm process that the operator's resolve children are forked from, both its ends:
`Forkserver` in the operator, `main` in the process (`python -m
shardcache_operator.resolve_forkserver`).

A resolve child started as a fresh interpreter paid the interpreter and pyarrow's
import at every resolve: about 0.25 s of CPU on the 2-core machine, 13 times the
operator's own share of a new mount, paid again at each retry (docs/benchmarks.md, "The
operator's child processes, counted"). This process pays it once: it takes a resolve
child's limits (`resolve_child.limit`: data limit, 1 MiB thread stacks, first for the
OOM killer), imports what a resolve reads with, and then only forks, one child per
resolve, which runs `resolve_child.main` as a fresh interpreter would. A child is still
a process of its own, with its own limit (the pages it shares with this process count
once in the cgroup, and against its data limit as they did in a fresh child after its
import), killed at its resolve's timeout, and gone with what a resolve left behind (a
heap grown by a large listing, pyarrow's threads blocked on a store). Forking the
operator itself would not be safe: it has threads and an event loop. This process has
one thread: pyarrow's jemalloc, which a resolve does not use (`resolve_child.ENV`), is
told to start no background thread (`ENV`).

The protocol, over a Unix socket pair whose other end only the operator holds: for each
resolve the operator sends one byte and four descriptors, the child's stdin, stdout and
stderr and one end of a new socket pair, the child's *status*. The server forks; the
child takes the three as its own and closes every other descriptor; the server writes
`pid <pid>\\n` on the status socket, and `exit <code>\\n` once it has reaped the child
(`code` as `subprocess.Popen.returncode`: negative for a signal). A byte on the status
socket from the operator, or its end closed, kills the child: the server is its parent,
so the pid cannot have been reused. The server ends when the operator's end closes (the
operator gone: its children killed and reaped first) and after `IDLE_SECONDS` with no
child and no request; a request caught by that end finds the status socket closed
before any pid and is sent again to a new server (`Forkserver.fork`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import IO

from shardcache_operator import resolve_child

#: Seconds the server is kept with no child and no request: the resolves of a burst of
#: new mounts, and their retries, come closer together; an idle server holds about
#: 85 MiB (the interpreter and pyarrow, as a read worker).
IDLE_SECONDS = 30.0
#: The environment the server (and so each child) runs in: a resolve child's, and no
#: jemalloc background thread, the one thread pyarrow's import starts (a fork copies
#: only the thread that forks).
ENV = {**resolve_child.ENV, "JE_ARROW_MALLOC_CONF": "background_thread:false"}
#: Seconds a fork may take to be answered with its pid once the server reads requests:
#: it forks and answers at once; beyond this it is taken as hung.
FORK_SECONDS = 10.0
#: Descriptors one request hands over: the child's stdin, stdout, stderr and status.
_FDS = 4
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
        deadline = time.monotonic() + FORK_SECONDS
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

    def __init__(self, *, memory: int, idle_seconds: float = IDLE_SECONDS) -> None:
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
            alive = self._process is not None and self._process.poll() is None
            return self._process.pid if alive and self._process is not None else None

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
                process.wait(FORK_SECONDS)
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
                    __name__,
                    str(theirs.fileno()),
                    str(self.memory),
                    repr(self.idle_seconds),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env={**os.environ, **ENV},
                pass_fds=(theirs.fileno(),),
            )
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


def preload() -> None:
    """Import what a resolve reads with, so that no child imports it again; a failure
    (the limit too small for pyarrow's import) is left to each child to meet and
    answer, as a fresh child would."""
    with contextlib.suppress(BaseException):
        import concurrent.futures.thread  # noqa: F401  (the resolve's inspecting pool)

        import pyarrow.fs
        import pyarrow.parquet  # noqa: F401

        from shardcache import manifests, source  # noqa: F401


def _child(fds: list[int], server: int) -> None:
    """In the forked child: die with the server (`server`, its pid), take the request's
    descriptors as stdin, stdout and stderr, close every other one, and run the
    resolve. Never returns."""
    code = 1
    try:
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(resolve_child.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server:  # it ended before the line above
            os._exit(1)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        code = resolve_child.main()
        sys.stdout.flush()
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
            sys.stderr.flush()
    finally:
        os._exit(code)


class _Server:
    """The server's loop: requests on the control socket, children's ends (SIGCHLD),
    and the operator's kills on each status socket. One thread."""

    def __init__(self, control: socket.socket, idle_seconds: float) -> None:
        self.control = control
        self.idle_seconds = idle_seconds
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, socket.socket] = {}
        self.last = time.monotonic()
        self.woken_r, self.woken_w = socket.socketpair()
        self.woken_r.setblocking(False)
        self.woken_w.setblocking(False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self.woken_w.fileno(), warn_on_full_buffer=False)
        self.selector.register(control, selectors.EVENT_READ, "control")
        self.selector.register(self.woken_r, selectors.EVENT_READ, "woken")

    def run(self) -> None:
        while True:
            timeout = None
            if not self.children:
                timeout = self.last + self.idle_seconds - time.monotonic()
                if timeout <= 0:
                    return
            for key, _ in self.selector.select(timeout):
                if key.data == "control":
                    if not self._request():
                        self._end()
                        return
                elif key.data == "woken":
                    with contextlib.suppress(BlockingIOError):
                        while self.woken_r.recv(4096):
                            pass
                    self._reap()
                else:
                    self._kill_asked(key.data)
            self._reap()  # a SIGCHLD that came while the selector was not waiting

    def _request(self) -> bool:
        """Fork for one request; False when the operator's end closed."""
        try:
            message, fds, _, _ = socket.recv_fds(self.control, 16, _FDS)
        except OSError:
            return False
        if not message:
            for fd in fds:
                os.close(fd)
            return False
        self.last = time.monotonic()
        if len(fds) != _FDS:
            for fd in fds:
                os.close(fd)
            return True
        status = socket.socket(fileno=fds[3])
        server = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:  # EAGAIN, ENOMEM: the operator's resolve fails, saying so
            for fd in fds[:3]:
                os.close(fd)
            with contextlib.suppress(OSError):
                status.sendall(f"error {exc}\n".encode())
            status.close()
            return True
        if pid == 0:
            _child(fds, server)
        for fd in fds[:3]:
            os.close(fd)
        self.children[pid] = status
        try:
            status.sendall(f"pid {pid}\n".encode())
            self.selector.register(status, selectors.EVENT_READ, pid)
        except OSError:  # the operator gave up already
            self._kill(pid)
        return True

    def _kill_asked(self, pid: int) -> None:
        """A byte from the operator, or its end closed: kill the child."""
        status = self.children.get(pid)
        if status is None:
            return
        with contextlib.suppress(OSError):
            status.recv(16)
        self._kill(pid)

    def _kill(self, pid: int) -> None:
        """Kill a child not yet reaped (its pid is still its own), and stop listening to
        its status socket: a closed end reads as ready forever."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        status = self.children.get(pid)
        if status is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(status)

    def _reap(self, *, block: bool = False) -> None:
        """Reap the children that ended (`block`: all of them, waiting) and send each
        one's exit status."""
        while self.children:
            try:
                pid, wait_status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            status = self.children.pop(pid, None)
            if status is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(status)
            code = os.waitstatus_to_exitcode(wait_status)
            with contextlib.suppress(OSError):
                status.sendall(f"exit {code}\n".encode())
            status.close()
            self.last = time.monotonic()

    def _end(self) -> None:
        """The operator is gone, or closed this server: no child outlives it."""
        for pid in list(self.children):
            self._kill(pid)
        self._reap(block=True)


def main(argv: list[str]) -> int:
    control = socket.socket(fileno=int(argv[1]))
    resolve_child.limit(int(argv[2]), die_with_parent=False)
    preload()
    _Server(control, float(argv[3])).run()
    return 0


if __name__ == "__main__":
    os._exit(main(sys.argv))
