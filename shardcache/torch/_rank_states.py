"""Every old rank's adapter state, for an elastic resume (W -> W') through the adapter.

`Dataset.load_state_dict` resumes at another world size from the list of every old
rank's *Dataset* state (docs/reading-plan.md, "Elastic resume"): the rows no old rank
consumed are shared among the new ranks. An adapter state wraps one of those in the
batching of one loader process (`batching.Reader.state_dict`), and only some wrappers
say exactly which rows the rank consumed:

- one process per rank (`split [0, 1]`, num_workers=0): `position` is the first row
  not handed out, the rank's consumed prefix;
- not packed mid-batch (`skip` 0): a packed batch partly emitted would have its rows
  read again by a new rank (its tokens repeated);
- a DataLoader worker's state (`split [i, N]`) alone is that worker's cursor only, which
  says nothing of the other workers' batches: refused, with what to commit instead;
- a StatefulDataLoader's state (torchdata) holds every worker's state at the last batch
  the loader yielded. Worker j reads batches j, j+N, … of the rank's stream and the
  loader yields them round-robin, so after k batches every worker's cursor is at or
  past batch k and one's is exactly there: the smallest cursor is the rank's consumed
  prefix. Exact only where every worker's state is that of the last yielded step
  (`_steps_since_snapshot` 0, e.g. snapshot_every_n_steps=1) and not packed (each
  worker packs its own batches and holds its own remainder); the rest is refused.

Pure functions: the adapter loads what they return.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardcache import batching, errors


def dataset_states(states: Sequence[Any], options: batching.Options) -> list[dict[str, Any]]:
    """The `["dataset"]` states of every old rank's adapter state in `states`, checked to
    be exact rank-level positions read with `options`' batching; refused otherwise
    (StateMismatchError saying what was expected and what was found)."""
    if not states:
        raise errors.StateMismatchError(
            "expected the list of every old rank's state from "
            "shardcache.torch.IterableDataset.state_dict(), found an empty list"
        )
    found: list[dict[str, Any]] = []
    for i, state in enumerate(states):
        found.append(_dataset_state(i, state, options))
    return found


def _dataset_state(i: int, state: Any, options: batching.Options) -> dict[str, Any]:
    where = f"state {i} of the list"
    if isinstance(state, dict) and ("_snapshot" in state or "fetcher_state" in state):
        state = _loader_rank_state(where, state, options)
    if not isinstance(state, dict) or not isinstance(state.get("dataset"), dict):
        hint = ""
        if isinstance(state, dict) and "mixture" in state:
            hint = " (a mixture resumes at the world size it was saved at)"
        raise errors.StateMismatchError(
            f"{where}: expected an adapter state from "
            "shardcache.torch.IterableDataset.state_dict() ({'version', 'dataset', "
            f"'split', ...}}), found {_kind(state)}{hint}"
        )
    if state.get("version") != batching.STATE_VERSION:
        raise errors.StateMismatchError(
            f"{where}: expected an adapter state of version {batching.STATE_VERSION}, "
            f"found version {state.get('version')!r}"
        )
    split = state.get("split")
    if not isinstance(split, list | tuple) or list(split) != [0, 1]:
        raise errors.StateMismatchError(
            f"{where}: expected a state of one process per rank (split [0, 1], "
            f"num_workers=0), found split {split!r}: a DataLoader worker's state is that "
            "worker's cursor, not the rows its rank consumed. To resume at another world "
            "size, pass each rank's whole StatefulDataLoader.state_dict() (every "
            "worker's), or ds.state_dict() read with num_workers=0"
        )
    differ = [
        f"{key}: state has {state.get(key)!r}, this dataset has {getattr(options, key)!r}"
        for key in ("batch_size", "pack")
        if state.get(key) != getattr(options, key)
    ]
    if differ:
        raise errors.StateMismatchError(
            f"{where}: cannot resume: saved with other batching ("
            + "; ".join(differ)
            + "); use the same batch_size and pack"
        )
    if state.get("skip", 0) != 0:
        raise errors.StateMismatchError(
            f"{where}: expected a state between two packed batches' rows (skip 0), found "
            f"skip {state.get('skip')!r}: the tokens of its batch already emitted would "
            "be read again by a new rank. Resume at the old world size, or take the "
            "state where skip is 0"
        )
    dataset = state["dataset"]
    assert isinstance(dataset, dict)
    return dataset


def _loader_rank_state(
    where: str, loader: dict[str, Any], options: batching.Options
) -> dict[str, Any]:
    """A StatefulDataLoader's state as one adapter state of its rank (split [0, 1]) at
    the rank's consumed prefix, where that is exact (module docstring)."""
    if "_snapshot" not in loader:
        # num_workers=0: the one iterator's state is the rank's.
        fetcher = loader.get("fetcher_state")
        found = fetcher.get("dataset_iter_state") if isinstance(fetcher, dict) else None
        return found if isinstance(found, dict) else loader.get("dataset_state")  # type: ignore[return-value]
    since = loader.get("_steps_since_snapshot")
    if since != 0:
        raise errors.StateMismatchError(
            f"{where}: a StatefulDataLoader's state taken {since!r} steps after its last "
            "snapshot: expected one taken at a snapshot (_steps_since_snapshot 0; "
            "snapshot_every_n_steps=1 makes every step one), since its workers' cursors "
            "are those of the snapshot"
        )
    if options.pack is not None:
        raise errors.StateMismatchError(
            f"{where}: a StatefulDataLoader's state of packed batches (pack={options.pack}) "
            "with workers: expected one process per rank, found per-worker remainders, "
            "which are no rank-level position; resume at the old world size"
        )
    snapshot = loader["_snapshot"]
    workers = snapshot.get("_worker_snapshots") if isinstance(snapshot, dict) else None
    if not isinstance(workers, dict) or not workers:
        raise errors.StateMismatchError(
            f"{where}: expected a StatefulDataLoader state with its workers' snapshots "
            f"(_snapshot._worker_snapshots), found {_kind(snapshot)}"
        )
    cursors: list[dict[str, Any]] = []
    for name, worker in sorted(workers.items()):
        fetcher = worker.get("fetcher_state") if isinstance(worker, dict) else None
        state = fetcher.get("dataset_iter_state") if isinstance(fetcher, dict) else None
        if state is None and isinstance(worker, dict):
            state = worker.get("dataset_state")
        if not isinstance(state, dict) or not isinstance(state.get("dataset"), dict):
            raise errors.StateMismatchError(
                f"{where}: {name}: expected the worker's state from "
                f"shardcache.torch.IterableDataset, found {_kind(state)}"
            )
        cursors.append(state)
    count = len(cursors)
    splits = sorted(tuple(c.get("split") or ()) for c in cursors)
    if splits != [(j, count) for j in range(count)]:
        raise errors.StateMismatchError(
            f"{where}: expected the states of workers 0..{count - 1} of {count}, found "
            f"splits {[list(s) for s in splits]}"
        )
    epochs = {c["dataset"].get("epoch") for c in cursors}
    if len(epochs) != 1:
        raise errors.StateMismatchError(
            f"{where}: expected every worker in one epoch, found epochs {sorted(epochs)}"
        )
    first = min(cursors, key=lambda c: int(c["dataset"].get("position") or 0))
    return dict(first, split=[0, 1])


def state_epoch(state: Any) -> int:
    """The epoch a checkpointed data state resumes in, to start the training loop at:
    of an `IterableDataset.state_dict()`, a StatefulDataLoader's `state_dict()` (with
    workers, the earliest of theirs) or a `Dataset.state_dict()`. StatefulDataLoader
    hands the dataset its state only at `iter(loader)`, so `ds.epoch` cannot say it
    before the loop starts; this reads it from the state itself."""
    found = _dataset_parts(state)
    epochs = [e for d in found if isinstance(e := d.get("epoch"), int) and not isinstance(e, bool)]
    if not found or len(epochs) != len(found):
        hint = (
            " (a mixture has no epochs)" if isinstance(state, dict) and "mixture" in state else ""
        )
        raise errors.StateMismatchError(
            "expected a state of shardcache.torch.IterableDataset.state_dict(), of a "
            "StatefulDataLoader over one, or of Dataset.state_dict(), with an epoch; "
            f"found {_kind(state)}{hint}"
        )
    return min(epochs)


def _dataset_parts(state: Any) -> list[dict[str, Any]]:
    """Every `Dataset` state inside `state` (see `state_epoch`)."""
    if not isinstance(state, dict):
        return []
    if "digest" in state and "epoch" in state:
        return [state]
    if isinstance(state.get("dataset"), dict):
        return [state["dataset"]]
    if "_snapshot" in state:
        snapshot = state["_snapshot"]
        workers = snapshot.get("_worker_snapshots") if isinstance(snapshot, dict) else None
        if isinstance(workers, dict) and workers:
            return [d for worker in workers.values() for d in _dataset_parts(worker)]
        if isinstance(snapshot, dict):
            return _dataset_parts(snapshot)
        return []
    fetcher = state.get("fetcher_state")
    inner = fetcher.get("dataset_iter_state") if isinstance(fetcher, dict) else None
    if inner is None:
        inner = state.get("dataset_state")
    return _dataset_parts(inner)


def _kind(state: Any) -> str:
    if isinstance(state, dict):
        return f"a dict with keys {sorted(map(str, state))[:8]}"
    return type(state).__name__
