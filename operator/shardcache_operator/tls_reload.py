"""The webhook's serving certificate, reloaded when its files change, without a restart.

cert-manager renews the Secret the operator pod mounts and kubelet swaps the mounted
files (a `..data` symlink pointing at a new directory, so both files change at once).
The listening socket stays as it is: `CurrentContext` hands each new TLS connection to
the context loaded last, and connections already open (in-flight reviews, the API
server's keep-alive connections) finish on the one they started with. A pair of files
that does not load (a key that does not match its certificate, halfway through a copy
written file by file) is retried at the next check while the last good pair is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf
from cryptography import x509

logger = logging.getLogger(__name__)

#: How often the files are read. kubelet refreshes a Secret volume within about a minute
#: of a renewal; reading two small files every few seconds costs nothing.
CHECK_INTERVAL_SECONDS = 5.0


class CurrentContext(ssl.SSLContext):
    """A server SSL context that delegates each new connection to `current`.

    asyncio (and aiohttp above it) takes one context when the server starts and calls
    its `wrap_bio` per connection; swapping `current` is therefore atomic between
    handshakes and never touches a connection already open. Loading a new certificate
    into one live context instead would leave it half-changed when the key does not
    load, and would keep a certificate of another key type next to the new one.
    """

    current: ssl.SSLContext

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        return self.current.wrap_bio(*args, **kwargs)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        return self.current.wrap_socket(*args, **kwargs)


def load(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A server context serving the certificate chain and key in these files.

    Raises ssl.SSLError (a key that does not match its certificate, not PEM) or OSError.
    """
    context = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context


def fingerprint(*files: Path) -> str:
    """A digest of the files' contents (not their times: kubelet's swap keeps neither)."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def describe(cert_file: Path) -> str:
    """The leaf's serial and expiry, for the log line of a reload."""
    try:
        leaf = x509.load_pem_x509_certificate(cert_file.read_bytes())
    except (OSError, ValueError):
        return "unreadable"
    return (
        f"serial {leaf.serial_number:x}, valid until {leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    )


class Reloader:
    """Holds the `CurrentContext` of the webhook server and keeps it on the files."""

    def __init__(
        self, cert_file: Path, key_file: Path, *, interval: float = CHECK_INTERVAL_SECONDS
    ) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.interval = interval
        # Read before loading: a change in between is found at the first check.
        self._loaded = fingerprint(cert_file, key_file)
        self.context = CurrentContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.current = load(cert_file, key_file)
        self._refused = ""

    def check(self) -> bool:
        """Load the files if they changed since the pair now served; True if it did.

        Never raises: a pair that cannot be read or loaded keeps the current one served
        and is tried again at the next check.
        """
        files = (self.cert_file, self.key_file)
        try:
            seen = fingerprint(*files)
        except OSError as exc:
            self._warn_once(f"files:{exc}", f"cannot be read ({exc})")
            return False
        if seen == self._loaded:
            return False
        try:
            fresh = load(*files)
            # Changed again while loading (a copy still in progress): the context may
            # hold an older certificate with a newer key; take it at the next check.
            if fingerprint(*files) != seen:
                return False
        except (OSError, ssl.SSLError) as exc:
            self._warn_once(seen, f"do not load ({exc})")
            return False
        self.context.current = fresh
        self._loaded, self._refused = seen, ""
        logger.info(
            "webhook certificate reloaded from %s (%s); new connections get it",
            self.cert_file,
            describe(self.cert_file),
        )
        return True

    def _warn_once(self, key: str, what: str) -> None:
        # Once per bad pair, not every few seconds while it stays.
        if key == self._refused:
            return
        self._refused = key
        logger.warning(
            "the webhook certificate files %s and %s changed but %s: still serving the "
            "certificate loaded before; checking again every %g s (a renewal writes a "
            "certificate and the key it was issued for)",
            self.cert_file,
            self.key_file,
            what,
            self.interval,
        )

    async def run(self) -> None:
        """Check every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            self.check()


class WebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server on a `Reloader`'s context, checking its files.

    kopf is given the file paths too (it reads the CA for managed mode's caBundle and
    loads the pair once more into the outer context, which serves nothing), but not
    its own file check: that one closes the listening socket and opens a new one on a
    change, which refuses the API server's calls in between.
    """

    #: kopf's file check, pushed past any process's life (about 30 years).
    NEVER_SECONDS = 1e9

    def __init__(self, reloader: Reloader, **kwargs: Any) -> None:
        super().__init__(
            context=reloader.context,
            certfile=reloader.cert_file,
            pkeyfile=reloader.key_file,
            file_check_interval=self.NEVER_SECONDS,
            **kwargs,
        )
        self.reloader = reloader

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        checking = asyncio.create_task(self.reloader.run(), name="webhook-certificate")
        try:
            async for config in super().__call__(fn):
                yield config
        finally:
            checking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checking
