"""The contract between the operator, the sidecar and the trainer, defined once.

Everything that crosses a process boundary lives here: the environment variables the
webhook writes into a pod and the sidecar, the checkpoint agent and the client read
(`names`), and the control protocol spoken over the pod's Unix socket (`protocol`).
Each side imports this package; none of them defines a shared name of its own.
"""

from __future__ import annotations

from shardcache.contract.names import *  # noqa: F403
