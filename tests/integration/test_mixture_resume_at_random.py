"""Mixtures resumed at random steps, with what test_mixture_reading.py checks one at a
time mixed: weights with zeros, schedules (a resume at a schedule point, before the
first, after the last), sources in block mode, sample mode and manifest order, one
rank of a larger world size, gathering inline and ahead, and a source smaller than a
batch (one row per rank: a batch runs through several of its epochs).

Checked against the rules of docs/reading-plan.md ("Mixtures"), computed here: batch t
comes whole from the source rule 3 draws with the weights rule 2 gives at step t;
each source's rows, across its epochs, are what the source read alone yields, in
order (rules 1 and 4); and the run resumed from the state at any step, through JSON,
yields exactly the uninterrupted run's batches.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest

import shardcache
from tests.support import datasets

pytestmark = pytest.mark.integration

#: "b" has 3 rows: one per rank at world size 3, fewer than most batches.
SHARDS = {"a": [23, 0, 17], "b": [3], "c": [11, 30, 5]}
FIRST_UIDS = {"a": 0, "b": 10_000, "c": 20_000}
MODES = ["block", "sample", False]

Points = list[tuple[int, dict[str, float]]]


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return datasets.write_sources(tmp_path_factory.mktemp("mix"), SHARDS, first_uids=FIRST_UIDS)


def source_of(uid: int) -> str:
    return "a" if uid < FIRST_UIDS["b"] else "b" if uid < FIRST_UIDS["c"] else "c"


def weights_at(points: Points, names: Sequence[str], step: int) -> list[float]:
    """Rule 2: flat outside the points, linear between two, normalised."""
    steps = [s for s, _ in points]
    i = bisect.bisect_right(steps, step)
    if i in (0, len(points)):
        raw = [points[0 if i == 0 else -1][1][n] for n in names]
    else:
        (s0, w0), (s1, w1) = points[i - 1], points[i]
        t = (step - s0) / (s1 - s0)
        raw = [w0[n] + (w1[n] - w0[n]) * t for n in names]
    total = math.fsum(raw)
    return [w / total for w in raw]


def drawn(seed: int, step: int, weights: Sequence[float]) -> int:
    """Rule 3: the first source of weight > 0 whose cumulative weight exceeds u."""
    digest = hashlib.sha256(f"mix:{seed}:{step}".encode()).digest()
    u = int.from_bytes(digest[:8], "little") / 2.0**64
    total, last = 0.0, 0
    for i, w in enumerate(weights):
        if w > 0:
            total, last = total + w, i
            if u < total:
                return i
    return last


@st.composite
def schedules(draw: st.DrawFn, names: Sequence[str]) -> Points:
    steps = sorted(draw(st.sets(st.integers(0, 30), min_size=1, max_size=3)))
    points = []
    for step in steps:
        w = {n: draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])) for n in names}
        if not any(w.values()):
            w[names[0]] = 1.0
        points.append((step, w))
    return points


class Run:
    def __init__(self, roots: Mapping[str, Path], cache: Path, options: dict[str, Any]) -> None:
        self.roots, self.cache, self.options = roots, cache, options

    def open(self, name: str, where: str, threads: int) -> shardcache.Dataset:
        return shardcache.open(
            str(self.roots[name]), cache_dir=self.cache / where / name,
            seed=self.options["seeds"][name], shuffle=self.options["modes"][name],
            window=5, block_size=4, rank=self.options["rank"],
            world_size=self.options["world"], gather_threads=threads,
        )  # fmt: skip

    def mixture(self, names: Sequence[str], where: str, points: Points) -> shardcache.Mixture:
        opened = {n: self.open(n, where, self.options["threads"]) for n in names}
        return shardcache.mix(opened, weights=points, seed=self.options["seed"])

    def alone(self, name: str, rows: int) -> list[int]:
        """The first `rows` rows the source yields read alone, epoch after epoch."""
        out: list[int] = []
        with self.open(name, "alone", 0) as ds:
            while len(out) < rows:
                out += [u for b in ds.batches(7) for u in b.column("uid").to_pylist()]
                ds.set_epoch(ds.epoch + 1)
        return out[:rows]


@hypothesis.settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(data=st.data())
def test_resume_at_any_step_of_any_mixture_yields_the_drawn_sources_rows_in_order(
    roots: dict[str, Path], tmp_path: Path, data: st.DataObject
) -> None:
    names = data.draw(
        st.lists(st.sampled_from(sorted(SHARDS)), min_size=1, max_size=3, unique=True)
    )
    world = data.draw(st.integers(1, 3))
    options = {
        "seeds": {n: data.draw(st.integers(0, 5)) for n in names},
        "modes": {n: data.draw(st.sampled_from(MODES)) for n in names},
        "world": world,
        "rank": data.draw(st.integers(0, world - 1)),
        "threads": data.draw(st.sampled_from([0, 2])),
        "seed": data.draw(st.integers(0, 3)),
    }
    points = data.draw(schedules(names))
    size = data.draw(st.integers(1, 9))
    steps = data.draw(st.integers(1, 40))
    # At a schedule point (the weights change there) or anywhere.
    at_points = [s for s, _ in points if s <= steps]
    at = data.draw(st.integers(0, steps) | st.sampled_from(at_points or [steps]))
    run = Run(roots, tmp_path / "cache", options)
    with run.mixture(names, "whole", points) as m:
        whole = [b.column("uid").to_pylist() for b in m.batches(size, steps=steps)]
    with run.mixture(names, "first", points) as m:
        first = [b.column("uid").to_pylist() for b in m.batches(size, steps=at)]
        state = json.loads(json.dumps(m.state_dict()))
    with run.mixture(names, "rest", points) as m:
        m.load_state_dict(state)
        rest = [b.column("uid").to_pylist() for b in m.batches(size, steps=steps - at)]
    assert first + rest == whole, (at, state["step"])
    for step, batch in enumerate(whole):
        assert len(batch) == size
        want = names[drawn(options["seed"], step, weights_at(points, names, step))]
        assert {source_of(u) for u in batch} == {want}, step
    for name in names:
        got = [u for b in whole for u in b if source_of(u) == name]
        assert got == run.alone(name, len(got)), name
