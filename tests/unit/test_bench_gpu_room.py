"""`bench.gpu` refuses, before writing, a dataset its work directory cannot hold (the
prepared device command's 8 GiB would otherwise fill a small /dev/shm shared with every
other process), and says what to pass instead."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench import gpu


def test_a_dataset_the_work_filesystem_cannot_hold_three_times_is_refused(
    tmp_path: Path,
) -> None:
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(SystemExit, match="pass a smaller --size"):
        gpu.check_room(tmp_path / "not" / "made" / "yet", free // 2)
    assert not (tmp_path / "not").exists()
    gpu.check_room(tmp_path, 1 << 20)  # a small one fits
