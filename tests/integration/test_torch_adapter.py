"""`shardcache.torch` through real DataLoader worker processes and torchdata's
StatefulDataLoader; the device prefetcher's CPU path; the numpy and JAX adapters."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch
import torch.utils.data
from torchdata.stateful_dataloader import StatefulDataLoader

import shardcache.torch
from shardcache import batching, errors
from shardcache.torch import _host_memory
from tests.support import datasets, torch_datasets

pytestmark = [
    pytest.mark.integration,
    # 4 workers on a 2-core machine is the point of the test, not a mistake.
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    # torchdata 0.11 (its latest) still calls an API torch has since deprecated.
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

SHARDS = torch_datasets.SHARDS


@pytest.fixture
def uri(tmp_path: Path) -> str:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    return str(tmp_path / "ds")


@pytest.fixture
def make(uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    with torch_datasets.iterable_datasets(uri, tmp_path / "cache", monkeypatch) as factory:
        yield factory


def loader(
    ds: object, workers: int, cls: type = torch.utils.data.DataLoader, **options: object
) -> object:
    return cls(
        ds,
        batch_size=None,
        num_workers=workers,
        multiprocessing_context="fork" if workers else None,
        **options,
    )


def uids(batches: object) -> list[int]:
    return [int(u) for b in batches for u in b["uid"]]  # type: ignore[attr-defined]


@pytest.mark.parametrize("workers", [0, 2, 4])
def test_dataloader_yields_the_rank_stream_exactly_with_any_worker_count(
    make, uri: str, tmp_path: Path, workers: int
) -> None:  # type: ignore[no-untyped-def]
    with shardcache.open(
        uri, cache_dir=tmp_path / "cache", block_size=5, rank=1, world_size=3
    ) as plain:
        expected = [u for b in plain.batches(6) for u in b.column("uid").to_pylist()]
    got = uids(loader(make(rank=1, world_size=3), workers))
    assert got == expected


@pytest.mark.parametrize("shuffle", ["block", "sample"])
def test_workers_forked_while_the_parents_cache_fetches_yield_the_rank_stream_exactly(
    make, uri: str, tmp_path: Path, shuffle: str
) -> None:  # type: ignore[no-untyped-def]
    """DataLoader workers forked while the parent's cache (opened in the parent) has a
    fetch in flight on its one fetch slot: the workers read on (before, they waited
    forever on the slot and on the attempt nobody in them finishes)."""
    with shardcache.open(
        uri, cache_dir=tmp_path / "ref", block_size=5, shuffle=shuffle, window=40
    ) as plain:
        expected = [u for b in plain.batches(6) for u in b.column("uid").to_pylist()]
    ds = make(shuffle=shuffle, window=40, fetch_concurrency=1)
    node = ds.shardcache_dataset()._provider.node
    parent, gate, decoding = os.getpid(), threading.Event(), threading.Event()
    real = node._decode

    def decode(*args: object, **kwargs: object) -> object:
        if os.getpid() == parent:
            decoding.set()
            gate.wait(120)
        return real(*args, **kwargs)

    node._decode = decode
    fetching = threading.Thread(target=node._prefetch, args=(0, "readahead"))
    fetching.start()
    try:
        assert decoding.wait(30)
        got = uids(loader(ds, 2, timeout=60))
    finally:
        gate.set()
        fetching.join(30)
    assert got == expected


def test_rank_and_world_size_come_from_torchrun_environment(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ds = make()
    assert (ds.rank, ds.world_size, ds.local_rank) == (2, 4, 1)
    state = ds.state_dict()
    assert (state["dataset"]["rank"], state["dataset"]["world_size"]) == (2, 4)


def test_ranks_across_processes_read_every_row_once(make) -> None:  # type: ignore[no-untyped-def]
    seen = [u for r in range(3) for u in uids(loader(make(rank=r, world_size=3), 2))]
    assert sorted(seen) == list(range(sum(SHARDS)))


@pytest.mark.parametrize("workers", [0, 2, 4])
@pytest.mark.parametrize("stop", [1, 3, 6])
def test_stateful_dataloader_resumes_at_the_exact_next_batch(make, workers: int, stop: int) -> None:  # type: ignore[no-untyped-def]
    full = uids(loader(make(), workers, StatefulDataLoader))
    first = loader(make(), workers, StatefulDataLoader)
    head: list[int] = []
    for i, batch in enumerate(first):  # type: ignore[attr-defined]
        head += [int(u) for u in batch["uid"]]
        if i + 1 == stop:
            break
    state = first.state_dict()  # type: ignore[attr-defined]
    json.dumps(state)  # what a checkpoint stores
    resumed = loader(make(), workers, StatefulDataLoader)
    resumed.load_state_dict(state)  # type: ignore[attr-defined]
    assert head + uids(resumed) == full


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_batches_carry_the_remainder_across_resume(make, workers: int) -> None:  # type: ignore[no-untyped-def]
    options = {"columns": ["tokens"], "pack": 9, "batch_size": 2}
    full = [b["tokens"] for b in loader(make(**options), workers, StatefulDataLoader)]  # type: ignore[attr-defined]
    first = loader(make(**options), workers, StatefulDataLoader)
    it = iter(first)  # type: ignore[call-overload]
    head = [next(it)["tokens"] for _ in range(4)]
    state = first.state_dict()  # type: ignore[attr-defined]
    resumed = loader(make(**options), workers, StatefulDataLoader)
    resumed.load_state_dict(state)  # type: ignore[attr-defined]
    rest = [b["tokens"] for b in resumed]  # type: ignore[attr-defined]
    assert len(head) + len(rest) == len(full)
    for a, b in zip(head + rest, full, strict=True):
        assert torch.equal(a, b)
    assert full[0].shape == (2, 9) and full[0].dtype == torch.int32


def epoch_uids(make: torch_datasets.Factory, epoch: int, **options: Any) -> list[list[int]]:
    """Epoch `epoch`'s batches read in this process: what any loader must yield."""
    ds = make(**options)
    ds.set_epoch(epoch)
    return [[int(u) for u in b["uid"]] for b in loader(ds, 0)]  # type: ignore[attr-defined]


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("shuffle", ["block", "sample"])
def test_persistent_workers_read_the_epoch_set_in_the_main_process_at_every_pass(
    make: torch_datasets.Factory, context: str, shuffle: str
) -> None:
    """DataLoader(persistent_workers=True) copies the dataset into its workers once:
    set_epoch(e) in the main process used to stay there, and every pass read epoch 0
    again. Forked and spawned workers share the epoch with the main process."""
    options: dict[str, Any] = {"shuffle": shuffle, "window": 40}
    ds = make(**options)
    persistent = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True,
        multiprocessing_context=context,
    )  # fmt: skip
    for epoch in (0, 1, 3):
        ds.set_epoch(epoch)
        got = [[int(u) for u in b["uid"]] for b in persistent]
        assert got == epoch_uids(make, epoch, **options), f"epoch {epoch}"
    assert epoch_uids(make, 1, **options) != epoch_uids(make, 0, **options)


@pytest.mark.parametrize("stop", [1, 4])
def test_stateful_dataloader_with_persistent_workers_resumes_mid_epoch_exactly(
    make: torch_datasets.Factory, stop: int
) -> None:
    """A later epoch's state from persistent workers says that epoch and resumes at its
    next batch, in persistent workers too, and the epoch after it follows set_epoch."""

    def stateful(ds: shardcache.torch.IterableDataset) -> Any:
        return loader(ds, 2, StatefulDataLoader, persistent_workers=True)

    ds = make()
    first = stateful(ds)
    assert uids(first) == [u for b in epoch_uids(make, 0) for u in b]
    ds.set_epoch(2)
    head: list[int] = []
    for i, batch in enumerate(first):
        head += [int(u) for u in batch["uid"]]
        if i + 1 == stop:
            break
    state = json.loads(json.dumps(first.state_dict()))
    again = make()
    again.set_epoch(2)
    resumed = stateful(again)
    resumed.load_state_dict(state)
    assert head + uids(resumed) == [u for b in epoch_uids(make, 2) for u in b]
    again.set_epoch(3)
    assert uids(resumed) == [u for b in epoch_uids(make, 3) for u in b]


def test_a_state_loaded_in_the_main_process_after_persistent_workers_started_is_refused(
    make: torch_datasets.Factory,
) -> None:
    """Persistent workers read copies made when they started: a state loaded into the
    main process's dataset afterwards cannot reach them. Their next pass used to ignore
    it and read the epoch from its start; now it says so."""
    ds = make()
    persistent = loader(ds, 1, persistent_workers=True)
    uids(persistent)
    other = make()
    batches = iter(loader(other, 0))
    next(batches)
    ds.load_state_dict(other.state_dict())
    with pytest.raises(errors.StateMismatchError, match="after this persistent worker started"):
        uids(persistent)


def test_packing_covers_every_token_once(make, uri: str) -> None:  # type: ignore[no-untyped-def]
    plain = make(columns=["tokens"], batch_size=50)
    expected = torch.cat([b["tokens"] for b in plain])
    packed = torch.cat(
        [
            b["tokens"].reshape(-1)
            for b in make(columns=["tokens"], pack=7, batch_size=3, pad_value=-1)
        ]
    )
    assert torch.equal(packed[: len(expected)], expected)
    assert bool((packed[len(expected) :] == -1).all()) and len(packed) - len(expected) < 7


@pytest.mark.parametrize("drop_last", [False, True])
def test_packing_with_workers_reads_every_token_once_and_pads_at_most_one_tail_per_worker(
    make, drop_last: bool
) -> None:  # type: ignore[no-untyped-def]
    """docs/adapters.md: with N workers each packs its own batches' tokens."""
    tokens = collections.Counter(
        int(t) for b in make(columns=["tokens"], batch_size=50) for t in b["tokens"]
    )
    options = {"columns": ["tokens"], "pack": 7, "batch_size": 3, "pad_value": -1}
    for workers in (2, 3):
        batches = [
            b["tokens"]
            for b in loader(make(drop_last=drop_last, **options), workers)  # type: ignore[attr-defined]
        ]
        got = collections.Counter(int(t) for b in batches for t in b.reshape(-1))
        padding = got.pop(-1, 0)
        short = [b for b in batches if b.shape != (3, 7)]
        if drop_last:
            assert not short and padding == 0
            # Each worker drops a remainder of fewer than batch_size x pack tokens.
            assert got <= tokens and sum((tokens - got).values()) < workers * 3 * 7
        else:
            assert got == tokens
            assert len(short) <= workers and padding < workers * 7


def test_fixed_width_column_of_a_single_piece_is_a_view_of_the_mapping(make) -> None:  # type: ignore[no-untyped-def]
    # Manifest order: the first batch is shard 0's first block of 5 rows, one piece. (A
    # shuffled order may start with a shard's short last block, and the digest that
    # seeds it covers the files' mtimes.)
    ds = make(columns=["uid"], batch_size=5, shuffle=False)
    reader = ds.reader()
    batch = next(iter(reader))
    assert len(batch.pieces) == 1
    tensor = ds.collate(batch)["uid"]
    assert (
        tensor.data_ptr()
        == batch.pieces[0].column(0).buffers()[1].address + 8 * batch.pieces[0].column(0).offset
    )


def test_list_columns_as_offsets_and_padded_agree(make) -> None:  # type: ignore[no-untyped-def]
    for off, pad in zip(make(), make(lists="padded", pad_value=-1), strict=True):
        offsets = off["tokens_offsets"]
        for row in range(len(offsets) - 1):
            values = off["tokens"][offsets[row] : offsets[row + 1]]
            assert torch.equal(pad["tokens"][row, : len(values)], values)
            assert bool((pad["tokens"][row, len(values) :] == -1).all())


def test_a_string_column_is_refused_with_the_fix(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(errors.InputError, match="select the columns"):
        next(iter(make(columns=None)))


@pytest.mark.parametrize("lists", ["offsets", "padded"])
def test_device_prefetcher_on_cpu_yields_the_plain_paths_tensors(make, lists: str) -> None:  # type: ignore[no-untyped-def]
    plain = list(make(lists=lists))
    prefetcher = shardcache.torch.DevicePrefetcher(make(lists=lists), device="cpu", depth=3)
    fetched = list(prefetcher)
    assert len(fetched) == len(plain)
    for a, b in zip(fetched, plain, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key])


def test_device_prefetcher_state_counts_batches_handed_over(make) -> None:  # type: ignore[no-untyped-def]
    full = uids(make())
    prefetcher = shardcache.torch.DevicePrefetcher(make(), device="cpu", depth=2)
    it = iter(prefetcher)
    head = [int(u) for _ in range(3) for u in next(it)["uid"]]
    again = shardcache.torch.DevicePrefetcher(make(), device="cpu")
    again.load_state_dict(prefetcher.state_dict())
    assert head + uids(again) == full


class _FakeRegistrar:
    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.live: dict[int, int] = {}
        self.log: list[str] = []

    def register(self, address: int, size: int) -> bool:
        self.log.append("register")
        if self.refuse:
            return False
        self.live[address] = size
        return True

    def unregister(self, address: int) -> None:
        self.log.append("unregister")
        del self.live[address]


def test_registration_follows_the_mappings_lifetime(make) -> None:  # type: ignore[no-untyped-def]
    ds = make()
    sc = ds.shardcache_dataset()
    settled: list[int] = []
    registrar = _FakeRegistrar()
    registry = _host_memory.Registry(registrar, settle=lambda: settled.append(1))
    sc.add_mapping_listener(registry)
    reader = ds.reader()
    copies = 0
    for batch in reader:
        for piece in batch.pieces:
            address = piece.column(0).buffers()[1].address
            if not registry.covers(address, 8 * len(piece)):
                # Copies (`Dataset._sliced`): the batch that ends a shard's reading,
                # and a batch's head from the shard before, made before the acquire.
                assert len(batch.pieces) == 1 or piece is batch.pieces[0]
                copies += 1
    assert copies >= 1
    assert registrar.log.count("register") == len(SHARDS)
    assert len(registrar.live) == len(SHARDS)  # kept across epochs while resident
    sc.close()  # the reader lets every mapping go: each is unregistered first
    assert registrar.live == {} and registrar.log.count("unregister") == len(SHARDS)
    assert len(settled) == len(SHARDS)


def test_a_refused_registration_leaves_the_range_to_staging(make) -> None:  # type: ignore[no-untyped-def]
    ds = make()
    registry = _host_memory.Registry(_FakeRegistrar(refuse=True), settle=lambda: None)
    ds.shardcache_dataset().add_mapping_listener(registry)
    batch = next(iter(ds.reader()))
    address = batch.pieces[0].column(0).buffers()[1].address
    assert not registry.covers(address, 8) and registry.refused >= 1


def test_import_shardcache_torch_loads_no_framework() -> None:
    # (numpy is not checked: pyarrow itself imports it when it is installed.)
    code = (
        "import sys, shardcache, shardcache.torch, shardcache.batching;"
        "print(sorted(m for m in ('torch', 'torchdata', 'jax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_numpy_batches_match_torch_and_resume(uri: str, tmp_path: Path) -> None:
    import numpy as np

    import shardcache.numpy

    kw = {"cache_dir": str(tmp_path / "cache"), "block_size": 5, "batch_size": 6}
    torch_ds = shardcache.torch.IterableDataset(
        uri, columns=["uid", "tokens"], rank=0, world_size=1, **kw
    )
    with shardcache.numpy.Batches(uri, columns=["uid", "tokens"], rank=0, world_size=1, **kw) as it:
        got = list(it)
        for a, b in zip(got, torch_ds, strict=True):
            for key in a:
                assert np.array_equal(a[key], b[key].numpy())
        first = shardcache.numpy.Batches(uri, columns=["uid"], rank=0, world_size=1, **kw)
        gen = iter(first)
        head = [next(gen)["uid"] for _ in range(2)]
        again = shardcache.numpy.Batches(uri, columns=["uid"], rank=0, world_size=1, **kw)
        again.load_state_dict(first.state_dict())
        rest = [b["uid"] for b in again]
        assert np.array_equal(np.concatenate(head + rest), np.concatenate([b["uid"] for b in got]))
        first.close()
        again.close()
    torch_ds.close()


@pytest.mark.parametrize("extra", [{"columns": ["uid"]}, {"columns": ["tokens"], "pack": 8}])
def test_numpy_batches_set_epoch_between_two_batches_reads_on_and_resumes_exactly(
    uri: str, tmp_path: Path, extra: dict[str, Any]
) -> None:
    import numpy as np

    import shardcache.numpy

    kw: dict[str, Any] = {
        "cache_dir": str(tmp_path / "cache"),
        "block_size": 5,
        "batch_size": 6,
        **extra,
    }
    key = extra["columns"][0]

    def batches() -> shardcache.numpy.Batches:
        return shardcache.numpy.Batches(uri, rank=0, world_size=1, **kw)

    with batches() as plain:
        plain.set_epoch(1)
        epoch1 = [b[key] for b in plain]
    with batches() as moved:
        it = iter(moved)
        next(it)
        next(it)
        moved.set_epoch(1)
        got = [next(it)[key] for _ in range(3)]
        state = json.loads(json.dumps(moved.state_dict()))
        rest = [b[key] for b in it]
    assert state["dataset"]["epoch"] == 1
    assert len(got + rest) == len(epoch1)
    assert all(np.array_equal(a, b) for a, b in zip(got + rest, epoch1, strict=True))
    with batches() as resumed:
        resumed.load_state_dict(state)
        again = [b[key] for b in resumed]
    assert all(np.array_equal(a, b) for a, b in zip(again, rest, strict=True))
    assert len(again) == len(rest)


@pytest.mark.parametrize(
    "extra",
    [
        {"columns": ["uid"]},
        {"columns": ["uid"], "drop_last": True},
        {"columns": ["tokens"], "pack": 8},
    ],
)
def test_numpy_batches_a_new_iter_after_leaving_a_pass_early_goes_on_from_the_next_batch(
    uri: str, tmp_path: Path, extra: dict[str, Any]
) -> None:
    """A second iter() after a break mid-epoch reads the rest of the epoch (it used to
    start the epoch again, handing out the first batches twice); one after a pass that
    reached the end reads the epoch again."""
    import numpy as np

    import shardcache.numpy

    kw: dict[str, Any] = {"cache_dir": str(tmp_path / "cache"), "block_size": 5, "batch_size": 6}
    key = extra["columns"][0]
    with shardcache.numpy.Batches(uri, rank=0, world_size=1, **kw, **extra) as plain:
        epoch = [b[key] for b in plain]
    with shardcache.numpy.Batches(uri, rank=0, world_size=1, **kw, **extra) as batches:
        head = []
        for batch in batches:
            head.append(batch[key])
            if len(head) == 2:
                break
        rest = [b[key] for b in batches]
        again = [b[key] for b in batches]
    assert len(head + rest) == len(epoch)
    assert all(np.array_equal(a, b) for a, b in zip(head + rest, epoch, strict=True))
    assert len(again) == len(epoch)
    assert all(np.array_equal(a, b) for a, b in zip(again, epoch, strict=True))


JAX_LEFT_EARLY = """
import json, sys
import jax
import numpy as np
import shardcache.jax

uri, cache = sys.argv[1:3]
kw = {"cache_dir": cache, "block_size": 5, "batch_size": 4, "columns": ["uid"]}
with shardcache.jax.Batches(uri, **kw) as plain:
    expected = [b["uid"].tolist() for b in plain]
with shardcache.jax.Batches(uri, **kw) as batches:
    prefetcher = shardcache.jax.DevicePrefetcher(batches, depth=3)
    got = []
    for batch in prefetcher:
        got.append(np.asarray(batch["uid"]).tolist())
        if len(got) == 2:
            break
    got += [np.asarray(b["uid"]).tolist() for b in prefetcher]
assert got == expected, (got, expected)
print(json.dumps({"batches": len(got)}))
"""


def test_jax_prefetcher_a_new_pass_after_leaving_one_early_starts_at_the_first_batch_not_handed_over(
    uri: str, tmp_path: Path
) -> None:
    """The batches placed ahead by a pass left early are handed over by the next pass:
    none skipped (the reader under it has gone past them), none repeated."""
    out = subprocess.run(
        [sys.executable, "-c", JAX_LEFT_EARLY, uri, str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["batches"] > 4


def test_the_adapters_set_epoch_takes_numpy_integers_and_refuses_other_types(
    make: torch_datasets.Factory, uri: str, tmp_path: Path
) -> None:
    import numpy as np

    import shardcache.numpy

    one: Any = np.int64(1)
    kw: dict[str, Any] = {"cache_dir": str(tmp_path / "c"), "block_size": 5, "batch_size": 6}
    with shardcache.numpy.Batches(uri, columns=["uid"], rank=0, world_size=1, **kw) as plain:
        plain.set_epoch(1)
        epoch1 = [int(u) for b in plain for u in b["uid"]]
    with shardcache.numpy.Batches(uri, columns=["uid"], rank=0, world_size=1, **kw) as given:
        given.set_epoch(one)
        assert [int(u) for b in given for u in b["uid"]] == epoch1
        assert json.loads(json.dumps(given.state_dict()))["dataset"]["epoch"] == 1
        with pytest.raises(
            errors.InputError, match=re.escape("epoch: expected an int >= 0, found float 1.5")
        ):
            given.set_epoch(1.5)  # type: ignore[arg-type]
    ds = make(columns=["uid"])
    ds.set_epoch(one)
    assert uids(ds) == epoch1
    assert json.loads(json.dumps(ds.state_dict()))["dataset"]["epoch"] == 1
    with pytest.raises(
        errors.InputError, match=re.escape("epoch: expected an int >= 0, found str '1'")
    ):
        ds.set_epoch("1")  # type: ignore[arg-type]


JAX_CHECK = """
import json, sys
import jax
import numpy as np
import shardcache.jax

uri, cache = sys.argv[1:3]
kw = {"cache_dir": cache, "block_size": 5, "batch_size": 4, "columns": ["tokens"], "pack": 8}
with shardcache.jax.Batches(uri, **kw) as plain:
    expected = [b["tokens"] for b in plain]
batches = shardcache.jax.Batches(uri, **kw)
prefetcher = shardcache.jax.DevicePrefetcher(batches, sharding=jax.devices()[0], depth=2)
it = iter(prefetcher)
head = [next(it)["tokens"] for _ in range(2)]
assert isinstance(head[0], jax.Array) and head[0].shape == (4, 8), head[0]
again = shardcache.jax.Batches(uri, **kw)
again.load_state_dict(prefetcher.state_dict())
got = [np.asarray(a) for a in head] + [b["tokens"] for b in again]
assert len(got) == len(expected), (len(got), len(expected))
assert all(np.array_equal(a, b) for a, b in zip(got, expected))
print(json.dumps({"batches": len(got), "waits": prefetcher.stalls.batches}))
"""


def test_jax_prefetcher_places_batches_and_keeps_handed_state(uri: str, tmp_path: Path) -> None:
    # In a process of its own: JAX starts threads, and the DataLoader tests here fork.
    out = subprocess.run(
        [sys.executable, "-c", JAX_CHECK, uri, str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["batches"] > 2 and result["waits"] == 2


def test_split_index_is_checked() -> None:
    with pytest.raises(errors.InputError):
        batching.Split(2, 2)


class _CoverAll:
    registered = refused = 0

    def covers(self, address: int, size: int) -> bool:
        return True


@pytest.mark.parametrize("registered", [True, False])
@pytest.mark.parametrize("extra", [{}, {"lists": "padded"}, {"pack": 5, "columns": ["tokens"]}])
def test_prefetcher_copy_path_assembles_the_plain_paths_tensors(
    make, registered: bool, extra: dict[str, object]
) -> None:  # type: ignore[no-untyped-def]
    # The device path's byte copies and reassembly, run on the CPU: raw value bytes,
    # reinterpreted, concatenated, offsets and padding built where they landed.
    import functools

    ds = make(**extra)
    prefetcher = shardcache.torch.DevicePrefetcher(ds, device="cpu")
    registry = _CoverAll() if registered else None
    keep: list[object] = []
    move = functools.partial(prefetcher._copy, registry=registry, keep=keep)
    plain = make(**extra)
    for batch, expected in zip(ds.reader(), plain, strict=True):
        got = shardcache.torch.collate(batch, lists=ds.lists, pad_value=0, move=move)
        assert got.keys() == expected.keys()
        for key in got:
            assert got[key].dtype == expected[key].dtype
            assert torch.equal(got[key], expected[key])
    assert (prefetcher.stats.direct_bytes > 0) == registered
    assert (prefetcher.stats.staged_bytes > 0) != registered


def test_device_prefetcher_measures_the_loops_waits(make) -> None:  # type: ignore[no-untyped-def]
    prefetcher = shardcache.torch.DevicePrefetcher(make(), device="cpu")
    count = sum(1 for _ in prefetcher)
    assert prefetcher.stalls.batches == count > 0
    assert prefetcher.stalls.wait_seconds > 0
