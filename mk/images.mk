# The container images (images/README.md), all from one definition, images/image.toml:
#   make image-archives   build them here as OCI archives, no Docker: Debian packages
#                         (mmdebstrap) + the project's wheels, cached under
#                         $(TOOLS_CACHE)/images/<content key>/ (a second run is a no-op)
#   make images           the same images with docker, podman or buildah (the first on
#                         PATH, or CONTAINER_ENGINE=...),
#                         from the rootfs tarball and a Dockerfile rendered from the
#                         definition; tags localhost/shardcache:<version> and
#                         localhost/shardcache-trainer:<version>
# Debian's mmdebstrap builds the rootfs; runc and containerd run the image tests
# (tests/integration/test_images.py). Installed with apt-get when missing.
IMAGE_TOOLS := mmdebstrap runc containerd
IMAGE_CONTEXT := .images
CONTAINER_ENGINE ?= $(shell command -v docker 2>/dev/null || command -v podman 2>/dev/null || command -v buildah 2>/dev/null)

.PHONY: image-tools image-archives images
image-tools:
	@missing=; for t in $(IMAGE_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing$$missing (Debian packages)"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing >/dev/null; \
	fi

image-archives: install image-tools
	$(PY) -m images.build

images: install image-tools
	@test -n "$(CONTAINER_ENGINE)" || { echo "make images: no docker, podman or buildah on PATH (make image-archives needs none)"; exit 2; }
	for image in shardcache trainer; do \
		ref=$$($(PY) -m images.build docker-context $$image $(IMAGE_CONTEXT)/$$image) && \
		$(CONTAINER_ENGINE) build -t $$ref $(IMAGE_CONTEXT)/$$image || exit 1; \
	done

TEST_PREREQS += image-archives
