"""`make bench-peers`: shardcache side by side with the data loaders people use today.

dataset.py generates the Parquet data and its expected checksum, convert.py writes each
peer's own format with the peer's own writer, loaders/ adapts each loader to one
interface, runner.py measures one loader in its own process, harness.py runs them all
and reports (table, docs/benchmarks.md, chart). See docs/benchmarks.md.
"""
