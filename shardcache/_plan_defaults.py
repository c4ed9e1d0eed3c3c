"""The reading-plan defaults of `shardcache.open()`: explicit argument, the pod's
DatasetMount, then the library's default.

In an injected pod the sidecar warms its cache (its startup plan) with the mount's
`spec.sharding` seed, shuffle, granularity, block size and window. A trainer that left
those out of `open()` used to read with the library's defaults instead: another order
than the one the sidecar prefetched, and another than the mount's author asked for.
The webhook writes the same values into the trainer containers (the contract table's
rows read by `Reader.TRAINER`), and `open()` takes them from there when reading through
the sidecar.

They describe the pod's first mount (the first name in $SHARDCACHE_MOUNTS), so they
apply only when that is the mount being opened: a trainer that opens a second mount of
the pod gets the library's defaults, never another mount's plan. Embedded mode (a URI)
never takes them: that dataset is not the mount's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from shardcache import plans
from shardcache.contract import variables


@dataclasses.dataclass(frozen=True)
class PlanDefaults:
    """The plan settings `open()` uses for the arguments it was not given."""

    #: True, False, "block" or "sample" (`plans.shuffle_mode`).
    shuffle: bool | str
    seed: int
    block_size: int
    #: The mode `shuffle=True` means: the mount's `sharding.granularity` in a pod, so a
    #: trainer that asks for "a shuffle" reads the order the sidecar warmed up for.
    granularity: str
    window: int

    def mode(self) -> tuple[bool, str]:
        """(shuffle, granularity) of the plan: `shuffle` True takes `granularity`."""
        if self.shuffle is True:
            return True, self.granularity
        return plans.shuffle_mode(self.shuffle)


#: Library defaults (the contract table's, which the sidecar uses too): embedded mode,
#: and a sidecar mount the env does not describe.
LIBRARY = PlanDefaults(
    shuffle=variables.SHUFFLE.required_default,
    seed=variables.SEED.required_default,
    block_size=variables.BLOCK_SIZE.required_default,
    granularity=variables.SHUFFLE_GRANULARITY.required_default,
    window=variables.SHUFFLE_WINDOW.required_default,
)


def describes(environ: Mapping[str, str], mount: str | None) -> bool:
    """Whether the plan variables in `environ` are those of `mount` (None: the mount
    $SHARDCACHE_MOUNT names). Without $SHARDCACHE_MOUNTS (not written by the webhook:
    a sidecar set up by hand) whatever plan variables were set apply."""
    injected = variables.MOUNTS.get(environ)
    if not injected:
        return True
    opened = mount if mount is not None else variables.MOUNT.get(environ)
    return opened is None or opened == injected[0]


def from_env(environ: Mapping[str, str], *, mount: str | None) -> PlanDefaults:
    """The defaults for reading `mount` through the pod's sidecar.

    Raises `InputError` naming the variable when one is set to a value it does not
    accept (a hand-edited pod), rather than reading with a plan nobody asked for.
    """
    if not describes(environ, mount):
        return LIBRARY
    shuffle = variables.SHUFFLE.get(environ)
    seed = variables.SEED.get(environ)
    block_size = variables.BLOCK_SIZE.get(environ)
    granularity = variables.SHUFFLE_GRANULARITY.get(environ)
    window = variables.SHUFFLE_WINDOW.get(environ)
    return PlanDefaults(
        shuffle=LIBRARY.shuffle if shuffle is None else shuffle,
        seed=LIBRARY.seed if seed is None else seed,
        block_size=LIBRARY.block_size if block_size is None else block_size,
        granularity=LIBRARY.granularity if granularity is None else granularity,
        window=LIBRARY.window if window is None else window,
    )


def resolve(
    defaults: PlanDefaults,
    *,
    shuffle: bool | str | None,
    seed: int | None,
    block_size: int | None,
    window: int | None = None,
) -> PlanDefaults:
    """`defaults` with every argument that was given in its place: explicit wins
    (`shuffle=True` keeps the default granularity, "block" or "sample" replaces it)."""
    return dataclasses.replace(
        defaults,
        shuffle=defaults.shuffle if shuffle is None else shuffle,
        seed=defaults.seed if seed is None else seed,
        block_size=defaults.block_size if block_size is None else block_size,
        window=defaults.window if window is None else window,
    )
