"""The resolve children are forked from one warm process (`resolve_forkserver`): real
processes, a real file source, and a store on loopback that accepts and never answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from shardcache_operator import (
    endpoint_policy,
    reconcile,
    resolve_child,
    resolve_children,
    resolve_forks,
    resolve_forkserver,
    sources,
)

from shardcache import source
from tests.support import datasets, waiting
from tests.support.stalling import stalling_endpoint

pytestmark = pytest.mark.integration

MEMORY = 256 << 20
FAST_RETRY = source.RetryPolicy(attempts=2, initial_delay=0.05, max_delay=0.1)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def gone(pid: int, seconds: float = 10.0) -> bool:
    """Whether `pid` is gone, reaped, within `seconds` (a zombie is not gone)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.01)
    return False


def request(uri: str) -> bytes:
    return json.dumps(
        {
            "uri": uri,
            "format": "parquet",
            "storage_options": None,
            "memory": MEMORY,
            "retry": FAST_RETRY.to_json(),
        }
    ).encode()


def resolved(child: resolve_forks.Forked, uri: str) -> resolve_child.Summary:
    """Hand `child` a resolve of `uri` and read its summary."""
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(request(uri))
    child.stdin.close()
    answer = json.loads(child.stdout.read())
    assert child.wait(30) == 0
    child.close()
    return resolve_child.Summary.from_json(answer["summary"])


@pytest.fixture
def forks() -> Iterator[resolve_forks.Forkserver]:
    server = resolve_forks.Forkserver(memory=MEMORY)
    yield server
    server.close()


def test_resolves_are_forked_from_one_warm_server_with_one_thread(
    tmp_path: Path, forks: resolve_forks.Forkserver
) -> None:
    uri, _ = datasets.write_local(tmp_path / "data", [30, 20, 10])
    first = forks.fork(60)
    server = forks.pid()
    assert server is not None and server != os.getpid()
    assert parent_of(first.pid) == server
    # One thread at each fork: a fork copies only the thread that forks, and pyarrow's
    # jemalloc would otherwise have started a background thread at the import.
    assert os.listdir(f"/proc/{server}/task") == [str(server)]
    assert resolved(first, uri).total_rows == 60
    second = forks.fork(60)
    assert parent_of(second.pid) == server and second.pid != first.pid
    assert resolved(second, uri).shard_count == 3
    assert gone(first.pid) and gone(second.pid)


def test_a_child_holds_only_its_own_stdin_stdout_and_stderr(
    forks: resolve_forks.Forkserver,
) -> None:
    """Not another child's status socket, nor the server's: else a resolve whose
    operator end closed would not be killed while a sibling ran."""
    first, second = forks.fork(60), forks.fork(60)
    for child in (first, second):
        # It blocks reading its request, which never comes.
        deadline = time.monotonic() + 10
        while sorted(os.listdir(f"/proc/{child.pid}/fd")) != ["0", "1", "2"]:
            assert time.monotonic() < deadline, os.listdir(f"/proc/{child.pid}/fd")
            time.sleep(0.01)
    first.close()  # the operator let go of it: the server kills it, the sibling runs on
    assert gone(first.pid)
    assert Path(f"/proc/{second.pid}").exists()
    second.kill()
    assert second.wait(10) == -signal.SIGKILL
    second.close()


def test_closing_the_server_ends_it_and_its_children_and_starts_no_other(
    forks: resolve_forks.Forkserver,
) -> None:
    child = forks.fork(60)
    server = forks.pid()
    assert server is not None
    forks.close()
    assert child.wait(10) == -signal.SIGKILL
    child.close()
    assert gone(child.pid) and gone(server)
    with pytest.raises(resolve_forks.ServerEnded, match="the operator is stopping"):
        forks.fork(60)
    assert forks.pid() is None


def test_an_idle_server_ends_and_the_next_resolve_starts_another(tmp_path: Path) -> None:
    uri, _ = datasets.write_local(tmp_path / "data", [5])
    forks = resolve_forks.Forkserver(memory=MEMORY, idle_seconds=0.5)
    try:
        assert resolved(forks.fork(60), uri).total_rows == 5
        first = forks.pid()
        # Reaped when it ends, not left a zombie until the next resolve.
        assert first is not None and gone(first)
        # The reaper thread sets the exit code just after the kernel reaped it; until it
        # does, Popen.poll() cannot take the lock that thread holds and answers None.
        waiting.wait_until("pid() to clear once the server was reaped", lambda: forks.pid() is None)
        assert resolved(forks.fork(60), uri).total_rows == 5
        assert forks.pid() not in (None, first)
    finally:
        forks.close()


def test_a_server_killed_between_resolves_is_replaced(
    tmp_path: Path, forks: resolve_forks.Forkserver
) -> None:
    """Killed just before a fork: the request either fails to send or is dropped with
    the server, and goes to a new one."""
    uri, _ = datasets.write_local(tmp_path / "data", [5])
    assert resolved(forks.fork(60), uri).total_rows == 5
    first = forks.pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)
    assert resolved(forks.fork(60), uri).total_rows == 5
    assert forks.pid() not in (None, first)


async def test_a_server_killed_while_resolving_fails_the_resolve_as_killed() -> None:
    """The kernel's OOM killer may take the server (first in line, as its children): the
    resolve says so, its child dies with the server, and the next resolve gets a new
    one."""
    with stalling_endpoint() as endpoint:
        access = sources.Access(source_endpoints=(endpoint_policy.entry(endpoint),))
        resolver = resolve_children.Resolver(
            memory=MEMORY, timeout=60.0, retry=FAST_RETRY, access=access
        )
        try:
            loop = asyncio.get_running_loop()
            options = {"AWS_ENDPOINT_URL": endpoint}
            read = loop.run_in_executor(
                None, lambda: resolver("s3://bucket/data/", "parquet", options)
            )
            for _ in range(3000):
                if resolver.running():
                    break
                await asyncio.sleep(0.01)
            (pid,) = resolver.running()
            server = parent_of(pid)
            os.kill(server, signal.SIGKILL)
            with pytest.raises(reconcile.ResolveOverMemory, match="killed"):
                await read
            assert gone(pid) and resolver.running() == []
        finally:
            resolver.close()


def test_a_fork_the_kernel_refuses_is_answered_as_an_error_and_the_server_serves_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EAGAIN or ENOMEM at the fork: the resolve fails saying why; the server, which
    serves every namespace's resolves, does not end with it."""

    def refused() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    status, child_status = socket.socketpair()
    pipes = [os.pipe() for _ in range(3)]
    server = resolve_forkserver._Server(theirs, idle_seconds=60.0)
    try:
        monkeypatch.setattr(os, "fork", refused)
        socket.send_fds(
            control,
            [b"f"],
            [pipes[0][0], pipes[1][1], pipes[2][1], child_status.fileno()],
        )
        assert server._request()
        assert resolve_forks._line(status, 10) == (
            "error [Errno 11] Resource temporarily unavailable"
        )
        assert server.children == {}
        control.close()
        assert not server._request()  # the operator's end closed: the server ends
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sock in (control, theirs, status, child_status, server.woken_r, server.woken_w):
            sock.close()
        server.selector.close()
        # The server closed the child's ends (their numbers may be taken again since).
        for fd in (pipes[0][1], pipes[1][0], pipes[2][0]):
            os.close(fd)


AS_INIT = """
import os, signal
from shardcache_operator import resolve_forks

assert os.getpid() == 1
forks = resolve_forks.Forkserver(memory=256 << 20)
child = forks.fork(60)
os.kill(forks.pid(), signal.SIGKILL)
try:
    child.wait(30)
except resolve_forks.ServerEnded:
    pass
else:
    raise SystemExit("expected ServerEnded")
child.close()
print("server", forks.exit_code())
print("left", sorted(
    f"{pid}:" + open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
    for pid in os.listdir("/proc")
    if pid.isdigit() and pid != "1" and os.path.exists(f"/proc/{pid}/stat")
))
"""


def test_where_the_operator_is_its_containers_init_a_dead_servers_child_leaves_no_zombie() -> None:
    """In the chart's pod the operator is pid 1, which inherits the children of a
    server that died (the OOM killer may pick it); nothing else would reap them."""
    ran = subprocess.run(
        ["unshare", "--fork", "--pid", "--mount-proc", sys.executable, "-c", AS_INIT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [f"server {-signal.SIGKILL}", "left []"], ran.stdout


def test_a_refused_fork_fails_the_resolve_with_the_kernels_reason() -> None:
    """The operator's end, against a stand-in server on the control socket that
    answers what the real one does when `os.fork` fails."""
    forks = resolve_forks.Forkserver(memory=MEMORY)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stand_in = subprocess.Popen(["sleep", "60"])
    forks._control, forks._process = ours, stand_in

    def serve() -> None:
        _, fds, _, _ = socket.recv_fds(theirs, 16, resolve_forkserver.FDS)
        for fd in fds[:3]:
            os.close(fd)
        with socket.socket(fileno=fds[3]) as status:
            status.sendall(b"error [Errno 11] Resource temporarily unavailable\n")

    server = threading.Thread(target=serve)
    server.start()
    try:
        with pytest.raises(OSError, match=r"could not fork: \[Errno 11\] Resource temporarily"):
            forks.fork(10)
        server.join(10)
        assert forks.pid() == stand_in.pid  # not taken for a dead server
    finally:
        theirs.close()
        stand_in.kill()
        forks.close()


def test_a_thread_that_saw_its_server_end_never_ends_the_one_that_replaced_it() -> None:
    forks = resolve_forks.Forkserver(memory=MEMORY)
    old = subprocess.Popen(["true"])
    old.wait()
    new = subprocess.Popen(["sleep", "60"])
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    forks._control, forks._process = ours, new
    try:
        with forks._lock:
            forks._ended(old)  # late: another thread started `new` meanwhile
        assert forks.pid() == new.pid and new.poll() is None
        with forks._lock:
            forks._ended(new)
        assert forks.pid() is None and new.returncode == -signal.SIGKILL
    finally:
        theirs.close()
        new.kill()
        new.wait()
        forks.close()
