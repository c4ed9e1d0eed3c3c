"""The warm process the operator's resolve children are forked from: `python -m
shardcache_operator.resolve_forkserver`, started and used by `resolve_forks`.

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
told to start no background thread (`ENV`). It never reads a request: no tenant's keys
or data are ever in the process the next child is forked from.

The protocol, over a Unix socket pair (`SOCK_SEQPACKET`) whose other end only the
operator holds: for each resolve the operator sends one byte and four descriptors, the
child's stdin, stdout and stderr and one end of a new socket pair, the child's
*status*. The server forks; the child takes the three as its own and closes every
other descriptor; the server writes `pid <pid>\\n` on the status socket, and
`exit <code>\\n` once it has reaped the child (`code` as `subprocess.Popen.returncode`:
negative for a signal), or `error <message>\\n` where the kernel refused the fork. A
byte on the status socket from the operator, or its end closed, kills the child: the
server is its parent, so the pid cannot have been reused. The server ends when the
operator's end closes (the operator gone, or `Forkserver.close`: its children killed
and reaped first) and after `IDLE_SECONDS` with no child and no request; a request
caught by that end finds the status socket closed before any pid and is sent again to
a new server (`resolve_forks.Forkserver.fork`). Its children die with it
(`PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
import time
import traceback

from shardcache_operator import resolve_child

#: Seconds the server is kept with no child and no request: the resolves of a burst of
#: new mounts, and their retries, come closer together; an idle server holds about
#: 76 MiB resident, 29 MiB of it its own, which it gives back by ending.
IDLE_SECONDS = 30.0
#: The environment the server (and so each child) runs in: a resolve child's, and no
#: jemalloc background thread, the one thread pyarrow's import starts (a fork copies
#: only the thread that forks).
ENV = {**resolve_child.ENV, "JE_ARROW_MALLOC_CONF": "background_thread:false"}
#: Descriptors one request hands over: the child's stdin, stdout, stderr and status.
FDS = 4


# Only the standard library and `resolve_child` (which imports nothing else at its top)
# before the limits are in place, as in a resolve child.


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
        resolve_child.die_with_parent_thread()
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
            message, fds, _, _ = socket.recv_fds(self.control, 16, FDS)
        except OSError:
            return False
        if not message:
            for fd in fds:
                os.close(fd)
            return False
        self.last = time.monotonic()
        if len(fds) != FDS:
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
