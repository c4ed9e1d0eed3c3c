# The checkpoint benchmark (not a test): agent upload vs raw parallel PUT, commit stall.
.PHONY: bench-ckpt
bench-ckpt: install tools-minio
	$(PY) bench/ckpt.py --minio $(MINIO_DIR)/minio

# The crash matrix at random (nightly size, not in `make test`): >= 100 SIGKILLs at
# named fault points, each process restarted and every invariant checked. The fixed,
# representative set runs in `make test` (tests/integration/test_crash_matrix.py).
SOAK_KILLS ?= 100
.PHONY: soak
soak: install tools-minio
	$(PY) -m tests.crash_soak --kills $(SOAK_KILLS) --minio $(MINIO_DIR)/minio $(SOAK_ARGS)

# The flake check (issue 17): `make test` FLAKE_RUNS times back to back, each on a fresh
# clone of HEAD, with a CPU burner started by the check itself. Not part of `make test`.
FLAKE_RUNS ?= 3
FLAKE_ARGS ?=
.PHONY: flake-check
flake-check: install
	$(PY) -m tests.flake_check --runs $(FLAKE_RUNS) $(FLAKE_ARGS)
