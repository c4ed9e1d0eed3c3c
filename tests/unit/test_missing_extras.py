"""A trainer's pyarrow-only install lacks numpy, torch and jax: importing an adapter that
needs one names the extra to install, instead of a bare ModuleNotFoundError. Regression
test of the s20 trainer explorer's D3. Each case runs in a fresh interpreter where the
framework cannot be imported (None in sys.modules: Python's own way to block one)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("blocked", "statement", "extra"),
    [
        ("numpy", "import shardcache.numpy", "sample"),
        ("jax", "import shardcache.jax", "jax"),
        ("torch", "import shardcache.torch; shardcache.torch.IterableDataset", "torch"),
        ("numpy", "import shardcache.torch; shardcache.torch.DevicePrefetcher", "torch"),
    ],
)
def test_an_adapter_without_its_framework_names_the_extra_to_install(
    blocked: str, statement: str, extra: str
) -> None:
    code = f"import sys; sys.modules[{blocked!r}] = None\n{statement}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError"), last
    assert f"shardcache[{extra}]" in last and blocked in last, last
