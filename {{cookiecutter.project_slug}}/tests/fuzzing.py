"""What the fuzz tests share: valid files and values mutated at random (truncated, bits
flipped, bytes inserted or repeated, a value at any depth swapped for a huge, deep, non-UTF-8 or
wrongly typed one), odd files in a valid file's place (a link out of its folder, a pipe, a
folder, a link to a device that never ends), and the invariant every door keeps: a result or the
project's one-line ConfigError, within DOOR_SECONDS and without raising the process's peak
memory by more than DOOR_MEMORY, never another exception; an odd file in a folder's own place is
refused, not read.

Seeded, so a failure names its case; FUZZ_CASES cases a door (`make test` keeps the default,
`make test-all` runs more)."""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from {{ cookiecutter.package_name }}.errors import ConfigError

CASES = int(os.environ.get("FUZZ_CASES", "60"))
ODD_VALUES: list[Any] = [
    None, True, -1, 0, 2**64, 1e309, 5e-324, float("nan"), "", "x" * 100_000, [], {}, [[[[]]]],
    {"role": "user"}, "\ud800",
]  # fmt: skip
ODD_FILES = ["link out", "pipe", "folder", "link to a device"]
DOOR_SECONDS = 60  # a case that takes longer is a hang (a pipe waited on, a loop without end)
DOOR_MEMORY = 1 << 30  # bytes: a case that needs more allocated what a file claimed, unchecked
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


class Hung(BaseException):
    """A case past DOOR_SECONDS (a BaseException: no door's `except Exception` takes it)."""


@contextmanager
def within(seconds: float, case: str) -> Iterator[None]:
    def interrupt(signum: int, frame: Any) -> None:
        raise Hung(f"{case}: still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def write_case(
    path: Path, data: bytes, rng: random.Random, valid: bytes, odd_share: float = 0.15
) -> str:
    """`data` written at `path` ("bytes"); or, in about `odd_share` of the cases, one of
    ODD_FILES in its place: a link to a file outside `path`'s folder holding the `valid` bytes
    (a door that follows it reads a good file), a pipe with no writer, a folder, or a link to
    /dev/zero. Returns which."""
    remove(path)
    if rng.random() >= odd_share:
        path.write_bytes(data)
        return "bytes"
    kind = rng.choice(ODD_FILES)
    if kind == "link out":
        outside = path.parent.parent / f"outside-{path.parent.name}-{path.name}"
        outside.write_bytes(valid)
        path.symlink_to(outside)
    elif kind == "pipe":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    return kind


def door_holds(door: Callable[[], Any], case: str, refused: str | None = None) -> None:
    """The door returns, or raises one line of ConfigError, within DOOR_SECONDS; anything else
    fails the test. `refused`: an odd file that the door must refuse rather than read (a file
    of a folder's own: a link out, a pipe, a folder, a device)."""
    peak = peak_memory()
    try:
        with within(DOOR_SECONDS, case):
            door()
    except ConfigError as error:
        assert "\n" not in str(error), f"{case}: {error}"
    except Exception as error:  # what this test looks for
        raise AssertionError(f"{case}: {type(error).__name__}: {error}"[:2000]) from error
    else:
        assert refused is None, f"{case}: {refused} was read, not refused"
    grown = peak_memory() - peak
    assert grown <= DOOR_MEMORY, f"{case}: the process's peak memory grew by {grown >> 20} MiB"


def peak_memory() -> int:
    """Bytes: the most this process has held in memory so far (Linux counts in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def must_refuse(kind: str, own_file: bool) -> str | None:
    """Which odd file a door must refuse: any in a folder's own place; a link out of the folder
    is followed where the user named the file (their link, their file), the others never read."""
    if kind == "bytes" or (kind == "link out" and not own_file):
        return None
    return kind
