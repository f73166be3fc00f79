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

from .nets.backbones import BackboneClassifier
from .optim import OptimizerFactory, SchedulerFactory, clip_gradients, configure_optimizers
from .step_logging import is_logging_step


class ImageClassifier(L.LightningModule):
    """Classifies images with `net`, or with a pretrained `backbone` and a new linear head for
    `num_classes` (`head_dropout` before it). For a backbone: `freeze_backbone` trains the head
    only (a linear probe), and `backbone_lr_scale` multiplies the learning rate of the backbone's
    parameter groups (0.1: a tenth of the head's)."""

    def __init__(
        self,
        optimizer: OptimizerFactory,
        net: nn.Module | None = None,
        scheduler: SchedulerFactory | None = None,
        num_classes: int = 10,
        compile: bool = False,
        backbone: nn.Module | None = None,
        head_dropout: float = 0.0,
        freeze_backbone: bool = False,
        backbone_lr_scale: float = 1.0,
    ) -> None:
        super().__init__()
        # Plain values only, so checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler", "backbone"])
        self.net = classifier_net(
            net, backbone, num_classes, head_dropout, freeze_backbone, backbone_lr_scale
        )
        self.backbone_lr_scale = float(backbone_lr_scale)
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
        trainer = self.trainer
        return configure_optimizers(
            self.net, self.scaled_optimizer(), self.scheduler, int(trainer.estimated_stepping_batches),
            trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None,
        )  # fmt: skip

    def scaled_optimizer(self) -> OptimizerFactory:
        """The optimizer factory, with the backbone's parameter groups at `backbone_lr_scale`
        times the learning rate where that is not 1."""
        if not isinstance(self.net, BackboneClassifier) or self.backbone_lr_scale == 1.0:
            return self.optimizer
        return BackboneLearningRate(self.optimizer, self.net.backbone, self.backbone_lr_scale)


def classifier_net(
    net: nn.Module | None,
    backbone: nn.Module | None,
    num_classes: int,
    head_dropout: float,
    freeze_backbone: bool,
    backbone_lr_scale: float,
) -> nn.Module:
    """`net` as it is, or `backbone` with a new head; the backbone settings checked."""
    if (net is None) == (backbone is None):
        given = "both are set" if net is not None else "neither is set"
        raise ValueError(
            f"give one of model.net (a whole network) and model.backbone (a pretrained backbone "
            f"that gets a new head) ({given})."
        )
    if not isinstance(freeze_backbone, bool):
        raise ValueError(f"model.freeze_backbone={freeze_backbone!r}: use true or false.")
    if isinstance(backbone_lr_scale, bool) or not (
        isinstance(backbone_lr_scale, (int, float)) and 0 <= backbone_lr_scale < float("inf")
    ):
        raise ValueError(
            f"model.backbone_lr_scale={backbone_lr_scale!r}: use a number of 0 or more (the "
            "backbone's learning rate over the head's)."
        )
    if backbone is None:
        assert net is not None
        if freeze_backbone or backbone_lr_scale != 1:
            raise ValueError(
                "model.freeze_backbone and model.backbone_lr_scale apply to a pretrained "
                "backbone (model=backbone_classifier), and this model's net has none."
            )
        return net
    return BackboneClassifier(backbone, num_classes, head_dropout, frozen=freeze_backbone)


class BackboneLearningRate:
    """An optimizer factory that splits each parameter group it is given into the head's part
    and the backbone's, the backbone's at `scale` times the configured learning rate. Keeps the
    factory's `keywords` (the weight decay that the groups are made with)."""

    def __init__(self, optimizer: OptimizerFactory, backbone: nn.Module, scale: float) -> None:
        self.optimizer = optimizer
        self.keywords: dict[str, Any] = dict(getattr(optimizer, "keywords", {}))
        if not isinstance(self.keywords.get("lr"), (int, float)):
            raise ValueError(
                "model.backbone_lr_scale scales model.optimizer.lr, which is not set: set it."
            )
        self.backbone = {id(p) for p in backbone.parameters()}
        self.scale = scale

    def __call__(self, params: list[dict[str, Any]], **kwargs: Any) -> torch.optim.Optimizer:
        lr = float(self.keywords["lr"])
        groups: list[dict[str, Any]] = []
        for group in params:
            name = group.get("name", "params")
            ours = [p for p in group["params"] if id(p) in self.backbone]
            head = [p for p in group["params"] if id(p) not in self.backbone]
            if head:
                groups.append({**group, "params": head, "name": f"head/{name}"})
            if ours:
                groups.append(
                    {**group, "params": ours, "name": f"backbone/{name}", "lr": lr * self.scale}
                )
        return self.optimizer(params=groups, **kwargs)
