"""Where a run is, recorded in every checkpoint, so that the same command continues it exactly
from any checkpoint, whatever phase the run was killed in.

One record (`checkpoint["exact_resume"]`) holds what Lightning's own checkpoint leaves out:
- how many batches of the current epoch were trained (the sampler skips them on resume);
- the random generators' states;
- whether the run had decided to stop (early stopping sets `trainer.should_stop`, which Lightning
  does not save: a run resumed after the decision would train on);
- the metrics gathered so far (`trainer.callback_metrics`: a resumed run would miss the values of
  validations run before the kill, in `metrics.json` and for early stopping at an epoch's end);
- the state of the torchmetrics that training steps update (an epoch's accuracy, part-way);
- whether `fit` had finished, and its best checkpoint (the recipe then only tests).

Lightning resumes a checkpoint taken at a step that a validation follows as if that validation had
run, and one taken at an epoch's last batch one epoch behind; one taken inside a gradient
accumulation window holds none of its gradients. So nothing here saves there:
`no_resumable_save_here` tells the savers (`StepCheckpoint`, `Preemption`) to wait for the next
step where a checkpoint resumes exactly.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torchmetrics import Metric

from ..data.base import FirstBatchLoader, ResumableSampler

log = logging.getLogger(__name__)

STATE_KEY = "exact_resume"


def validation_follows(trainer: L.Trainer) -> bool:
    """Whether Lightning runs a validation right after the training batch that is ending."""
    loop = trainer.fit_loop.epoch_loop
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    return fetcher is not None and loop._should_check_val_fx(fetcher)


def mid_window(trainer: L.Trainer) -> bool:
    """Whether the training batch that is ending leaves gradients accumulated for a step that is
    not taken yet: a checkpoint here would hold none of them."""
    return bool(trainer.fit_loop._should_accumulate())


def no_resumable_save_here(trainer: L.Trainer) -> bool:
    """Whether a checkpoint taken as this training batch ends would not resume exactly: inside a
    gradient accumulation window, before a validation (Lightning resumes as if it had run), or
    at an epoch's last batch (Lightning resumes it one epoch behind)."""
    last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    return mid_window(trainer) or validation_follows(trainer) or bool(last_batch)


def fit_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The record of a loaded checkpoint (empty for checkpoints written elsewhere)."""
    return dict(checkpoint.get(STATE_KEY) or {})


def random_states() -> dict[str, Any]:
    """The generators that training draws from (dropout, augmentation), as plain values and
    tensors, so the checkpoint still loads with weights_only=True."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return states
    numpy_state: Any = np.random.get_state()
    kind, keys, position, has_gauss, cached_gauss = numpy_state
    # int64, not uint32: Lightning's lazy loader (FSDP) cannot read uint32 storages.
    keys = torch.from_numpy(keys.astype(np.int64))
    states["numpy"] = (kind, keys, position, has_gauss, cached_gauss)
    return states


def set_random_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy as np

        kind, keys, position, has_gauss, cached_gauss = states["numpy"]
        keys = keys.numpy().astype(np.uint32)
        np.random.set_state((kind, keys, position, has_gauss, cached_gauss))


def scalar_metrics(trainer: L.Trainer) -> dict[str, float]:
    return {
        name: float(value)
        for name, value in trainer.callback_metrics.items()
        if isinstance(value, torch.Tensor) and value.numel() == 1
    }


class ExactResume(Callback):
    """Records where the run is in every checkpoint and puts the run back there on resume.

    All ranks draw alike after `seed_everything`, so rank 0's generator states stand for all;
    metric states differ per rank and are gathered from every rank.
    """

    def __init__(self) -> None:
        self.batches_done = 0
        self.resumed_epoch: int | None = None
        self.pending: dict[str, Any] | None = None
        self.fit_finished = False
        # Off when training starts from another run's checkpoint (`ckpt_path=`): its decision to
        # stop and its metrics are that run's.
        self.restores_progress = True
        # Off when a finished run is trained further (`extend=true`): its decision to stop ended it.
        self.restores_stop = True
        self.best_model_path = ""
        self.training_metrics: set[str] = set()
        self._metrics: dict[str, Metric] = {}
        self._update_counts: dict[str, int] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Lightning resumes mid-epoch without calling `on_train_epoch_start`; an epoch that the
        checkpoint finished is not resumed at all, and the next one starts from its first batch.
        The loader's iterator is already made here, but draws no order before its first batch
        (`FirstBatchLoader`): the epoch that Lightning sets after this hook, and the samples to
        skip set here, both count."""
        self._metrics = self.metrics(pl_module)
        if self.pending is None:
            return
        loader = trainer.train_dataloader
        if getattr(loader, "num_workers", 0) and not isinstance(loader, FirstBatchLoader):
            log.warning(
                "The training DataLoader has loader processes and is no FirstBatchLoader: it drew "
                "its order when Lightning made its iterator, before the resumed epoch was set, so "
                "this run may train on other batches than the interrupted one would have. Make it "
                "with SplitDataModule.loader (a FirstBatchLoader)."
            )
        if self.restores_progress:
            trainer.should_stop = self.restores_stop and bool(self.pending.get("should_stop"))
            metrics = self.pending["metrics"].items()
            trainer.callback_metrics.update({name: torch.tensor(v) for name, v in metrics})
        if self.pending["epoch"] != trainer.current_epoch:
            return
        done = int(self.pending["batches_done"])
        if not 0 < done < trainer.num_training_batches:
            return
        self.batches_done, self.resumed_epoch = done, trainer.current_epoch
        if self.restores_progress:
            states = self.pending["metric_states"]
            self.restore_metric_states(pl_module, states, trainer.global_rank)
            self.training_metrics |= set(states)
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, ResumableSampler):
            sampler.skip = done * int(getattr(loader, "batch_size", 1) or 1)
        else:
            log.warning(
                "The training DataLoader has no ResumableSampler: this resumed epoch starts from "
                "its first batch, so some samples are seen twice."
            )

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch != self.resumed_epoch:
            self.batches_done = 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Counted at the start, so a checkpoint saved by any callback at the batch's end counts
        it as done."""
        self.batches_done += 1
        if self.pending is not None:
            set_random_states(self.pending["random_states"])
            self.pending = None
        self._update_counts = {name: metric.update_count for name, metric in self._metrics.items()}

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """The metrics a training step updates (an epoch's accuracy): their part-way state is
        saved. Validation metrics are left out: Lightning resets them after a checkpoint."""
        for name, metric in self._metrics.items():
            if metric.update_count != self._update_counts.get(name, metric.update_count):
                self.training_metrics.add(name)

    @staticmethod
    def metrics(pl_module: L.LightningModule) -> dict[str, Metric]:
        return {n: m for n, m in pl_module.named_modules() if isinstance(m, Metric)}

    def metric_states(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """Each training metric's state, one entry per rank (a collective: every rank saves)."""
        states: dict[str, Any] = {}
        metrics = self.metrics(pl_module)
        for name in sorted(self.training_metrics):
            metric = metrics[name]
            entry: dict[str, Any] = {"update_count": metric.update_count}
            for attr in metric._defaults:
                value = getattr(metric, attr)
                if isinstance(value, torch.Tensor) and trainer.world_size > 1:
                    # NCCL gathers device tensors only; FSDP leaves metric states where they were.
                    local = value.detach().to(trainer.strategy.root_device)
                    entry[attr] = trainer.strategy.all_gather(local).cpu()
                elif isinstance(value, torch.Tensor):
                    entry[attr] = value.detach()[None].cpu()
                else:
                    entry[attr] = [item.detach().cpu() for item in value]  # this rank's only
            states[name] = entry
        return states

    @staticmethod
    def restore_metric_states(
        pl_module: L.LightningModule, states: dict[str, Any], rank: int
    ) -> None:
        metrics = ExactResume.metrics(pl_module)
        for name, entry in states.items():
            metric = metrics.get(name)
            if metric is None:
                continue
            for attr in metric._defaults:
                value = entry[attr]
                if isinstance(value, torch.Tensor):
                    value = value[min(rank, len(value) - 1)].to(metric.device)
                else:
                    value = [item.to(metric.device) for item in value]
                setattr(metric, attr, value)
            metric._update_count = int(entry["update_count"])
            metric._computed = None

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        batch = trainer.fit_loop.epoch_loop.batch_progress.current
        in_batch_end = getattr(batch, "processed", 0) > batch.completed
        if trainer.training and in_batch_end and validation_follows(trainer):
            log.warning(
                "A checkpoint is being saved at step %d, which a validation follows: Lightning "
                "resumes it as if that validation had run. Save after the validation instead "
                "(as callbacks.StepCheckpoint and callbacks.Preemption do).",
                trainer.global_step,
            )
        checkpoint[STATE_KEY] = {
            "epoch": trainer.current_epoch,
            "batches_done": self.batches_done,
            "random_states": random_states(),
            "should_stop": bool(trainer.should_stop),
            "metrics": scalar_metrics(trainer),
            "metric_states": self.metric_states(trainer, pl_module),
            "fit_finished": self.fit_finished,
            "best_model_path": self.best_model_path,
        }

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = fit_state(checkpoint)
        self.pending = state or None
        if state:
            state.setdefault("metrics", {})
            state.setdefault("metric_states", {})
