"""`shardcache_sidecar.server.handed`: what each reader opted into `skip_handed` was
handed with `reuse` (docs/wire-format.md, "Grants ahead of shards handed before")."""

from __future__ import annotations

from shardcache_sidecar.server.handed import Handed


def test_only_a_reader_that_opted_in_has_marks_and_they_start_empty() -> None:
    handed = Handed()
    handed.mark("old", 2)  # an older client's reader: nothing kept for it
    assert handed.of("old") is None
    handed.opt_in("r", 4)
    assert handed.of("r") == bytearray(4)
    assert len(handed) == 1


def test_marks_are_kept_when_the_reader_registers_again_and_dropped_when_it_goes() -> None:
    handed = Handed()
    handed.opt_in("r", 4)
    handed.mark("r", 1)
    handed.mark("r", 3)
    handed.opt_in("r", 4)  # registered again (a new epoch, a moved plan): same manifest
    assert list(handed.of("r") or b"") == [0, 1, 0, 1]
    handed.forget("r")
    assert handed.of("r") is None and len(handed) == 0


def test_a_mark_outside_the_manifest_is_ignored_not_an_error() -> None:
    handed = Handed()
    handed.opt_in("r", 2)
    handed.mark("r", 2)
    handed.mark("r", -1)
    assert handed.of("r") == bytearray(2)
