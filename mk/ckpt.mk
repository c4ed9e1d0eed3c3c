# The checkpoint benchmark (not a test): agent upload vs raw parallel PUT, commit stall.
.PHONY: bench-ckpt
bench-ckpt: install tools-minio
	$(PY) bench/ckpt.py --minio $(MINIO_DIR)/minio
