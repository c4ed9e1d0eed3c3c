"""Which namespaces this operator serves (`--namespace`, the chart's watchNamespaces).

Empty means every namespace. The chart passes exact names; kopf would also take its
patterns (globs, `!negations`, comma-separated lists), which the pod watch cannot
serve (it lists pods per named namespace), so only exact names are acted upon here.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Characters of a kopf namespace pattern that a namespace name never contains.
_PATTERN_CHARACTERS = frozenset("!*?,[] ")


def exact(namespaces: Iterable[str]) -> bool:
    """Whether every entry names one namespace (no kopf pattern): kopf then needs no
    namespace listing to resolve them, a permission the chart does not grant."""
    return not any(_PATTERN_CHARACTERS & set(ns) for ns in namespaces)


def serves(namespaces: tuple[str, ...], namespace: str) -> bool:
    """Whether `namespace` is one this operator serves: all of them when `namespaces` is
    empty; with patterns, assumed served (the API read then decides, as before)."""
    if not namespaces or not exact(namespaces):
        return True
    return namespace in namespaces


def describe(namespaces: tuple[str, ...]) -> str:
    """The served namespaces, for messages."""
    if not namespaces:
        return "every namespace"
    label = "namespace" if len(namespaces) == 1 else "namespaces"
    return f"{label} {', '.join(namespaces)}"
