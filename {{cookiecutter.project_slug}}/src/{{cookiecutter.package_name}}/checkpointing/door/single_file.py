"""Single files through torch's restricted unpickler (`weights_only=True`), and what every reader
of the door shares: the errors a file that is not a whole checkpoint raises, and the check for
NaN or infinite weights. Full unpickling happens only for `trust_checkpoint=true`, which the user
types."""

from __future__ import annotations

import io
import logging
import pickle
import pickletools
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from ...data.folder_files import check_regular

log = logging.getLogger(__package__)  # the door's one logger, whichever of its modules logs

# What reading a file that is not a whole checkpoint raises: anything. Garbage makes the zip
# reader and the unpickler fail in many ways (a text file gave IndexError, a flipped byte
# struct.error), so the door turns every Exception of the readers below it into its one line.
UNREADABLE = (Exception,)
NAME_LIMIT = 1024  # characters of a module's or a class's name in a pickle


def first_line(error: BaseException) -> str:
    """The gist of a loading error, without torch's advice to load with weights_only=False."""
    line = str(error).splitlines()[0] if str(error) else type(error).__name__
    return "weights_only=True refused it" if line.startswith("Weights only load failed") else line


def load_plain(source: Path | io.BytesIO, mmap: bool = False) -> Any:
    """Plain values and tensors, through torch's restricted unpickler; a path only where it is a
    regular file (a pipe would hold torch.load forever)."""
    if isinstance(source, Path):
        check_regular(source, source.name)
    check_names(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own, about what weights_only refuses
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)


def check_names(source: Path | io.BytesIO) -> None:
    """Refuse a pickle that names a global longer than any module or class is called, before torch
    reads it: torch.load(weights_only=True) searches the message of its refusal with regular
    expressions whose time grows with the square of its longest word, so a 300 KB checkpoint
    naming a global of 100,000 characters held it for minutes. A file that is not a zip, or
    whose pickle does not parse this far, is left to torch.load to refuse."""
    start = source.tell() if isinstance(source, io.BytesIO) else 0
    try:
        with zipfile.ZipFile(source) as archive:
            names = [name for name in archive.namelist() if name.endswith("data.pkl")]
            pickled = archive.read(names[0]) if names else b""
        recent: list[str | None] = [None, None]  # the two values pushed last, where strings
        memo: dict[int, str | None] = {}
        for opcode, argument, _ in pickletools.genops(pickled):
            name = opcode.name
            if name == "GLOBAL" and len(str(argument)) > 2 * NAME_LIMIT:
                length = len(str(argument))
                raise pickle.UnpicklingError(f"it names a global of {length} characters")
            if name == "STACK_GLOBAL" and any(len(s or "") > NAME_LIMIT for s in recent):
                longest = max(len(s or "") for s in recent)
                raise pickle.UnpicklingError(f"it names a global of {longest} characters")
            if name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(str(argument))] = recent[1]
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                recent = [recent[1], memo.get(int(str(argument)))]
            else:
                pushed = str(argument) if "UNICODE" in name or "STRING" in name else None
                recent = [recent[1], pushed]
    except pickle.UnpicklingError:
        raise
    except Exception:  # not a zip, or a pickle that breaks off: torch.load refuses it itself
        return
    finally:
        if isinstance(source, io.BytesIO):
            source.seek(start)  # torch.load reads the stream from where it was


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
