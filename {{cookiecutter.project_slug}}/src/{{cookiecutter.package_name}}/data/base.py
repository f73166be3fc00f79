"""What the data modules share: seeded splits and DataLoader settings.

The training sampler's shuffle depends only on the seed and the epoch, and it can start an epoch
part-way, so a resumed run sees exactly the batches the interrupted one would have seen, on one
process or many (`callbacks.ExactResume` tells it where to start). The training loader draws that
order at an epoch's first batch, with loader processes or without (`FirstBatchLoader`).
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from .daemon_children import kill_daemon_children
from .errors import ConfigError


def check_whole_numbers(**settings: Any) -> None:
    """Each data setting named is a whole number of 1 or more."""
    for key, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"data.{key}={value!r}: use a whole number of 1 or more.")


def check_fractions(val_fraction: Any, test_fraction: Any) -> None:
    """The shares of the data held out for validation and test leave some to train on, and some
    to validate on (the best checkpoint and early stopping read validation)."""
    for key, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ConfigError(f"data.{key}={value!r}: use a fraction from 0 up to below 1.")
    if val_fraction == 0:
        raise ConfigError(
            "data.val_fraction=0 leaves nothing to validate on (the best checkpoint and early "
            "stopping read validation): use a fraction above 0, e.g. 0.1."
        )
    if val_fraction + test_fraction >= 1:
        raise ConfigError(
            f"data.val_fraction={val_fraction} and data.test_fraction={test_fraction} leave "
            "nothing to train on: make their sum less than 1."
        )


def split_indices(
    count: int, fractions: tuple[float, float], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A seeded shuffle of range(count) cut into train, validation and test indices."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConfigError(f"data.split_seed={seed!r}: use a whole number of 0 or more.")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    val_count = int(count * fractions[0])
    test_count = int(count * fractions[1])
    if val_count == 0:
        raise ConfigError(
            f"data.val_fraction={fractions[0]} of {count} samples holds none to validate on: "
            "raise it."
        )
    return (
        order[val_count + test_count :],
        order[:val_count],
        order[val_count : val_count + test_count],
    )


class ResumableSampler(DistributedSampler[Any]):
    """A DistributedSampler (a seeded shuffle per epoch, one shard per process) whose next epoch
    starts after its first `skip` samples."""

    def __init__(self, dataset: Dataset[Any], num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle=True, seed=seed, drop_last=True)
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        indices = itertools.islice(super().__iter__(), self.skip, None)
        self.skip = 0
        return indices


class FirstBatchLoader(DataLoader[Any]):
    """A DataLoader whose iterator draws its sampler's order when the first batch is asked for, as
    one without loader processes does, not when the iterator is made.

    With loader processes, torch's iterator hands them the first `prefetch_factor` batches of
    indices as it is made, so it draws the epoch's whole order then. Lightning makes a resumed
    run's iterator (`FitLoop.setup_data`) before it sets the resumed epoch on the sampler
    (`FitLoop.on_advance_start`), and does not make it again for that epoch
    (`_TrainingEpochLoop.on_run_start` skips `iter` while `fit_loop.is_resuming`); `ExactResume`
    sets where a part-way epoch resumes after it too. So loader processes trained a run resumed
    at an epoch's start on epoch 0's batches. Drawn at the first batch, the order is that of the
    epoch and position set before it, whoever made the iterator and when; the loader processes
    start at that batch."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return StartsAtFirstBatch(super().__iter__)


class StartsAtFirstBatch(Iterator[Any]):
    """An iterator made by `start` when its first item is asked for."""

    def __init__(self, start: Callable[[], Iterator[Any]]) -> None:
        self.start = start
        self.iterator: Iterator[Any] | None = None

    def __iter__(self) -> StartsAtFirstBatch:
        return self

    def __next__(self) -> Any:
        if self.iterator is None:
            self.iterator = self.start()
        return next(self.iterator)


def shuffle_seed() -> int:
    """The run's seed, which `seed_everything` passes to every process (as Lightning's own
    DistributedSampler does), so all ranks cut the same shuffle into shards."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def init_worker(worker_id: int) -> None:
    """A SIGTERM to the whole process group (`timeout`, SLURM, Kubernetes) must reach the run,
    which stops at a step boundary, rather than kill the DataLoader workers under it first. Then
    Lightning's seeding of the worker, which a worker_init_fn of our own would replace."""
    for name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"):  # Ctrl-C reaches the whole group
        signal.signal(signal.Signals[name], signal.SIG_IGN)
    if os.environ.get("PL_SEED_WORKERS") == "1":
        pl_worker_init_function(worker_id)


# CPython before 3.11.10 (gh-112275): a forked child can wait for ever on the lock of the
# interpreter's thread states when another thread held it at the fork. torch.distributed's threads
# take it often enough to hang a DDP run now and then: seen on 3.11.7, two gloo ranks, one rank's
# DataLoader worker stuck inside fork.
FORK_MAY_HANG = sys.version_info < (3, 11, 10)
STOP_SIGNALS = {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT}


def worker_start(dataset: Dataset[Any]) -> Any:
    """How this process starts its DataLoader workers: forked (the default), or where a fork may
    hang (such a Python, in a process that torch.distributed runs threads in), forked by a
    forkserver, a process of one thread. Like forked workers (`init_worker`), the server and its
    workers must outlive a stop signal sent to the whole process group, or the run could not stop
    cleanly: it starts with the stop signals ignored, which a new program keeps. (A stop signal in
    the few milliseconds that takes is lost: the run goes on until its scheduler kills it, and
    the same command resumes it from its last checkpoint.)"""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not (FORK_MAY_HANG and distributed):
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", type(dataset).__module__])
    handlers = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    switched = {n: h for n, h in handlers.items() if h is not None} if in_main_thread() else {}
    for number in switched:
        signal.signal(number, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for number, handler in switched.items():
            signal.signal(number, handler)
    return context


def in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def kill_workers_at_exit() -> None:
    """Python's exit ends daemonic children with SIGTERM, which workers ignore (`init_worker`),
    and then waits for them for ever: workers of a loader still alive at exit (a test's, a
    notebook's, an evaluation's) are killed first. Exit handlers run last-registered first, so
    this one, registered once a loader has workers, runs before multiprocessing's."""
    global _kill_at_exit_registered
    if not _kill_at_exit_registered:
        atexit.register(kill_daemon_children)
        _kill_at_exit_registered = True


_kill_at_exit_registered = False


MAX_AUTO_WORKERS = 8


def usable_cores() -> int:
    """The cores this process may run on (a SLURM job's or container's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def most_processes(cores: int) -> int:
    """More processes than this on `cores` cores only thrash (and may exhaust memory)."""
    return max(8, 4 * cores)


def auto_workers(accelerator: str, processes_on_node: int, cores: int) -> tuple[int, str]:
    """`data.num_workers=auto`: how many loader processes each training process gets, and why."""
    per_process = max(1, cores // max(1, processes_on_node))
    if accelerator not in ("cuda", "gpu", "mps"):
        return 0, "on a CPU the model needs the cores itself: batches load in the training process"
    workers = min(MAX_AUTO_WORKERS, per_process - 1)
    return workers, (
        f"{cores} cores for {processes_on_node} training process(es): {per_process} each, one "
        f"for training and the rest (at most {MAX_AUTO_WORKERS}) for loading"
    )


def check_loader_settings(batch_size: Any, num_workers: Any) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"data.batch_size={batch_size!r}: use a whole number of 1 or more.")
    if num_workers != "auto" and (
        isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0
    ):
        raise ConfigError(
            f"data.num_workers={num_workers!r}: use a whole number, 0 or more, or auto."
        )
    if isinstance(num_workers, int) and num_workers > most_processes(usable_cores()):
        raise ConfigError(
            f"data.num_workers={num_workers}: far more loader processes than this machine's "
            f"{usable_cores()} cores can run: use at most {most_processes(usable_cores())}, "
            "or auto."
        )


class SplitDataModule(L.LightningDataModule):
    """A data module whose `load_splits` returns the train, val and test data sets.

    `num_workers="auto"` chooses the loader processes from the machine when the loaders are
    made (`auto_workers`); pinned memory whenever CUDA is there; 4 batches prefetched a worker."""

    def __init__(self, batch_size: int, num_workers: int | str) -> None:
        super().__init__()
        check_loader_settings(batch_size, num_workers)
        self.batch_size = batch_size
        self.requested_workers = num_workers
        self.num_workers = 0 if num_workers == "auto" else int(num_workers)
        self.splits: dict[str, Dataset[Any]] = {}

    def load_splits(self) -> dict[str, Dataset[Any]]:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.requested_workers == "auto":
            trainer = self.trainer
            accelerator = type(trainer.accelerator).__name__.lower() if trainer else "cpu"
            device = next((n for n in ("cuda", "mps") if n in accelerator), "cpu")
            processes = trainer.num_devices if trainer else 1
            self.num_workers, _ = auto_workers(device, processes, usable_cores())
        if not self.splits:
            self.splits = self.load_splits()

    def ranks(self) -> tuple[int, int]:
        """The number of training processes, and this one's rank."""
        return (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)

    def sampler(self, split: str) -> Sampler[int] | None:
        """Each process its own shard (Lightning's own sampler injection is off: it would not
        resume mid-epoch). Lightning sets the epoch on it, which reseeds the shuffle."""
        world_size, rank = self.ranks()
        dataset = self.splits[split]
        if split == "train":
            return ResumableSampler(dataset, world_size, rank, seed=shuffle_seed())
        if world_size > 1:
            return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
        return None

    def collate(self, split: str) -> Callable[[list[Any]], Any] | None:
        """How a split's samples make a batch (picklable, for loader processes); None: torch's
        default, which stacks them."""
        return None

    def loader(self, split: str) -> DataLoader[Any]:
        """Drop the ragged last batch when training, so compiled shapes stay static. The loader's
        own generator seeds its workers, so starting an epoch draws nothing from torch's global
        generator (which dropout uses). Training draws its order at an epoch's first batch, after
        the epoch and the resumed position are set (`FirstBatchLoader`)."""
        if self.num_workers > 0:
            kill_workers_at_exit()
        dataset = self.splits[split]
        return (FirstBatchLoader if split == "train" else DataLoader)(
            dataset,
            multiprocessing_context=worker_start(dataset) if self.num_workers > 0 else None,
            batch_size=self.batch_size,
            sampler=self.sampler(split),
            collate_fn=self.collate(split),
            drop_last=split == "train",
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            prefetch_factor=4 if self.num_workers > 0 else None,
            generator=torch.Generator().manual_seed(shuffle_seed()),
            worker_init_fn=init_worker if self.num_workers > 0 else None,
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return self.loader("train")

    def val_dataloader(self) -> DataLoader[Any]:
        return self.loader("val")

    def test_dataloader(self) -> DataLoader[Any]:
        return self.loader("test")

    def predict_dataloader(self) -> DataLoader[Any]:
        """The `predict` split, which the predict recipe sets (new inputs, or another split)."""
        return self.loader("predict")
