"""The storage tier against an in-memory model, over random sequences of operations.

Hypothesis drives insert (get_or_insert), lease (lookup), release and evict in any
order on one real tier directory. After every step: a leased entry is never evicted
and reads back its own bytes, the byte limit holds, the leased and resident byte counts
agree with the model, and every refusal was one the model says was due (the entry can
never fit, or the room is held by leases). The same machine runs a sole-writer tier
(`Tier(sole_writer=True)`, membership from memory) and checks its answers against the
directory's files after every step.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import pytest
from hypothesis import stateful

from shardcache import errors
from shardcache.node import tiers

pytestmark = pytest.mark.unit

KIB = 1024
LIMIT = 64 * KIB
# Fixed per key, so a hit and an insert agree on the size: an empty entry, small ones,
# two that fill most of the tier, and one that can never fit.
SIZES = {
    "empty": 0,
    "a": 1 * KIB,
    "b": 5 * KIB,
    "c": 9 * KIB,
    "d": 16 * KIB,
    "e": 24 * KIB,
    "f": 40 * KIB,
    "huge": LIMIT + 1,
}
keys = st.sampled_from(sorted(SIZES))


def payload(key: str) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    size = SIZES[key]
    return (seed * (size // len(seed) + 1))[:size]


def writer(key: str) -> Callable[[Path], None]:
    def produce(path: Path) -> None:
        path.write_bytes(payload(key))

    return produce


class TierModel(stateful.RuleBasedStateMachine):
    sole_writer = False

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tier-model-"))
        # No wait: a full tier refuses at once, so each step is one decision to check.
        self.tier = tiers.Tier(
            self.root / "t",
            limit_bytes=LIMIT,
            name="memory",
            fsync=False,
            wait_timeout=0,
            sole_writer=self.sole_writer,
        )
        #: Keys the model knows were committed and not evicted by a rule (the tier may
        #: have evicted unleased ones on its own to make room).
        self.maybe_resident: set[str] = set()
        #: Leases this test holds, by key (several per key are allowed).
        self.held: dict[str, list[tiers.Entry]] = {}

    def teardown(self) -> None:
        for entries in self.held.values():
            for entry in entries:
                entry.release()
        shutil.rmtree(self.root, ignore_errors=True)

    def leased_keys(self) -> set[str]:
        return {key for key, entries in self.held.items() if entries}

    def leased_bytes(self) -> int:
        return sum(SIZES[key] for key in self.leased_keys())

    def hold(self, entry: tiers.Entry) -> None:
        assert entry.path.read_bytes() == payload(entry.key)
        self.held.setdefault(entry.key, []).append(entry)

    # --- rules ----------------------------------------------------------------------
    @stateful.rule(key=keys, keep=st.booleans())
    def insert(self, key: str, keep: bool) -> None:
        """get_or_insert; with keep=False the lease is let go at once (a put)."""
        size = SIZES[key]
        resident_before = set(self.tier.keys())
        try:
            entry, hit = self.tier.get_or_insert(key, size, writer(key))
        except tiers.EntryTooLargeError:
            assert size > LIMIT, f"{key} ({size} bytes) refused as too large"
            hypothesis.event("insert: too large")
            return
        except errors.CacheError as exc:
            # Refused for room: only right when leases (ours are the only ones) keep
            # the room taken, and then nothing leased was evicted trying.
            assert key not in resident_before
            assert self.leased_bytes() + size > LIMIT, f"refused with room free: {exc}"
            hypothesis.event("insert: no room beside leases")
            return
        evicted = resident_before - set(self.tier.keys())
        hypothesis.event("insert: evicted to make room" if evicted else "insert: fit")
        assert hit == (key in resident_before)
        self.maybe_resident.add(key)
        self.hold(entry)
        if not keep:
            self.held[key].pop().release()

    @stateful.rule(key=keys)
    def lease(self, key: str) -> None:
        entry = self.tier.lookup(key)
        if key in self.leased_keys():
            assert entry is not None, f"{key} is leased, yet lookup missed it"
        if entry is None:
            return
        assert key in self.maybe_resident, f"{key} found but never inserted"
        self.hold(entry)

    @stateful.precondition(lambda self: bool(self.leased_keys()))
    @stateful.rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.leased_keys())))
        entries = self.held[key]
        entries.pop(data.draw(st.integers(0, len(entries) - 1))).release()

    @stateful.rule(key=keys)
    def evict(self, key: str) -> None:
        resident = self.tier.contains(key)
        removed = self.tier.evict(key)
        if key in self.leased_keys():
            hypothesis.event("evict: refused, leased")
            assert not removed, f"evicted {key} while it was leased"
        else:
            assert removed == resident
            self.maybe_resident.discard(key)

    # --- what holds after every step -------------------------------------------------
    @stateful.invariant()
    def leased_entries_stay_with_their_bytes(self) -> None:
        resident = set(self.tier.keys())
        assert self.leased_keys() <= resident, "a leased entry was evicted"
        for key in self.leased_keys():
            assert self.held[key][0].path.read_bytes() == payload(key)

    @stateful.invariant()
    def limits_and_counts_hold(self) -> None:
        resident = set(self.tier.keys())
        assert resident <= self.maybe_resident, f"unknown entries {resident - self.maybe_resident}"
        assert self.tier.used_bytes() <= LIMIT
        assert self.tier.resident_bytes() == sum(SIZES[k] for k in resident)
        assert self.tier.leased_bytes() == self.leased_bytes()

    @stateful.invariant()
    def membership_is_the_directorys(self) -> None:
        # A sole writer answers from memory: it must name exactly the committed files.
        on_disk = set(self.tier.keys())
        assert {key for key in SIZES if self.tier.contains(key)} == on_disk


class SoleWriterTierModel(TierModel):
    sole_writer = True


_SETTINGS = hypothesis.settings(max_examples=60, stateful_step_count=30, deadline=None)
TierModel.TestCase.settings = _SETTINGS
SoleWriterTierModel.TestCase.settings = _SETTINGS
test_the_tier_agrees_with_its_model_under_random_operations = TierModel.TestCase
test_a_sole_writer_tier_agrees_with_its_model_and_its_files = SoleWriterTierModel.TestCase
