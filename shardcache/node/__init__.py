"""Everything that touches node-local OS resources lives here, and nowhere else.

The disk tier (a node-local directory shared by every sidecar on the node), the
memory tier (a memory-backed directory shared by the sidecar and the trainer, whose
files the trainer memory-maps), the file locks that make both safe across processes,
and the names of those resources (`names`). Keeping them in one subpackage makes the
rules for crash safety (tmp + fsync + rename, checksums, leases held as file locks that
the kernel drops when a process dies) visible in one place.
"""
