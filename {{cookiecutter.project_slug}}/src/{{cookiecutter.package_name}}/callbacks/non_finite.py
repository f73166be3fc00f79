from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from ..errors import TrainingError

log = logging.getLogger(__name__)

ACTIONS = ("stop", "skip")


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2, tensor parallel) whole value; a plain tensor as it is."""
    gather = getattr(value, "full_tensor", None)
    return gather() if callable(gather) else value


class NonFiniteGuard(Callback):
    """A NaN or infinite gradient norm (which a non-finite loss gives too) never reaches the
    weights: the optimizer step is not applied. Then `action=stop` stops the run, naming the step,
    and `action=skip` goes on, stopping only after `max_skipped` such steps.

    Fused optimizers (AdamW(fused=True), the default here) skip the step on the device, through
    the `found_inf` flag that AMP's GradScaler uses, so no step waits for the host: the check runs
    every `check_every_n_steps`, before every checkpoint and at the end. Other optimizers check
    at every step."""

    def __init__(
        self, action: str = "stop", max_skipped: int = 10, check_every_n_steps: int = 50
    ) -> None:
        if action not in ACTIONS:
            raise TrainingError(f"callbacks.non_finite.action={action}: use stop or skip.")
        self.action = action
        self.max_skipped = max_skipped
        self.check_every_n_steps = max(1, check_every_n_steps)
        self.pending: torch.Tensor | None = None
        self.first_bad_step: torch.Tensor | None = None
        self.skipped = 0

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        present = [grad for grad in grads if grad is not None]
        if not present:
            return
        bad = ~torch.isfinite(full_tensor(torch.nn.utils.get_total_norm(present, foreach=True)))
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            # Sharded strategies see only their shard's gradients: skip on every rank or none.
            flag = bad.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            bad = flag.bool()
        step = trainer.global_step
        if getattr(optimizer, "_step_supports_amp_scaling", False) and not self.uses_grad_scaler(
            trainer
        ):
            optimizer.found_inf = bad.float()  # type: ignore[attr-defined]
            self.record(bad, step)
            if (step + 1) % self.check_every_n_steps == 0:
                self.check()
            return
        if bool(bad):
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None
            self.record(bad, step)
            self.check()

    @staticmethod
    def uses_grad_scaler(trainer: L.Trainer) -> bool:
        return getattr(trainer.precision_plugin, "scaler", None) is not None

    def record(self, bad: torch.Tensor, step: int) -> None:
        if self.pending is None or self.first_bad_step is None:
            self.pending = torch.zeros((), dtype=torch.int64, device=bad.device)
            self.first_bad_step = torch.full((), -1, dtype=torch.int64, device=bad.device)
        self.pending += bad
        unseen = bad & (self.first_bad_step < 0)
        self.first_bad_step = torch.where(unseen, step, self.first_bad_step)

    def check(self) -> None:
        """The host sync: how many steps were not applied since the last check."""
        if self.pending is None or self.first_bad_step is None:
            return
        count, first = int(self.pending), int(self.first_bad_step)
        if not count:
            return
        self.pending.zero_()
        self.first_bad_step.fill_(-1)
        self.skipped += count
        what = f"Non-finite loss or gradient norm at step {first}"
        if self.action == "stop":
            raise TrainingError(
                f"{what}: that step was not applied and training stopped; the weights and the "
                "checkpoints so far are finite. Lower the learning rate, check the data, or set "
                "callbacks.non_finite.action=skip to skip such steps."
            )
        log.warning("%s: %d step(s) skipped, %d in all.", what, count, self.skipped)
        if self.skipped > self.max_skipped:
            raise TrainingError(
                f"{self.skipped} training steps had a non-finite loss or gradient norm, more "
                f"than callbacks.non_finite.max_skipped={self.max_skipped}: training stopped."
            )

    def state_dict(self) -> dict[str, Any]:
        """The steps skipped so far, those not yet checked included (Lightning asks for this
        before `on_save_checkpoint` checks them): a resumed run goes on counting to max_skipped."""
        pending = int(self.pending) if self.pending is not None else 0
        return {"skipped": self.skipped + pending}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.check()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check()
