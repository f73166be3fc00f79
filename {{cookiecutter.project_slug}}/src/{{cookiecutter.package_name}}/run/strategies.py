"""Strategies that need more than a config can say (classes built from names, policies)."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from hydra.utils import get_class
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..checkpointing.door import (
    META,
    is_sharded,
    load_plain,
    load_shards,
    load_trusted,
    non_finite_tensors,
)
from ..checkpointing.saving import (
    NonFiniteWeightsError,
    failed_write,
    is_failed_write,
    save_failed,
)
from ..checkpointing.sharded import publish, remove, staging_folder
from ..errors import ConfigError, TrainingError
from ..targets import allowed

CHECKPOINT_MODES = ("async", "sync", "consolidated")


def shards_not_written(error: BaseException, path: Path) -> TrainingError | None:
    """The one line for a folder of shards that could not be written, or None where `error` is
    no failed write. torch.distributed.checkpoint gathers every rank's failure into a
    CheckpointException (a BaseException) that all ranks raise, so every rank gets this line,
    marked for the first rank alone to print."""
    causes = (
        [cause for cause, _ in error.failures.values()]
        if isinstance(error, CheckpointException) else [error]
    )  # fmt: skip
    for cause in causes:
        if isinstance(cause, OSError) or is_failed_write(cause):
            written = cause if isinstance(cause, OSError) else failed_write(path)
            line = save_failed(path, written)
            line.every_rank = True  # type: ignore[attr-defined]
            return line
    return None


def fsdp_strategy(
    sharding_strategy: Any = "FULL_SHARD",
    wrap_min_params: int = 1_000_000,
    activation_checkpointing: list[str] | None = None,
    cpu_offload: bool = False,
) -> FSDPStrategy:
    """FSDP with size-based wrapping; `activation_checkpointing` names module classes to
    recompute in the backward pass (e.g. the transformer block) to save memory."""
    checkpointed = {
        get_class(allowed(name, "trainer.strategy.activation_checkpointing"))
        for name in activation_checkpointing or []
    }
    return WholeFileFSDPStrategy(
        sharding_strategy=sharding_strategy,
        auto_wrap_policy=functools.partial(
            size_based_auto_wrap_policy, min_num_params=int(wrap_min_params)
        ),
        activation_checkpointing_policy=checkpointed or None,
        cpu_offload=cpu_offload,
        state_dict_type="full",
    )


class WholeFileFSDPStrategy(FSDPStrategy):
    """Lightning's FSDP, whose checkpoints (whole files, `state_dict_type="full"`) are read by the
    door: Lightning's own reader for them unpickles without restriction."""

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():
            raise ConfigError(
                f"{path} is a folder of shards, which strategy=fsdp does not read: continue it "
                "with strategy=model_parallel."
            )
        import lightning.pytorch.strategies.fsdp as lightning_fsdp

        read = load_trusted if weights_only is False else load_plain
        lazy_load = lightning_fsdp._lazy_load
        lightning_fsdp._lazy_load = read  # type: ignore[assignment]
        try:
            return super().load_checkpoint(path, weights_only=weights_only)
        finally:
            lightning_fsdp._lazy_load = lazy_load


def plain_weights(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state with each weight that FSDP2 all-gathers in float8 unwrapped: torchao keeps the
    weight in a tensor subclass (the high-precision tensor in `_tensor`), which came out of
    `dcp.async_save` as uninitialized memory."""
    plain = dict(state_dict)
    for name, value in state_dict.items():
        local = value._local_tensor if isinstance(value, DTensor) else None
        inner = getattr(local, "_tensor", None)
        if is_traceable_wrapper_subclass(local) and isinstance(inner, torch.Tensor):
            plain[name] = DTensor.from_local(
                inner, value.device_mesh, value.placements, run_check=False,
                shape=value.shape, stride=value.stride(),
            )  # fmt: skip
    return plain


class ShardedCheckpointStrategy(ModelParallelStrategy):
    """FSDP2 / tensor parallelism (Lightning's ModelParallelStrategy) whose checkpoints are folders
    of shards, each rank writing its own (torch.distributed.checkpoint):

    - `checkpoint="async"`: the state is copied to host memory and training goes on while a
      background thread writes it; a save waits only for the one before it;
    - `checkpoint="sync"`: training waits for the write;
    - `checkpoint="consolidated"`: one file gathered on rank 0, as other strategies write.

    A folder is written under a hidden name and renamed once complete (sharded_checkpoints), and
    weights with NaN or infinite values are never written (as AtomicCheckpointIO)."""

    def __init__(self, *args: Any, checkpoint: str = "async", **kwargs: Any) -> None:
        if checkpoint not in CHECKPOINT_MODES:
            raise ConfigError(
                f"trainer.strategy.checkpoint={checkpoint} is not one of "
                f"{', '.join(CHECKPOINT_MODES)}."
            )
        kwargs["save_distributed_checkpoint"] = checkpoint != "consolidated"
        super().__init__(*args, **kwargs)
        self.checkpoint_mode = checkpoint
        self.pending: Future[None] | None = None
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self.checkpoint_group: Any = None
        self.stalls: list[float] = []  # seconds each save held training up
        self.writes: list[float] = []  # seconds from each save's start to its folder complete
        self.waits: list[float] = []  # seconds of each stall spent on the previous save's write

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        started = time.perf_counter()
        self.finish_checkpoint_writes()
        self.waits.append(time.perf_counter() - started)
        if self.checkpoint_mode == "consolidated":
            super().save_checkpoint(checkpoint, filepath, storage_options)
            self.stalls.append(time.perf_counter() - started)
            self.writes.append(self.stalls[-1])
            return
        path = Path(self.broadcast(filepath))
        shards = {"state_dict": plain_weights(checkpoint.pop("state_dict"))}
        for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
            shards[f"optimizer_{index}"] = state
        self.refuse_non_finite(shards["state_dict"], path)
        staging = staging_folder(path)
        if self.is_global_zero:
            remove(staging)
            staging.mkdir(parents=True)
            torch.save(checkpoint, staging / META)
        self.barrier("checkpoint staging folder")
        if self.checkpoint_mode == "sync":
            with self.written_or_one_line(staging, path):
                dcp.save(shards, checkpoint_id=staging)
                if self.is_global_zero:
                    publish(staging, path)
        else:
            if self.checkpoint_group is None:
                # The writer thread's collectives must not interleave with training's.
                self.checkpoint_group = torch.distributed.new_group(backend="gloo")
            written = dcp.async_save(
                shards, checkpoint_id=staging, process_group=self.checkpoint_group
            )
            assert isinstance(written, Future)
            self.pending = self.writer.submit(self.published, staging, path, started, written)
        self.stalls.append(time.perf_counter() - started)
        if self.checkpoint_mode == "sync":
            self.writes.append(self.stalls[-1])

    def published(self, staging: Path, path: Path, started: float, written: Future[Any]) -> None:
        """The end of a background write: rank 0 renames the complete folder."""
        with self.written_or_one_line(staging, path):
            written.result()
            if self.is_global_zero:
                publish(staging, path)
        self.writes.append(time.perf_counter() - started)

    @contextlib.contextmanager
    def written_or_one_line(self, staging: Path, path: Path) -> Iterator[None]:
        """A write that fails leaves no staging folder and is one line naming the checkpoint."""
        try:
            yield
        except BaseException as error:
            line = shards_not_written(error, path)
            if line is None:
                raise
            if self.is_global_zero:
                remove(staging)
            raise line from None

    def finish_checkpoint_writes(self, all_ranks: bool = True) -> None:
        """Wait for the save in flight, if any (raising what it raised), and for its folder to
        be renamed (on every rank when `all_ranks`: rank 0 renames)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()
        if all_ranks and self.checkpoint_mode != "consolidated":
            self.barrier("checkpoint written")

    def refuse_non_finite(self, state_dict: dict[str, Any], path: Path) -> None:
        local = {
            name: value.to_local() if isinstance(value, DTensor) else value
            for name, value in state_dict.items()
        }
        bad = non_finite_tensors(local)
        count = torch.tensor(float(len(bad)), device=self.root_device)  # NCCL: on the device
        if self.reduce(count, reduce_op="sum").item() > 0:
            raise NonFiniteWeightsError(
                f"Not writing {path}: non-finite values in "
                f"{', '.join(bad[:5]) or 'weights of another rank'}. The previous checkpoints "
                "stay as they were."
            )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """As Lightning's, but every byte read through the door (`checkpointing.door`), and
        letting a module that loads non-strictly (LoRA adapters) read a folder that lacks
        weights."""
        self.finish_checkpoint_writes()
        path = Path(self.broadcast(checkpoint_path))
        if not is_sharded(path):
            return super().load_checkpoint(path, weights_only=weights_only)
        assert self.lightning_module is not None and self.model is not None
        strict = self.lightning_module.strict_loading
        weights = {"state_dict": get_model_state_dict(self.model)}
        load_shards(weights, path, allow_partial=not strict)
        self.model.load_state_dict(weights["state_dict"], strict=strict)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            state = {key: get_optimizer_state_dict(self.model, optimizer)}
            load_shards(state, path, allow_partial=not strict)
            set_optimizer_state_dict(
                self.model, optimizer, state[key], options=StateDictOptions(cpu_offload=True)
            )
        return load_plain(path / META)

    def teardown(self) -> None:
        self.finish_checkpoint_writes(all_ranks=False)  # also reached when one rank failed
        super().teardown()
