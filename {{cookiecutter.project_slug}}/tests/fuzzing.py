"""What the fuzz tests share: valid files and values mutated at random (truncated, bits
flipped, bytes inserted or repeated, a value at any depth swapped for a huge, deep, non-UTF-8 or
wrongly typed one), and the invariant every door keeps: a result or the project's one-line
ConfigError, never another exception.

Seeded, so a failure names its case; FUZZ_CASES cases a door (`make test` keeps the default,
`make test-all` runs more)."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from typing import Any

from {{ cookiecutter.package_name }}.errors import ConfigError

CASES = int(os.environ.get("FUZZ_CASES", "60"))
ODD_VALUES: list[Any] = [
    None, True, -1, 0, 2**64, 1e309, 5e-324, float("nan"), "", "x" * 100_000, [], {}, [[[[]]]],
    {"role": "user"}, "\ud800",
]  # fmt: skip
ODD_TEXT = ["1" * 5000, "[" * 100_000, '"\\ud800"', "NaN", "-Infinity", "1e999999"]


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    kind = rng.choice(["truncate", "flip", "insert", "repeat", "odd text"])
    if kind == "truncate":
        return data[: rng.randrange(len(data) + 1)]
    if kind == "flip":
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        return bytes(flipped)
    at = rng.randrange(len(data) + 1)
    if kind == "insert":
        return data[:at] + rng.randbytes(rng.randint(1, 16)) + data[at:]
    if kind == "repeat":
        return data[:at] + data[at : at + rng.randint(1, 64)] * rng.randint(2, 50) + data[at:]
    return data[:at] + rng.choice(ODD_TEXT).encode() + data[at:]


def mutate_json(value: Any, rng: random.Random) -> Any:
    """The same JSON with one value (at any depth) swapped for an odd one, or a key dropped."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        if rng.random() < 0.2:
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: mutate_json(value[key], rng)}
    if isinstance(value, list) and value and rng.random() < 0.7:
        index = rng.randrange(len(value))
        return [*value[:index], mutate_json(value[index], rng), *value[index + 1 :]]
    return rng.choice(ODD_VALUES)


def mutated_json_text(value: Any, rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        return mutate_bytes(json.dumps(value).encode(), rng)
    try:
        return json.dumps(mutate_json(value, rng)).encode("utf-8", "surrogatepass")
    except ValueError:
        return b"{}"


def door_holds(door: Callable[[], Any], case: str) -> None:
    """The door returns, or raises one line of ConfigError; anything else fails the test."""
    try:
        door()
    except ConfigError as error:
        assert "\n" not in str(error), f"{case}: {error}"
    except Exception as error:  # what this test looks for
        raise AssertionError(f"{case}: {type(error).__name__}: {error}"[:2000]) from error
