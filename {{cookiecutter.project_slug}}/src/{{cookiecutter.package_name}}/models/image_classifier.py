"""Training logic for image classification; the network is any `nn.Module` given to it."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from .optim import OptimizerFactory, SchedulerFactory, clip_gradients, configure_optimizers
from .step_logging import is_logging_step


class ImageClassifier(L.LightningModule):
    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        num_classes: int = 10,
        compile: bool = False,
    ) -> None:
        super().__init__()
        # Plain values only, so checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"])
        self.net = net
        self.optimizer = optimizer
        self.scheduler = scheduler
        # No argument checks in the training step: they read the labels back to the host (a sync).
        self.train_acc = MulticlassAccuracy(num_classes, validate_args=False)
        self.val_acc = MulticlassAccuracy(num_classes)
        self.test_acc = MulticlassAccuracy(num_classes)
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.flops_per_sample: int | None = None

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.hparams["compile"]:
            self.net.compile()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.flops_per_sample is None:
            self.flops_per_sample = self._measure_flops_per_sample(batch[0][:1])

    def _measure_flops_per_sample(self, image: torch.Tensor) -> int:
        """Forward FLOPs of one sample, counted once; backward costs about twice the forward.
        Calls `forward` directly: a compiled net is not compiled a second time for eval mode."""
        was_training = self.net.training
        self.net.eval()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            self.net.forward(image)
        self.net.train(was_training)
        return 3 * counter.get_total_flops()

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.train_acc.update(logits, labels)
        # Not on the progress bar: Lightning reads progress-bar values to the host every step.
        if is_logging_step(self):
            self.log("train/loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        # Logged once an epoch: each `self.log` call costs host time in every step.
        self.log("train/acc", self.train_acc)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_loss(F.cross_entropy(logits, labels), weight=labels.numel())
        self.val_acc(logits, labels)
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.test_loss(F.cross_entropy(logits, labels), weight=labels.numel())
        self.test_acc(logits, labels)
        self.log("test/loss", self.test_loss)
        self.log("test/acc", self.test_acc)

    def predict_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        """Class probabilities (batch, classes)."""
        return F.softmax(self(batch[0]).float(), dim=-1)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        return configure_optimizers(
            self.net, self.optimizer, self.scheduler, int(self.trainer.estimated_stepping_batches)
        )
