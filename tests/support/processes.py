"""Stopping the real processes the fixtures start."""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def stop(process: subprocess.Popen[Any] | None, timeout: float) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds; a process already gone is fine."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout)
