"""The project's container images, built from one definition (images/image.toml).

`images.build.archives()` returns the OCI archive of each image, building it first
when its content key has no archive yet (see images/README.md).
"""
