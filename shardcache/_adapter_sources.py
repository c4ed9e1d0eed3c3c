"""What a framework adapter reads, and how each loader process opens it.

The adapters (`shardcache.torch`, `shardcache.numpy`, `shardcache.jax`) read one
dataset or a mixture of several:

* `source` a URI or None, the options `shardcache.open()`'s: one `Dataset`;
* `source` a `shardcache.Mixture` already opened (by `shardcache.mix` or
  `shardcache.open_mixture`): read in this process only, since its sources' caches and
  sockets belong to it;
* `mixture={"web": uri, "code": uri}` with `weights=` (and `mix_seed=`): every process
  opens each URI with the same open options, and mixes them;
* `mixture=True`: the pod's multi-source DatasetMount (`spec.mixture`), through
  `shardcache.open_mixture()`, its weights and seed unless `weights=`/`mix_seed=` say
  otherwise.

An `Opener` is the picklable recipe: a DataLoader worker gets a copy and opens its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardcache import (
    _open,
    _open_mixture,
    _open_options,
    batching,
    datasets,
    errors,
    mixture_batching,
    mixtures,
)

#: `shardcache.open()` options that `open_mixture()` takes too (the plan and resume).
MOUNT_MIXTURE_OPTIONS = (
    "mount",
    "shuffle",
    "seed",
    "rank",
    "world_size",
    "epoch",
    "block_size",
    "window",
    "resume_from",
)

Source = datasets.Dataset | mixtures.Mixture
Reader = batching.Reader | mixture_batching.MixtureReader


@dataclasses.dataclass(frozen=True)
class Opener:
    """How a process opens what an adapter reads (see the module docstring)."""

    #: `shardcache.open()`'s arguments, rank and world size included.
    open_args: Mapping[str, Any]
    #: None: one dataset; a mapping {name: URI}; True: the mount's `spec.mixture`.
    mixture: Mapping[str, str] | bool | None = None
    weights: mixtures.Weights | None = None
    mix_seed: int | None = None

    @classmethod
    def of(
        cls,
        open_args: Mapping[str, Any],
        *,
        mixture: Mapping[str, str] | bool | None,
        weights: mixtures.Weights | None,
        mix_seed: int | None,
    ) -> Opener:
        """Check the options for what they open; `InputError` names what is wrong."""
        unknown = sorted(set(open_args) - set(_open_options.KINDS))
        if unknown:
            raise errors.InputError(f"unknown option(s) {unknown} for shardcache.open()")
        given = {k: v for k, v in open_args.items() if v is not None}
        if mixture is None or mixture is False:
            if weights is not None or mix_seed is not None:
                raise errors.InputError(
                    "weights and mix_seed: expected only with mixture=, found "
                    f"weights={weights!r}, mix_seed={mix_seed!r}"
                )
            _open_options.check(dict(open_args))
            return cls(dict(open_args))
        if given.get("source_uri") is not None:
            raise errors.InputError(
                "mixture=: expected no source URI (the mixture names its sources), found "
                f"{given['source_uri']!r}"
            )
        if mix_seed is not None and (isinstance(mix_seed, bool) or not isinstance(mix_seed, int)):
            raise errors.InputError(f"mix_seed: expected an int, found {mix_seed!r}")
        if mixture is True:
            extra = sorted(set(given) - set(MOUNT_MIXTURE_OPTIONS))
            if extra:
                raise errors.InputError(
                    "mixture=True reads the pod's multi-source DatasetMount through its "
                    f"sidecar: expected only {list(MOUNT_MIXTURE_OPTIONS)}, found {extra}"
                )
            return cls(dict(given), True, weights, mix_seed)
        if not isinstance(mixture, Mapping) or not mixture:
            raise errors.InputError(
                "mixture: expected True (the mount's spec.mixture) or a mapping "
                f"{{name: URI}} of at least one source, found {mixture!r}"
            )
        if weights is None:
            raise errors.InputError(
                "mixture={...}: expected weights= ({name: weight} or a schedule), found none"
            )
        if given.get("resume_from") is not None:
            raise errors.InputError(
                "mixture={...}: resume_from is not taken here; load the state the adapter "
                "saved with its load_state_dict()"
            )
        for name, uri in mixture.items():
            if not isinstance(name, str) or not isinstance(uri, str):
                raise errors.InputError(
                    f"mixture: expected {{name: URI}} strings, found {name!r}: {uri!r}"
                )
            _open_options.check({**open_args, "source_uri": uri})
        # Checked here so a bad schedule fails before any process opens a cache.
        mixtures.Schedule.of(weights, names=list(mixture))
        return cls(dict(open_args), dict(mixture), weights, mix_seed)

    def open(self) -> Source:
        """Open it in this process."""
        if self.mixture is None:
            return _open.open(**self.open_args)
        if self.mixture is True:
            args = {k: v for k, v in self.open_args.items() if k != "source_uri"}
            return _open_mixture.open_mixture(weights=self.weights, mix_seed=self.mix_seed, **args)
        assert isinstance(self.mixture, Mapping) and self.weights is not None
        opened: dict[str, datasets.Dataset] = {}
        try:
            for name, uri in self.mixture.items():
                opened[name] = _open.open(**{**self.open_args, "source_uri": uri})
            return mixtures.mix(
                opened, weights=self.weights, seed=0 if self.mix_seed is None else self.mix_seed
            )
        except BaseException:
            for ds in opened.values():
                ds.close()
            raise


def reader(
    source: Source,
    options: batching.Options,
    split: batching.Split | None = None,
    *,
    defer_gather: bool = False,
) -> Reader:
    """The batch reader of `source` for one loader process (`defer_gather`: see
    `batching.Reader`)."""
    if isinstance(source, mixtures.Mixture):
        return mixture_batching.MixtureReader(source, options, split, defer_gather=defer_gather)
    return batching.Reader(source, options, split, defer_gather=defer_gather)
