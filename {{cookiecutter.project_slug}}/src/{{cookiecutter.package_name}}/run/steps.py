"""Steps that the recipes (`train`, `evaluate`) share: building the trainer, one-line config
errors, stopping on a signal with exit code 143, and writing the metrics."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..callbacks.preemption import Preempted
from ..checkpointing.saving import AtomicCheckpointIO
from ..errors import ConfigError
from ..files import write_text_atomically
from ..targets import build
from . import stop_signals
from .machine import configure_matmul_precision, use_hydra_logging_only
from .plan import Machine

log = logging.getLogger(__name__)


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items()}


def build_model_and_data(
    model_cfg: Any, data_cfg: Any, where: str = ""
) -> tuple[L.LightningModule, L.LightningDataModule]:
    """The model and data module that the configs name, refused in one line where a `_target_`
    builds something else (`where`: the checkpoint the configs came from)."""
    source = f"the run_config stored in {where}" if where else "the config"
    datamodule = build(data_cfg, source, "data")
    model = build(model_cfg, source, "model")
    for key, built, kind in (
        ("data", datamodule, L.LightningDataModule),
        ("model", model, L.LightningModule),
    ):
        if not isinstance(built, kind):
            source = f"the run_config stored in {where}" if where else "this config"
            raise ConfigError(
                f"{key}._target_ in {source} builds a {type(built).__name__}, not a "
                f"{kind.__name__}: name a {kind.__name__} class there."
            )
    return model, datamodule


@contextmanager
def exit_143_on_stop_signals() -> Iterator[None]:
    """Watch SIGTERM/SIGUSR1/SIGUSR2 and Ctrl-C for the whole run; a run stopped by one exits with
    code 143 (130 for Ctrl-C; never 0: a scheduler would record success), also where Lightning's
    own handler stopped it."""
    try:
        with stop_signals.watch():
            yield
    except Preempted as stopped:
        said = stopped.finish()
        log.warning("%s" if stopped.by_ctrl_c else "Stopped: %s", said)
        raise SystemExit(stopped.exit_code) from None
    except SIGTERMException:
        log.warning("Stopped by SIGTERM; run the same command to resume.")
        raise SystemExit(stop_signals.STOPPED_BY_SIGNAL_EXIT_CODE) from None


def leave_process_group() -> None:
    """Every rank finishes before any leaves, then each closes its process group. Without it, a
    rank that exits while another still tears down can take the job's store with it, and the
    other rank's communication threads abort it (SIGABRT; seen with two torchrun nodes)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def trainer_plugins() -> list[Any]:
    """Atomic checkpoint writes; under SLURM, Lightning's own requeue handler off (it saves in the
    middle of a step): callbacks.preemption saves and requeues at a step boundary instead."""
    plugins: list[Any] = [AtomicCheckpointIO()]
    if SLURMEnvironment.detect():
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return plugins


def build_trainer(
    trainer_cfg: Any,
    machine: Machine,
    matmul_precision: str | None,
    callbacks: list[Any],
    loggers: list[Any],
) -> L.Trainer:
    """The `trainer` config node built on the plan's machine."""
    configure_matmul_precision(matmul_precision)
    use_hydra_logging_only()
    log.info("Accelerator %s, precision %s", machine.accelerator, machine.precision)
    return build(
        trainer_cfg,
        where="trainer",
        accelerator=machine.accelerator,
        precision=machine.precision,
        callbacks=callbacks,
        logger=loggers or False,
        plugins=trainer_plugins(),
    )


def write_json(metrics: dict[str, float] | list[str], path: Path) -> None:
    """Atomically: a kill leaves the old file or the new one, never a part."""
    write_text_atomically(json.dumps(metrics, indent=2, sort_keys=True) + "\n", path)


def write_metrics(metrics: dict[str, float], output_dir: str) -> None:
    write_json(metrics, Path(output_dir) / "metrics.json")
    summary = "  ".join(f"{name}={value:.4f}" for name, value in sorted(metrics.items()))
    log.info("Metrics: %s", summary)
    log.info("Outputs in %s", output_dir)
