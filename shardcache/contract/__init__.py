"""The contract between the operator, the sidecar and the trainer, defined once.

Everything that crosses a process boundary lives here: the table of environment
variables the webhook writes into a pod and the sidecar, the checkpoint agent and the
client read (`variables`: name, type, spec field, default, readers), the one set of
parsers they are all read with (`parsers`), short names and the shared volume's layout
(`names`, re-exported here), the sources of a multi-source mount (`mixture_sources`),
and the control protocol spoken over the pod's Unix socket (`protocol`). Each side
imports this package; none of them defines a shared name or default of its own.
"""

from __future__ import annotations

from shardcache.contract.names import *  # noqa: F403
