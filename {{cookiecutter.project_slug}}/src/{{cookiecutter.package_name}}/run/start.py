"""Where a run starts: its own newest checkpoint, another run's (`ckpt_path`), another run's
weights only (`init_from`{% if cookiecutter.examples != "vision" %}, which may also be a Hugging Face GPT-2 folder{% endif %}), or nothing."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

from ..callbacks.exact_resume import fit_state
from ..checkpointing.door import is_sharded, read_checkpoint, read_fit_state
from ..checkpointing.saving import check_same_model, newest_valid_checkpoint
from ..checkpointing.trained import load_init_weights
from ..errors import ConfigError
from .machine import is_global_zero
from .plan import StartPlan

log = logging.getLogger(__name__)


@dataclass
class Start:
    """The checkpoint a run starts from; `resumed` when it is this run directory's own."""

    path: str | None = None
    weights_only: bool = True
    resumed: bool = False


def starting_checkpoint(plan: StartPlan, model: L.LightningModule) -> Start:
    """The newest valid checkpoint of this run directory, else `ckpt_path`, else none; only a
    trusted external checkpoint may load without weights_only=True."""
    max_steps = int(plan.max_steps or -1)

    def ends_unfinished(state: dict[str, Any]) -> str | None:
        at_end = 0 < max_steps <= int(state.get("global_step", 0))
        if not at_end or fit_state(state).get("fit_finished"):
            return None
        return (
            "written at the last step, before fit ended: Lightning would skip the end of the "
            "epoch and of fit from it, so the run goes on from an earlier checkpoint"
        )

    newest = newest_valid_checkpoint(plan.checkpoints, ends_unfinished) if plan.resume else None
    if newest:
        log.info("Resuming from %s", newest)
        return Start(str(newest), True, True)
    if plan.ckpt_path:
        path = plan.ckpt_path
        checkpoint = read_checkpoint(path, trust=plan.trust_checkpoint)
        check_same_model(checkpoint, model, path)
        if is_sharded(path) and not plan.continues_shards:
            raise ConfigError(
                f"ckpt_path={path} is a folder of shards, which only strategy=model_parallel "
                "continues: add it (with trainer.strategy.data_parallel_size), or start a new "
                f"run from its weights with init_from={path}."
            )
        done, limit = epochs_done(checkpoint), plan.max_epochs
        if isinstance(done, int) and isinstance(limit, int) and 0 <= limit < done:
            raise ConfigError(
                f"trainer.max_epochs={limit}, but ckpt_path={path} has trained {done} epochs, and "
                "this run continues its counters: give a higher limit, or start a new run from "
                f"its weights with init_from={path}."
            )
        log.info("Starting from ckpt_path=%s", path)
        return Start(str(path), not plan.trust_checkpoint)
    log.info("Starting fresh: no checkpoint in %s", plan.checkpoints)
    return Start()


def start_from_weights(plan: StartPlan, model: L.LightningModule, start: Start) -> None:
    """`init_from`: a new run from another run's weights, with a fresh optimizer, schedule and
    step counter. With LoRA adapters only they train, and checkpoints hold only them, with the
    SHA-256 of the weights' file (of a folder's files) that a resumed run checks."""
    if not plan.init_from:
        return
    if plan.ckpt_path:
        raise ConfigError(
            "init_from and ckpt_path are both set: ckpt_path continues another run (its optimizer "
            "and step counter too), init_from starts a new run from its weights. Keep one."
        )
    base = load_init_weights(model, plan.init_from, trust=plan.trust_checkpoint)
    adapted: list[str] = getattr(model, "adapted", [])
    if adapted:
        model.base_weights = base  # type: ignore[assignment]
    if is_global_zero():
        log.info("Starting from the weights of %s", base["path"])
    if adapted and is_global_zero():
        trains = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        log.info(
            "LoRA on %d layers: %d of %d parameters train (%.2f %%)",
            len(adapted), trains, total, 100 * trains / total,
        )  # fmt: skip
    if start.resumed and start.path:
        stored = read_fit_state(Path(start.path))
        recorded = stored.get("base_weights")
        if recorded and recorded["sha256"] != base["sha256"]:
            restore = "those files" if Path(base["path"]).is_dir() else "that file"
            raise ConfigError(
                f"init_from={base['path']} has changed since this run started from it (its "
                f"checkpoint {start.path} was trained on other weights): restore {restore}, or "
                "start a new run with another run_name=..."
            )


def epochs_done(state: dict[str, Any]) -> Any:
    """The epochs that a checkpoint's fit loop completed (Lightning's `current_epoch` once it is
    restored), or None."""
    found: Any = state
    for key in ("loops", "fit_loop", "epoch_progress", "current", "completed"):
        found = found.get(key) if isinstance(found, dict) else None
    return found
