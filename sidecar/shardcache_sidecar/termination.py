"""Why the sidecar exits, written where `kubectl describe pod` shows it.

Without it a sidecar whose tier directories were unusable showed only the kubelet's
startup-probe 503s: the reason sat in /readyz and the log, neither of which `describe`
shows. The kubelet reads the container's terminationMessagePath (the injected sidecar's
is `variables.TERMINATION_MESSAGE_PATH`'s default) when the container ends and shows it
as the last state's message; with terminationMessagePolicy FallbackToLogsOnError, a
crash that wrote nothing shows its last log lines instead.

Only a file that exists is written: the kubelet makes it in every container, and
outside Kubernetes (a sidecar started by hand, as root) this must not create
/dev/termination-log. A file that cannot be written is ignored: the exit and its
reason in the log matter more than this copy.

A multi-source sidecar runs one server per source in one process: their reasons are
written together (`joined`), since each one's own write would replace the others'. A
sidecar that served but stopped with work undone (a checkpoint drain cut off) says what
in the message too and exits 1 (`Unfinished`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from shardcache import errors
from shardcache.contract import variables

log = logging.getLogger(__name__)

#: The kubelet keeps at most 4096 bytes of a termination message.
LIMIT_BYTES = 4096


def path_from(environ: Mapping[str, str]) -> Path:
    """The path before settings are read (a refusal of them): the variable's text as
    given, else its default; never an error, a refusal is already being reported."""
    text = environ.get(variables.TERMINATION_MESSAGE_PATH.env, "").strip()
    return Path(text or variables.TERMINATION_MESSAGE_PATH.required_default)


def clipped(message: str) -> bytes:
    """`message` as UTF-8 within the kubelet's limit, cut at a character boundary."""
    data = message.encode()
    if len(data) <= LIMIT_BYTES:
        return data
    marker = b" [...]"
    return data[: LIMIT_BYTES - len(marker)].decode(errors="ignore").encode() + marker


def joined(reasons: Sequence[str]) -> str:
    """Several servers' reasons (a multi-source sidecar), one a line, in the order they
    came: the first failure is what went wrong, later ones are often its echo. Within
    the kubelet's limit, whole lines only, and a last line counting the ones left out
    (the log has them all)."""
    lines: list[str] = []
    used = 0
    for index, reason in enumerate(reasons):
        line = reason.replace("\n", " ")
        left = len(reasons) - index - 1
        # Room kept for the count line should later reasons not fit.
        tail = len(f"\n(and {left + 1} more: see the log)".encode())
        size = len(line.encode()) + (1 if lines else 0)
        if used + size + (tail if left else 0) > LIMIT_BYTES and lines:
            lines.append(f"(and {len(reasons) - index} more: see the log)")
            break
        lines.append(line)
        used += size
    return "\n".join(lines)


class Written(errors.InputError):
    """A refusal whose reasons the termination message already holds (`joined`): the
    caller logs it and exits, and does not overwrite the message with it alone."""


class Unfinished(Exception):
    """The sidecar stopped with work left undone (a checkpoint drain cut off), which its
    termination message names: it exits 1, so `kubectl describe` shows an error."""


def write(path: Path, message: str) -> bool:
    """Replace the content of `path` with `message` when it exists; whether it did."""
    try:
        # No O_CREAT: see the module's doc.
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    except OSError as exc:
        log.debug("no termination message written to %s: %s", path, exc)
        return False
    try:
        os.write(fd, clipped(message))
    except OSError as exc:
        log.debug("no termination message written to %s: %s", path, exc)
        return False
    finally:
        os.close(fd)
    return True
