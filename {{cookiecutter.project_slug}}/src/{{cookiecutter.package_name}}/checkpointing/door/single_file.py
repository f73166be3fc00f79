"""Single files through torch's restricted unpickler (`weights_only=True`), and what every reader
of the door shares: the errors a file that is not a whole checkpoint raises, and the check for
NaN or infinite weights. Full unpickling happens only for `trust_checkpoint=true`, which the user
types."""

from __future__ import annotations

import io
import logging
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__package__)  # the door's one logger, whichever of its modules logs

# What reading a file that is not a whole checkpoint raises: anything. Garbage makes the zip
# reader and the unpickler fail in many ways (a text file gave IndexError, a flipped byte
# struct.error), so the door turns every Exception of the readers below it into its one line.
UNREADABLE = (Exception,)


def first_line(error: BaseException) -> str:
    """The gist of a loading error, without torch's advice to load with weights_only=False."""
    line = str(error).splitlines()[0] if str(error) else type(error).__name__
    return "weights_only=True refused it" if line.startswith("Weights only load failed") else line


def load_plain(source: Path | io.BytesIO, mmap: bool = False) -> Any:
    """Plain values and tensors, through torch's restricted unpickler."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own, about what weights_only refuses
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)


def load_trusted(path: Path) -> Any:
    """Full unpickling, which runs whatever the file names: only for `trust_checkpoint=true`."""
    log.warning("trust_checkpoint=true: loading %s with full unpickling.", path)
    return torch.load(path, map_location="cpu", weights_only=False)


def refused_as_python_objects(error: pickle.UnpicklingError) -> bool:
    """True where the restricted unpickler refused a pickle that names Python objects (which
    full unpickling would build), False where the bytes are no pickle at all."""
    text = str(error)
    return "Weights only load failed" in text and "Unsupported operand" not in text


def non_finite_tensors(state_dict: dict[str, Any]) -> list[str]:
    return [
        name
        for name, value in state_dict.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not all_finite(value)
    ]


def all_finite(value: torch.Tensor) -> bool:
    """Whether every element is finite. A finite sum says so (a NaN or an infinity anywhere makes
    it NaN or infinite), thirty times faster than testing each element; only a sum that is not
    finite (which large finite values can also give) is checked element by element."""
    return bool(value.sum().isfinite()) or bool(torch.isfinite(value).all())


# Programs that `export` wrote a moment ago, read back for its parity check.


def load_own_export(path: Path) -> Any:
    """A `torch.export` program that this process has just written (its parity check)."""
    with open(path, "rb") as file:
        return torch.export.load(file)
