"""An object store's credentials that may be replaced while the process runs.

A sidecar's credentials come from its DatasetMount's Secret, as environment variables
(which never change for a running container) and, mounted by the webhook, as files in
`$SHARDCACHE_CREDENTIALS_DIR` (which the kubelet updates when the Secret changes,
typically within a minute or two). A training job runs for weeks; a key rotated in the
Secret, the old one revoked, would otherwise fail every cold fetch and every checkpoint
upload until the pod restarted. So whoever holds a filesystem of the source keeps it in
a `Renewable`: when the store refuses the credentials in use (`errors.AccessDeniedError`)
it asks `renewed`, which reads the files again and, where they changed, makes a new
filesystem to try once more with.

Only the credentials are read from the files (`KEYS`): the endpoint and region stay the
environment's, which the operator's endpoint policy judged when it admitted the pod.
Where the directory holds none of them (no Secret, or outside Kubernetes) the
environment alone is used, exactly as `source.filesystem` reads it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path

import pyarrow.fs as pafs

from shardcache import contract, errors, source, uris

log = logging.getLogger(__name__)

#: The variables read from the directory, each a file of that name (a Secret's key).
KEYS = (
    contract.ENV_S3_ACCESS_KEY_ID,
    contract.ENV_S3_SECRET_ACCESS_KEY,
    contract.ENV_S3_SESSION_TOKEN,
)
#: Bytes of a credentials file read at most: a session token is under 2 KiB.
MAX_BYTES = 64 << 10


def read(directory: Path | None) -> dict[str, str]:
    """The credentials files of `directory` (those of `KEYS` present), as text; empty
    when it does not exist or holds none. A file that cannot be read counts as absent
    (logged): the caller keeps what it uses."""
    if directory is None:
        return {}
    found: dict[str, str] = {}
    for key in KEYS:
        path = directory / key
        try:
            with path.open("rb") as file:
                data = file.read(MAX_BYTES + 1)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("credentials file %s cannot be read: %s", path, exc)
            continue
        if len(data) > MAX_BYTES:
            log.warning("credentials file %s is over %d bytes: not read", path, MAX_BYTES)
            continue
        found[key] = data.decode("utf-8", errors="replace")
    return found


def options(found: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str] | None:
    """Storage options for `source.filesystem`: the environment with the credentials
    `found` in place of its own (all of `KEYS` together: a new key pair beside an old
    session token would only be refused); None where none was found, so that the
    environment is read as it always was."""
    if not found:
        return None
    merged = {key: value for key, value in environ.items() if key not in KEYS}
    merged.update(found)
    return merged


class Renewable:
    """The filesystem of `uri`, made again with the credentials in `directory` when the
    store refuses those in use (`renewed`). Shared by the threads that read the source.
    """

    def __init__(
        self,
        uri: str,
        directory: Path | None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.uri = uri
        self.directory = directory
        self._environ = os.environ if environ is None else environ
        self._lock = threading.Lock()
        self._seen = read(directory)
        #: The filesystem in use, and the URI's path in it.
        self.fs, self.path = source.filesystem(uri, storage_options=self.storage_options())

    def storage_options(self) -> dict[str, str] | None:
        """The options the current filesystem was made with (None: the environment)."""
        return options(self._seen, self._environ)

    def renewed(self, used: pafs.FileSystem) -> pafs.FileSystem | None:
        """A filesystem to try again with after the store refused `used`'s credentials:
        one another thread made since `used`, or one made now with the directory's
        credentials where they differ from those in use; None where they do not (the
        refusal stands)."""
        with self._lock:
            if self.fs is not used:
                return self.fs
            found = read(self.directory)
            if not found or found == self._seen:
                return None
            try:
                fs, _ = source.filesystem(self.uri, storage_options=options(found, self._environ))
            except errors.InputError as exc:  # a pair half written by hand, a stray newline
                log.warning(
                    "the credentials in %s changed but cannot be used: %s", self.directory, exc
                )
                return None
            self._seen, self.fs = found, fs
        log.warning(
            "the store refused the credentials in use for %s; using the ones now in %s",
            uris.redact(self.uri),
            self.directory,
        )
        return fs
