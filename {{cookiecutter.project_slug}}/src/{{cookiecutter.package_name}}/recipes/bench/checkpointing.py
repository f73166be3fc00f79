"""How long a checkpoint holds training up under `strategy=model_parallel`, for each way of
writing it (`trainer.strategy.checkpoint`): one file gathered on rank 0, a folder of shards
written while training waits, and the same written in the background.

    {{ cookiecutter.package_name }}-bench{% if cookiecutter.examples != "vision" %} experiment=gpt2_small{% endif %} strategy=model_parallel bench.checkpointing=true

Each mode trains `bench.warmup + bench.steps` steps from the same start and saves every
`bench.save_every` steps; the stall is the time `save_checkpoint` kept the training loop waiting,
the write the time until the checkpoint was complete on disk, and the wait the part of the stall
spent on the previous save's write (saves closer together than a write takes).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from ...errors import ConfigError
from ...run.machine import resolve_accelerator, resolve_precision, use_hydra_logging_only
from ...run.strategies import ShardedCheckpointStrategy
from ...targets import build
from .report import command_line, publish

BENCH_ORDER = ("consolidated", "sync", "async")


def timed_saves(
    cfg: DictConfig, mode: str, folder: Path, accelerator: str, precision: str
) -> dict[str, Any]:
    settings = cfg.bench
    L.seed_everything(int(cfg.get("seed") or 0), workers=True)
    strategy = build(cfg.trainer.strategy, where="trainer.strategy", checkpoint=mode)
    saving = ModelCheckpoint(
        dirpath=folder / mode, every_n_train_steps=settings.save_every, save_top_k=-1
    )
    trainer = build(
        cfg.trainer,
        where="trainer",
        accelerator=accelerator,
        precision=precision,
        strategy=strategy,
        callbacks=[saving],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=-1,
        max_steps=settings.warmup + settings.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    started = time.perf_counter()
    trainer.fit(build(cfg.model, where="model"), datamodule=build(cfg.data, where="data"))
    wall = time.perf_counter() - started
    saves = len(strategy.stalls)
    return {
        "saves": saves,
        "stall_median_s": statistics.median(strategy.stalls) if saves else None,
        "write_median_s": statistics.median(strategy.writes) if saves else None,
        "wait_median_s": statistics.median(strategy.waits) if saves else None,
        "fit_wall_s": wall,
        "checkpoint_bytes": sum(
            path.stat().st_size for path in (folder / mode).rglob("*") if path.is_file()
        ),
    }


def bench_checkpointing(cfg: DictConfig) -> dict[str, Any]:
    settings = cfg.bench
    strategy = cfg.trainer.strategy
    sharded = isinstance(strategy, DictConfig) and strategy.get("_target_", "").endswith(
        f".{ShardedCheckpointStrategy.__name__}"
    )
    if not sharded:
        raise ConfigError(
            "bench.checkpointing=true measures the checkpoints of strategy=model_parallel: add it."
        )
    accelerator = resolve_accelerator(str(cfg.trainer.accelerator))
    precision = resolve_precision(str(cfg.trainer.precision), accelerator)
    use_hydra_logging_only()
    folder = Path(tempfile.mkdtemp(prefix="bench-checkpoints-", dir=cfg.paths.output_dir))
    results: dict[str, Any] = {"command": command_line(), "save_every": settings.save_every}
    try:
        for mode in BENCH_ORDER:
            results[mode] = timed_saves(cfg, mode, folder, accelerator, precision)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if getattr(rank_zero_only, "rank", 0) == 0:
        publish(results, Path(settings.output), report(results))
    return results


def report(results: dict[str, Any]) -> str:
    lines = [
        f"Checkpoint every {results['save_every']} steps: {results['command']}",
        f"  {'mode':<14}{'saves':>7}{'stall/save s':>15}{'of it waiting':>15}"
        f"{'write/save s':>15}{'fit wall s':>13}{'size MB':>10}",
    ]
    for mode in BENCH_ORDER:
        row = results[mode]
        lines.append(
            f"  {mode:<14}{row['saves']:>7}{row['stall_median_s'] or 0:>15.3f}"
            f"{row['wait_median_s'] or 0:>15.3f}{row['write_median_s'] or 0:>15.3f}"
            f"{row['fit_wall_s']:>13.1f}{row['checkpoint_bytes'] / 1e6:>10.1f}"
        )
    if (results["async"]["wait_median_s"] or 0) > 0.5 * (results["async"]["stall_median_s"] or 1):
        lines.append(
            "  Most of the async stall waited for the previous save's write: the saves came "
            "faster than the disk took them. Raise bench.save_every to measure the stall alone."
        )
    return "\n".join(lines)
