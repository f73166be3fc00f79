"""Training logic for next-token prediction; the network maps token ids to logits.

A target of -100 (`IGNORED`) counts for nothing: instruction data (`data.instructions`) marks
prompt tokens and padding so, and the losses average the other targets only (a validation or test
batch weighs as many as it has). Text windows have none, so their numbers are those of a plain
mean over every token.

The network computes the loss itself (`net(inputs, targets=targets)`), so that `compile` compiles
it with the network and FSDP's hooks cover it; `model.net.loss_chunk_size` takes it a chunk of
positions at a time, never holding the logits of the whole batch (models/losses.py)."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchmetrics import MeanMetric

from .fp8 import convert_from_fp8, convert_to_fp8
from .lora import add_adapters, is_adapter
from .losses import IGNORED
from .nets.decoding import Decoder
from .optim import OptimizerFactory, SchedulerFactory, clip_gradients, configure_optimizers
from .step_logging import is_logging_step

LN2 = math.log(2)


class LanguageModel(L.LightningModule):
    def __init__(
        self,
        net: Decoder,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        compile: bool = False,
        lora: dict[str, Any] | None = None,
        fp8: str | None = None,
    ) -> None:
        super().__init__()
        # Plain values only, so checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler", "lora"])
        self.net = net
        self.adapted = add_adapters(net, **dict(lora)) if lora else []
        # Fine-tuning checkpoints hold only the adapters; the rest is the base's, loaded already
        # (ModelParallelStrategy loads weights before `on_load_checkpoint` could fill them in).
        self.strict_loading = not self.adapted
        # Where the frozen weights of a fine-tuning run come from ({"path", "sha256"}), set by
        # the train recipe for `init_from`: its checkpoints then hold only what trains.
        self.base_weights: dict[str, str] | None = None
        # How predict_step samples (Decoder.generate's arguments), set by the predict recipe.
        self.generation: dict[str, Any] = {"max_new_tokens": 100}
        self.fp8_converted = False
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.tokens_per_sample = net.block_size
        self.flops_per_sample = net.flops_per_token(net.block_size) * net.block_size

    def convert_to_fp8(self, fsdp: bool) -> None:
        if self.hparams["fp8"] and not self.fp8_converted:
            convert_to_fp8(self.net, self.hparams["fp8"], fsdp)
            self.fp8_converted = True

    def setup(self, stage: str) -> None:
        """On one device an FP8 model is evaluated in the run's precision (matmuls not in
        float8). Under FSDP2 it stays in float8: its sharded weights all-gather in float8, and the
        sharding holds on to the layers that a conversion back would replace."""
        if stage != "fit" and self.fp8_converted and self.device_mesh is None:
            convert_from_fp8(self.net)
            self.fp8_converted = False
        if stage == "fit" and self.device_mesh is None:
            self.convert_to_fp8(fsdp=False)
            if self.hparams["compile"]:
                self.net.compile()

    def configure_model(self) -> None:
        """Under ModelParallelStrategy: compile each block, then shard it with FSDP2."""
        if self.device_mesh is None or isinstance(self.net, FSDPModule):
            return
        self.convert_to_fp8(fsdp=True)
        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            if self.hparams["compile"]:
                block.compile()
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.adapted and self.base_weights:
            trains = {name for name, p in self.named_parameters() if p.requires_grad}
            state = checkpoint["state_dict"]
            checkpoint["state_dict"] = {k: v for k, v in state.items() if k in trains}
            checkpoint["base_weights"] = dict(self.base_weights)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A fine-tuning checkpoint holds the adapters; the frozen weights are the ones this
        module holds already (loaded from `init_from`, which the recipes verify)."""
        state = checkpoint.get("state_dict")
        if "base_weights" in checkpoint and state is not None:
            for name, value in self.state_dict().items():
                if not is_adapter(name):
                    state.setdefault(name, value)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        loss: torch.Tensor = self.net(inputs, targets=targets)
        return loss

    def count_processed(self, inputs: torch.Tensor) -> None:
        """Batches of records padded to their longest (instruction data) are shorter than the
        context: the throughput callback counts the tokens and FLOPs of the latest batch's
        length, padding included (it is computed)."""
        length = inputs.size(1)
        if length != self.tokens_per_sample:
            self.tokens_per_sample = length
            self.flops_per_sample = self.net.flops_per_token(length) * length

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        self.count_processed(batch[0])
        loss = self._loss(batch)
        # Not on the progress bar: Lightning reads progress-bar values to the host every step.
        if is_logging_step(self):
            self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.val_loss(self._loss(batch), weight=counted(batch[1]))
        self.log("val/loss", self.val_loss, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.log("val/bits_per_byte", self.val_loss.compute() * self.tokens_per_byte("val") / LN2)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.test_loss(self._loss(batch), weight=counted(batch[1]))
        self.log("test/loss", self.test_loss)

    def on_test_epoch_end(self) -> None:
        self.log(
            "test/bits_per_byte", self.test_loss.compute() * self.tokens_per_byte("test") / LN2
        )

    def tokens_per_byte(self, split: str) -> float:
        """Of the split's text (of its responses, for instruction data), from a data module that
        knows it; 1 for bytes."""
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer else None
        ratio = getattr(datamodule, "tokens_per_byte", None)
        return float(ratio(split)) if callable(ratio) else 1.0

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """The prompt (1, seq) and its sampled continuation."""
        return self.net.generate(batch, **self.generation)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        trainer = self.trainer
        return configure_optimizers(
            self.net, self.optimizer, self.scheduler, int(trainer.estimated_stepping_batches),
            trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None,
        )  # fmt: skip


def counted(targets: torch.Tensor) -> torch.Tensor:
    """How many of a batch's targets the loss averages: its weight among the batches."""
    return (targets != IGNORED).sum()
