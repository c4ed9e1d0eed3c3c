"""Copy plans (`shardcache.torch._copy_plans`): what a window of batches copies where.

The plan is checked by carrying it out with numpy on the host: the slab filled from the
runs' host bytes must hold every batch's values, and the offsets must be the plain
path's (from 0, per batch), whatever the pieces' offsets and slicing.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from shardcache import batching
from shardcache.torch import _copy_plans


def _lists(rows: list[list[int]], *, large: bool = False) -> pa.RecordBatch:
    kind = pa.large_list(pa.int32()) if large else pa.list_(pa.int32())
    uid = pa.array(range(len(rows)), pa.int64())
    return pa.record_batch([uid, pa.array(rows, kind)], names=["uid", "tokens"])


def _carry_out(plan: _copy_plans.Plan) -> tuple[np.ndarray, np.ndarray]:
    slab = np.zeros(plan.slab_bytes, np.uint8)
    for run in plan.runs:
        source = pa.foreign_buffer(run.address, run.size, base=run.buffers)
        slab[run.at : run.at + run.size] = np.frombuffer(source, np.uint8)
    offsets = np.full(plan.offsets_count, -1, np.int64)
    plan.fill_offsets(offsets)
    return slab, offsets


def _column(slab: np.ndarray, column: _copy_plans.Column) -> np.ndarray:
    return slab[column.start : column.start + column.size].view(column.dtype)


ROWS = [[i] * (i % 5) for i in range(40)]


@pytest.mark.parametrize("large", [False, True])
def test_a_windows_batches_are_their_pieces_values_and_offsets_from_zero(large: bool) -> None:
    whole = _lists(ROWS, large=large)
    cuts = [(0, 7), (7, 3), (10, 10), (20, 1), (21, 19)]
    pieces = [whole.slice(start, n) for start, n in cuts]
    window = [
        batching.HostBatch(pieces=pieces[:2]),
        batching.HostBatch(pieces=pieces[2:4]),
        batching.HostBatch(pieces=pieces[4:]),
    ]
    plan = _copy_plans.plan(window)
    assert plan is not None
    slab, offsets = _carry_out(plan)
    for batch, laid in zip(window, plan.batches, strict=True):
        table = pa.Table.from_batches(batch.pieces).combine_chunks()
        uid, tokens = laid
        assert _column(slab, uid).tolist() == table["uid"].to_pylist()
        values = table["tokens"].chunk(0)
        assert _column(slab, tokens).tolist() == values.flatten().to_pylist()
        assert tokens.offsets is not None
        first, last = tokens.offsets
        expected = np.asarray(values.offsets) - values.offsets[0].as_py()
        assert offsets[first:last].tolist() == expected.tolist()
    # Values of one column in consecutive pieces and batches are neighbours in the
    # shard and in the slab: one copy per column for the whole window.
    assert len(plan.runs) == 2


def test_runs_are_not_merged_across_registered_mappings() -> None:
    whole = _lists(ROWS)
    tokens = whole.column(1)
    middle = tokens.buffers()[3].address + 4 * tokens.offsets[20].as_py()

    def locate(address: int, size: int) -> int | None:
        # Two "mappings": the values before row 20 and from it on.
        return 0 if address < middle else 1

    window = [batching.HostBatch(pieces=[whole.slice(0, 20), whole.slice(20, 20)])]
    plan = _copy_plans.plan(window, locate=locate)
    assert plan is not None
    # The token values' runs, by address: the uid column's buffer may sit anywhere.
    values = tokens.buffers()[3]
    token_runs = [
        run for run in plan.runs if values.address <= run.address < values.address + values.size
    ]
    assert [run.mapping for run in token_runs] == [0, 1]
    slab, _ = _carry_out(plan)
    assert _column(slab, plan.batches[0][1]).tolist() == tokens.flatten().to_pylist()


def test_shuffled_pieces_land_in_batch_order() -> None:
    whole = _lists(ROWS)
    pieces = [whole.slice(30, 10), whole.slice(0, 10), whole.slice(10, 5)]
    plan = _copy_plans.plan([batching.HostBatch(pieces=pieces)])
    assert plan is not None
    slab, offsets = _carry_out(plan)
    table = pa.Table.from_batches(pieces).combine_chunks()
    assert _column(slab, plan.batches[0][0]).tolist() == table["uid"].to_pylist()
    assert (
        _column(slab, plan.batches[0][1]).tolist() == table["tokens"].chunk(0).flatten().to_pylist()
    )
    assert offsets[0] == 0 and offsets[-1] == len(table["tokens"].chunk(0).flatten())


def test_packed_batches_and_the_epochs_padding() -> None:
    values = pa.array(range(30), pa.int32())
    pad = pa.array([0, 0], pa.int32())  # not in any mapping: staged
    window = [
        batching.HostBatch(
            tokens=[values.slice(0, 8), values.slice(8, 4)], column="t", shape=(3, 4)
        ),
        batching.HostBatch(tokens=[values.slice(12, 18), pad], column="t", shape=(5, 4)),
    ]
    plan = _copy_plans.plan(window)
    assert plan is not None and plan.offsets_count == 0
    slab, _ = _carry_out(plan)
    first, second = (laid[0] for laid in plan.batches)
    assert first.shape == (3, 4) and _column(slab, first).tolist() == list(range(12))
    assert second.shape == (5, 4) and _column(slab, second).tolist() == [*range(12, 30), 0, 0]


@pytest.mark.parametrize(
    "batch",
    [
        pa.record_batch([pa.array([True, False])], names=["flag"]),
        pa.record_batch([pa.array([1, None], pa.int64())], names=["uid"]),
        pa.record_batch([pa.array([[1], None], pa.list_(pa.int32()))], names=["tokens"]),
        pa.record_batch([pa.array([[1], [None]], pa.list_(pa.int32()))], names=["tokens"]),
        pa.record_batch([pa.array(["a", "b"])], names=["text"]),
    ],
    ids=["bool", "null-values", "null-list", "null-token", "string"],
)
def test_what_a_tensor_cannot_view_is_left_to_the_per_batch_path(batch: pa.RecordBatch) -> None:
    assert _copy_plans.plan([batching.HostBatch(pieces=[batch])]) is None


def test_the_longest_list_of_a_batch_comes_from_its_offsets() -> None:
    whole = _lists(ROWS)
    plan = _copy_plans.plan([batching.HostBatch(pieces=[whole.slice(1, 4), whole.slice(5, 2)])])
    assert plan is not None
    _, offsets = _carry_out(plan)
    assert plan.longest(offsets, plan.batches[0][1]) == 4  # rows 1-4 and 5-6: lengths 1-4, then 0-1


def test_rebased_offsets_are_computed_in_int64_past_what_int32_holds() -> None:
    # A batch's later pieces are rebased by the tokens before them, which can pass
    # 2**31 even though each shard's offsets are int32.
    source = np.array([2**31 - 5, 2**31 - 1], np.int32)
    plan = _copy_plans.Plan(
        batches=[],
        runs=[],
        slab_bytes=0,
        offsets_count=2,
        _pieces=[_copy_plans._OffsetsPiece(source, at=1, base=3 * 2**31)],
        _starts=[0],
    )
    out = np.full(2, -1, np.int64)
    plan.fill_offsets(out)
    assert out.tolist() == [0, 3 * 2**31 + 4]
