"""The torch adapter's rank discovery is `shardcache.open()`'s (an initialised process
group, else $RANK/$WORLD_SIZE), plus $LOCAL_RANK for the GPU; with a group the
variables it overrides are not read, so a malformed one cannot fail the adapter."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


def test_discover_follows_the_group_and_ignores_the_variables_it_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist

    from shardcache import errors
    from shardcache.torch import _ranks

    monkeypatch.setenv("RANK", "not-a-rank")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(errors.InputError, match=r"\$RANK: expected an integer, found 'not-a-rank'"):
        _ranks.discover()
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        found = _ranks.discover()
        assert (found.rank, found.world_size, found.local_rank) == (0, 1, 3)
        assert _ranks.discover(0, 2).world_size == 2  # given wins
    finally:
        dist.destroy_process_group()
