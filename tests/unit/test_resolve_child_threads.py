"""The resolve child's threads, pyarrow's C++ pools included, start with a small stack:
the child's data limit counts each thread's whole stack, touched or not."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

#: Starts 10 threads that wait, as pthread_create without attributes (pyarrow's
#: std::thread) does, and prints how much VmData they added, in KiB.
PROBE = r"""
import ctypes, json, sys, threading
from shardcache_operator import resolve_child
if sys.argv[1] == "limited":
    resolve_child._default_thread_stack(resolve_child.THREAD_STACK)
def vm_data():
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1])
libc = ctypes.CDLL(None)
CALLBACK = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
gate = threading.Event()
def wait(_):
    gate.wait()
    return None
callback = CALLBACK(wait)
before = vm_data()
threads = [ctypes.c_ulong() for _ in range(10)]
for t in threads:
    assert libc.pthread_create(ctypes.byref(t), None, callback, None) == 0
after = vm_data()
gate.set()
for t in threads:
    libc.pthread_join(t, None)
print(json.dumps(after - before))
"""


def eight_mib_stacks() -> None:
    """RLIMIT_STACK of 8 MiB, as a container gets by default: glibc makes it the
    default thread stack when the process starts."""
    _, hard = resource.getrlimit(resource.RLIMIT_STACK)
    soft = 8 << 20 if hard == resource.RLIM_INFINITY else min(8 << 20, hard)
    resource.setrlimit(resource.RLIMIT_STACK, (soft, hard))


def added_kib(mode: str) -> int:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'operator'}"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=eight_mib_stacks,
    )
    return int(json.loads(out.stdout))


def test_threads_without_attributes_of_their_own_take_the_childs_small_stack() -> None:
    # glibc's default is RLIMIT_STACK (8 MiB): 10 threads map about 80 MiB of data.
    assert added_kib("default") >= 10 * 4096
    # The child's default: about 1 MiB each (plus a guard page and the thread's TLS).
    assert added_kib("limited") <= 10 * 2048
