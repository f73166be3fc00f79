"""Folders of shards (torch.distributed.checkpoint), read once their `.metadata` has passed
`read_shard_metadata`. `ShardReader` is the only storage reader handed to
torch.distributed.checkpoint: it returns that checked metadata, never reads a rank-local
`__<rank>.metadata` (torch's loader falls back to one, with a bare `pickle.load`, when the global
one fails to read), and refuses transforms it did not write."""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .shard_metadata import META, UnsafeCheckpoint, read_shard_metadata
from .single_file import load_plain

if TYPE_CHECKING:  # torch.distributed.checkpoint takes most of a second to import
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import LoadPlanner


def read_meta(folder: Path) -> dict[str, Any]:
    """Everything but the weights and optimizer state (the step, loops and callbacks' states),
    once the folder's metadata has passed `read_shard_metadata`."""
    read_shard_metadata(folder)
    return dict(load_plain(folder / META))


def shard_reader(folder: Path) -> Any:
    """The storage reader for torch.distributed.checkpoint's loaders (see the module's text)."""
    from torch.distributed.checkpoint import FileSystemReader

    class ShardReader(FileSystemReader):
        def __init__(self, folder: Path) -> None:
            super().__init__(folder)
            self.checked = read_shard_metadata(folder)

        def read_metadata(self) -> Metadata:  # no `rank` keyword: torch then tries no fallback
            from torch.distributed.checkpoint.metadata import StorageMeta

            if self.checked.storage_meta is None:
                self.checked.storage_meta = StorageMeta()
            self.checked.storage_meta.load_id = self.load_id
            return self.checked

        def read_data(self, plan: Any, planner: LoadPlanner) -> Any:
            self.storage_data = self.checked.storage_data  # never the caller's
            return super().read_data(plan, planner)

    return ShardReader(folder)


def plain_values_planner(planner_class: type) -> type:
    """`planner_class` whose values that are not tensors (an optimizer's hyperparameters) load
    with weights_only=True: torch's planners unpickle them with weights_only=False."""
    from torch.distributed.checkpoint._traverse import set_element

    class PlainValues(planner_class):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            name = read_item.dest_index.fqn
            try:
                loaded = load_plain(value)
            except Exception as error:
                raise UnsafeCheckpoint(
                    f"its shards hold {name} as something other than plain values, which only "
                    "full unpickling (a way to run code) can read"
                ) from error
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[name], loaded)
            else:
                self.state_dict[name] = loaded

    return PlainValues


@contextmanager
def first_failure() -> Iterator[None]:
    """torch.distributed.checkpoint gathers each rank's error into a CheckpointException (a
    BaseException whose text is every rank's traceback): raise the first error itself."""
    from torch.distributed.checkpoint import CheckpointException

    try:
        yield
    except CheckpointException as error:
        failures: list[Any] = [failure for failure, _ in error.failures.values()]
        if failures and isinstance(failures[0], Exception):
            raise failures[0] from error
        raise RuntimeError(str(error).splitlines()[0]) from error


def load_shards(state: dict[str, Any], folder: Path, allow_partial: bool = False) -> None:
    """Fill `state` (a model's or optimizer's state dict, sharded or not) from the folder, on
    every rank of the job, as `torch.distributed.checkpoint.load` does."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, load

    planner = plain_values_planner(DefaultLoadPlanner)(allow_partial_load=allow_partial)
    with first_failure():
        load(state, storage_reader=shard_reader(folder), planner=planner)


def read_shards_whole(folder: Path) -> dict[str, Any]:
    """The whole checkpoint in one process's memory, as a single-file one holds it."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    checkpoint = read_meta(folder)
    tensors: dict[str, Any] = {}
    with warnings.catch_warnings(), first_failure():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _load_state_dict(
            tensors,
            storage_reader=shard_reader(folder),
            planner=plain_values_planner(_EmptyStateDictLoadPlanner)(),
            no_dist=True,
        )
    optimizers = sorted(key for key in tensors if key.startswith("optimizer_"))
    checkpoint["state_dict"] = tensors.get("state_dict", {})
    checkpoint["optimizer_states"] = [tensors[key] for key in optimizers]
    return checkpoint
