"""Training logic for next-token prediction; the network maps token ids to logits."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchmetrics import MeanMetric

from .nets.gpt import GPT
from .optim import OptimizerFactory, SchedulerFactory, clip_gradients, configure_optimizers
from .step_logging import is_logging_step


class LanguageModel(L.LightningModule):
    def __init__(
        self,
        net: GPT,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        # Plain values only, so checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"])
        self.net = net
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.tokens_per_sample = net.block_size
        self.flops_per_sample = net.flops_per_token(net.block_size) * net.block_size

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.hparams["compile"] and self.device_mesh is None:
            self.net.compile()

    def configure_model(self) -> None:
        """Under ModelParallelStrategy: compile each block, then shard it with FSDP2."""
        if self.device_mesh is None or isinstance(self.net.wte.weight, DTensor):
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            if self.hparams["compile"]:
                block.compile()
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        loss = self._loss(batch)
        # Not on the progress bar: Lightning reads progress-bar values to the host every step.
        if is_logging_step(self):
            self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.val_loss(self._loss(batch), weight=batch[1].numel())
        self.log("val/loss", self.val_loss, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.log("val/bits_per_byte", self.val_loss.compute() / math.log(2))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.test_loss(self._loss(batch), weight=batch[1].numel())
        self.log("test/loss", self.test_loss)

    def on_test_epoch_end(self) -> None:
        self.log("test/bits_per_byte", self.test_loss.compute() / math.log(2))

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
