"""What a decode may take: a byte and a row budget, checked while it decodes.

A format whose decoded size its metadata cannot tell (JSON Lines) decodes piece by
piece and stops as soon as a budget is spent, so a hostile file never reaches memory
beyond its budget plus one piece (issue 13; docs/security.md).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Budget:
    #: Bytes the decoded shard may take (Arrow buffers), or None: unbounded.
    bytes: int | None = None
    #: Rows it may have (the manifest's count), or None: unbounded.
    rows: int | None = None


UNBOUNDED = Budget()


#: What an `OverBudget` is about.
BYTES, ROWS, LINE, FIELDS, DEPTH = "bytes", "rows", "line", "fields", "nesting levels"


class OverBudget(ValueError):
    """A decode stopped because the shard is over its budget. `what` is `BYTES`, `ROWS`,
    `LINE` (bytes of one line), `FIELDS` (distinct fields) or `DEPTH` (nesting of one
    line); `found` a lower bound of
    what the shard holds, `limit` the budget."""

    def __init__(self, what: str, *, found: int, limit: int) -> None:
        if what == LINE:
            message = f"has a line of over {found} bytes, expected lines of at most {limit}"
        elif what == DEPTH:
            message = f"has a line nested {found} levels deep, expected at most {limit}"
        else:
            message = f"decodes to over {found} {what}, expected at most {limit}"
        super().__init__(message + " (found so far; decoding stopped)")
        self.what, self.found, self.limit = what, found, limit


def over(budget: Budget, *, decoded: int, rows: int) -> OverBudget | None:
    """The error for a decode that reached `decoded` bytes and `rows` rows, if that is
    over `budget`."""
    if budget.bytes is not None and decoded > budget.bytes:
        return OverBudget(BYTES, found=decoded, limit=budget.bytes)
    if budget.rows is not None and rows > budget.rows:
        return OverBudget(ROWS, found=rows, limit=budget.rows)
    return None
