"""What a forked child (a DataLoader worker) must not take over from its parent's
threads: each object whose state those threads may hold at the fork (a lock, fetch
slots, work in flight, lock descriptors of its own) registers here, and its
`after_fork()` runs first thing in every forked child.

One hook for every such object: `os.register_at_fork` takes no hook back, so a hook per
object would pile up for as long as the process makes them. Objects are held weakly.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class AfterFork(Protocol):
    def after_fork(self) -> None:
        """Run in a forked child before anything else uses the object."""


_OBJECTS: weakref.WeakSet[AfterFork] = weakref.WeakSet()


def register(obj: AfterFork) -> None:
    """Call `obj.after_fork()` in every child forked while `obj` lives."""
    _OBJECTS.add(obj)


def _in_child() -> None:
    for obj in list(_OBJECTS):
        obj.after_fork()


os.register_at_fork(after_in_child=_in_child)
