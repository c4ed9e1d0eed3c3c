"""Every item of a Kubernetes list, read in pages.

Without `limit`, a list of every namespace or every DatasetMount of a large cluster is
one response of many megabytes that the API server builds whole; with it, the server
hands out pages and a `continue` token with each until the last. The uninstall guard
and the node-cache reclaim read their lists this way; each page is one call of theirs,
so each keeps its own client and error handling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

#: Items per page: kubectl's default chunk size.
PAGE_SIZE = 500

#: One page: called with the previous page's `continue` token (None for the first),
#: returns its items and the next token (None or "" after the last page).
Fetch = Callable[[str | None], tuple[Sequence[T], str | None]]


def every_item(fetch: Fetch[T]) -> list[T]:
    """The items of every page, in the order the API server listed them."""
    found: list[T] = []
    token: str | None = None
    while True:
        items, token = fetch(token)
        found.extend(items)
        if not token:
            return found
