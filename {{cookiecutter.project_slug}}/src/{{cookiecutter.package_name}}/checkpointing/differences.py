"""How a file's weights differ from a model's, in the words of every refusal: up to three names
of each kind, e.g. `missing: a, b, c ...; unexpected: d; other shape: e`."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping


def listed_differences(
    missing: Collection[str], unexpected: Collection[str], resized: Collection[str]
) -> str:
    """The names of each kind, sorted; empty where there are none."""
    return "; ".join(
        f"{label}: {', '.join(sorted(names)[:3])}{' ...' if len(names) > 3 else ''}"
        for label, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("other shape", resized),
        )
        if names
    )


def shape_differences(
    expected: Mapping[str, tuple[int, ...]],
    stored: Mapping[str, tuple[int, ...]],
    optional: Callable[[str], bool] = lambda name: False,
) -> str:
    """How the `stored` shapes differ from the `expected` ones (names for which `optional` is true
    may be missing); empty where they fit."""
    missing = [name for name in set(expected) - set(stored) if not optional(name)]
    resized = [name for name in set(expected) & set(stored) if expected[name] != stored[name]]
    return listed_differences(missing, set(stored) - set(expected), resized)
