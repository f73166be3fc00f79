"""Reading a folder of shards without running code from it. torch.distributed.checkpoint's load
planners unpickle every value that is not a tensor (an optimizer's hyperparameters) with
`torch.load(weights_only=False)`, so a hostile folder could run anything; these load them with
`weights_only=True`. Imported only where a folder is read: torch.distributed.checkpoint takes
most of a second to import."""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from .sharded_checkpoints import UnsafeMetadata, read_meta


def load_plain_value(planner: DefaultLoadPlanner, item: ReadItem, value: io.BytesIO) -> None:
    """DefaultLoadPlanner.load_bytes, with weights_only=True."""
    name = item.dest_index.fqn
    try:
        loaded = torch.load(value, weights_only=True)
    except Exception as error:
        raise UnsafeMetadata(
            f"its shards hold {name} as something other than plain values, which only full "
            "unpickling (a way to run code) can read"
        ) from error
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[name], loaded)
    else:
        planner.state_dict[name] = loaded


class PlainValuesLoadPlanner(DefaultLoadPlanner):
    """Loads into a given state dict (resuming a run)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        load_plain_value(self, read_item, value)


class WholePlainValuesLoadPlanner(_EmptyStateDictLoadPlanner):
    """Loads everything a folder holds into an empty state dict (eval, predict, export)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        load_plain_value(self, read_item, value)


@contextmanager
def first_failure() -> Iterator[None]:
    """torch.distributed.checkpoint gathers each rank's error into a CheckpointException (a
    BaseException whose text is every rank's traceback): raise the first error itself."""
    try:
        yield
    except CheckpointException as error:
        failures: list[Any] = [failure for failure, _ in error.failures.values()]
        if failures and isinstance(failures[0], Exception):
            raise failures[0] from error
        raise RuntimeError(str(error).splitlines()[0]) from error


def read_sharded(path: Path) -> dict[str, Any]:
    """The whole checkpoint in one process's memory, as a single-file one holds it."""
    checkpoint = read_meta(path)
    tensors: dict[str, Any] = {}
    with warnings.catch_warnings(), first_failure():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _load_state_dict(
            tensors,
            storage_reader=FileSystemReader(path),
            planner=WholePlainValuesLoadPlanner(),
            no_dist=True,
        )
    optimizers = sorted(key for key in tensors if key.startswith("optimizer_"))
    checkpoint["state_dict"] = tensors.get("state_dict", {})
    checkpoint["optimizer_states"] = [tensors[key] for key in optimizers]
    return checkpoint
