"""The data states a run published with its checkpoints, read from the object store.

A checkpoint URI holds either one run's checkpoints directly (`step-…/checkpoint.json`,
one pod or a single process), or one prefix per rank, `rank-<r>/step-…`, which is what
the webhook gives ranked pods (docs/checkpoints.md). Only published checkpoints count:
a step directory without a manifest is an upload in flight or one set aside by
`shardcache skip`.

Every read of the store retries transient errors as dataset reads do
(`source.RetryPolicy`, `RETRY`) and fails at once on a permanent one (refused
credentials, no bucket); either way the error is a `ShardcacheError` naming the store
URI, never a bare OSError: `shardcache skip`, `lineage` and `diff` report it as one line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TypeVar

import pyarrow.fs as pafs

from shardcache import errors, manifests, source, states
from shardcache.checkpoint import layout
from shardcache.contract import parsers
from shardcache.lineage import history

T = TypeVar("T")

#: For `fullmatch`: with `match`, a `$` takes "rank-1\n" for rank 1 (and `\d` takes
#: other scripts' digits, which int() reads too).
_RANK_DIR = re.compile(r"rank-([0-9]+)")

#: How the store's reads (and `shardcache skip`'s writes) are retried: as the dataset's
#: (a store restart is ridden out, a minute of refused connections is an outage).
RETRY = source.RetryPolicy()


def open_uri(
    uri: str, *, storage_options: Mapping[str, str] | None = None
) -> tuple[pafs.FileSystem, str]:
    return source.filesystem(uri, storage_options=storage_options)


def uri_argument(text: str) -> str:
    """argparse `type=` of a `--checkpoint-uri`: a URI of the contract's form
    (`parsers.URI`: `s3://bucket/run`, `file:///dir`), as `$SHARDCACHE_CHECKPOINT_URI`
    and `spec.checkpoint.uri` are, so the value a pod was given can be pasted here and
    back. A bare path is refused naming its `file://` form; `s3//bucket/run`, a typo,
    would otherwise be read as the empty local directory `./s3/bucket/run`."""
    return parsers.URI.flag_type(text)


def display(fs: pafs.FileSystem, path: str) -> str:
    """`path` of `fs` as a URI, for messages: s3://bucket/run, file:///ckpt/run. The
    store's own errors name a key and a bucket; the user gave a URI."""
    scheme = "file" if fs.type_name == "local" else fs.type_name
    return f"{scheme}://{path}"


def retried(op: Callable[[], T], *, what: str) -> T:
    """`op` against the checkpoint store, retried as `RETRY` says (`source.with_retries`)."""
    return source.with_retries(op, what=what, policy=RETRY)


def rank_prefixes(fs: pafs.FileSystem, prefix: str) -> dict[int | None, str]:
    """{rank: prefix} for per-rank prefixes, else {None: prefix}. One try: the store's
    OSError is the caller's to retry (`ranks`; the sidecar's agent retries with its own
    policy, which a stop ends)."""
    infos = fs.get_file_info(pafs.FileSelector(prefix, allow_not_found=True, recursive=False))
    found = {
        int(m.group(1)): f"{prefix}/{info.base_name}"
        for info in infos
        if info.type == pafs.FileType.Directory and (m := _RANK_DIR.fullmatch(info.base_name))
    }
    return dict(sorted(found.items())) if found else {None: prefix}


def ranks(fs: pafs.FileSystem, prefix: str) -> dict[int | None, str]:
    """`rank_prefixes`, retried as `RETRY` says, naming the store in its errors."""
    return retried(
        lambda: rank_prefixes(fs, prefix),
        what=f"listing the checkpoint store {display(fs, prefix)}",
    )


def checkpoint_manifests(fs: pafs.FileSystem, prefix: str) -> list[layout.CheckpointManifest]:
    """The published checkpoints under one prefix, oldest step first."""
    complete, _ = retried(
        lambda: layout.list_steps(fs, prefix),
        what=f"listing the checkpoints under {display(fs, prefix)}",
    )
    out = []
    for step in complete:
        where = layout.manifest_path(prefix, step)
        raw = _read(fs, where)
        if raw is not None:  # deleted by retention since the listing
            out.append(layout.CheckpointManifest.from_json(raw, where=where))
    return out


def _read(fs: pafs.FileSystem, where: str) -> object | None:
    return retried(lambda: layout.read_json(fs, where), what=f"reading {display(fs, where)}")


def chains(
    fs: pafs.FileSystem, prefix: str, *, stateless: list[str] | None = None
) -> dict[int, list[history.Checkpoint]]:
    """Every rank's published checkpoints with their data states. A checkpoint
    without one (model only) is refused, or, given a `stateless` list, left out and
    named there."""
    out: dict[int, list[history.Checkpoint]] = {}
    for expected, rank_prefix in ranks(fs, prefix).items():
        for manifest in checkpoint_manifests(fs, rank_prefix):
            where = layout.manifest_path(rank_prefix, manifest.step)
            if manifest.data_state is None and stateless is not None:
                stateless.append(where)
                continue
            if manifest.data_state is None:
                raise errors.InputError(
                    f"{where}: checkpoint step {manifest.step} has no data state: lineage "
                    "needs checkpoints committed with data_state=dataset.state_dict()"
                )
            mixed = manifest.data_state
            if isinstance(mixed, dict) and mixed.get("kind") == states.MIXTURE_KIND:
                # What states.parse says (use one source's state) is no help here: the
                # checkpoints are the run's, and lineage cannot pick a source for them.
                raise errors.InputError(
                    f"{where}: checkpoint step {manifest.step} carries a mixture's data "
                    f"state (shardcache.mix, sources "
                    f"{sorted(mixed.get('sources') or {})}), not one "
                    "dataset's: lineage follows the checkpoints of a run that read one "
                    "dataset, and does not read a mixture's yet"
                )
            state = states.parse(manifest.data_state, where=f"{where} data_state")
            if expected is not None and state.rank != expected:
                raise errors.InputError(
                    f"{where}: the data state is of rank {state.rank}, but it is published "
                    f"under rank-{expected}"
                )
            out.setdefault(state.rank, []).append(history.Checkpoint(manifest.step, state))
    return out


def history_of(
    manifest: manifests.Manifest, checkpoint_uri: str, *, stateless: list[str] | None = None
) -> history.History:
    """The run published under `checkpoint_uri`, over the dataset `manifest` pins
    (`stateless`: as `chains` takes it)."""
    fs, prefix = open_uri(checkpoint_uri)
    return history.build(
        manifest.digest,
        manifest.shard_rows,
        chains(fs, prefix, stateless=stateless),
        where=checkpoint_uri,
    )
